"""Engine and sampling configuration: plain dataclasses, validated once."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .errors import InvalidRequest

DEFAULT_MODEL = "smollm2-135m"
# Below this temperature sampling is greedy: logits / t would overflow fp32 (a logit of 10 over
# 1e-40 is inf, then softmax is NaN), and the distribution is one-hot long before that anyway.
# vLLM draws the line at the same place.
GREEDY_BELOW_TEMPERATURE = 1e-5
# torch.Generator takes 64-bit seeds, signed or not (it folds negative ones).
SEED_RANGE = (-(2**63), 2**64)


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    device: str = "auto"               # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    block_size: int = 16
    kv_cache_mb: float | None = None   # KV pool budget; None: 512 MB on CPU, a share of free memory on GPU
    num_kv_blocks: int | None = None   # exact pool size in blocks (overrides kv_cache_mb; tests, demos)
    gpu_memory_fraction: float = 0.85  # of the memory free after loading, for the KV pool on GPU
    max_model_len: int | None = None   # None: the model's own context window
    max_num_seqs: int = 64             # max requests in one step (batch size)
    # Per-step token budget for prefill chunks; None: no chunking; "auto": the device's default
    # (picked from `pdchat bench toggles`, see README).
    chunk_size: int | None | str = "auto"
    prefix_cache: bool = True
    kv_cache: bool = True              # False = naive mode: recompute the whole sequence each step
    quant: str = "none"                # none | int8 (weight-only, per-channel)
    spec: str = "off"                  # speculative decoding: off | ngram | draft
    spec_tokens: int = 4               # initial draft length k (adapts per request)
    draft_model: str | None = None     # for spec=draft: a model spec, or None/"self" = target in int8
    # Kernel backend: auto (triton on CUDA, cpu in fp32 on CPU, else torch) | torch | triton | cpu
    kernels: str = "auto"
    threads: int | None = None         # torch intra-op threads on CPU; None: leave torch's default
    seed: int = 0                      # for random: models
    telemetry: bool = True             # sample device utilization on a side thread

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequest(f"block size must be a power of two, got {self.block_size}")
        if self.chunk_size is not None and self.chunk_size != "auto" and self.chunk_size <= 0:
            raise InvalidRequest(f"chunk size must be positive, got {self.chunk_size}")
        if self.quant not in ("none", "int8"):
            raise InvalidRequest(f"unknown quantization {self.quant!r} (none, int8)")
        if self.spec not in ("off", "ngram", "draft"):
            raise InvalidRequest(f"unknown speculative decoding method {self.spec!r} (off, ngram, draft)")
        if self.spec_tokens <= 0:
            raise InvalidRequest(f"spec tokens must be at least 1, got {self.spec_tokens}")
        if self.max_num_seqs <= 0:
            raise InvalidRequest(f"max batch size must be positive, got {self.max_num_seqs}")


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0                     # 0: off
    min_p: float = 0.0                 # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequest(f"max tokens must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top-k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise InvalidRequest(f"min-p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise InvalidRequest(f"seed must be a whole number that fits 64 bits, got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    def with_(self, **changes) -> "SamplingParams":
        return replace(self, **changes)
