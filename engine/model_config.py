"""The model shape our Llama-family code needs, read from a Hugging Face config.

One dataclass for every supported family; the differences (qkv bias, q/k norm, tied
embeddings, RoPE scaling) are flags, not subclasses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ModelLoadError, UnsupportedModel

SUPPORTED_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
# RoPE scaling kinds we implement, and the settings each needs.
ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
_REQUIRED = object()


def _positive(cfg: dict[str, Any], key: str, source: str, default: Any = _REQUIRED, kind: type = int) -> Any:
    """cfg[key] as a positive `kind` (int: a whole number); `default` when absent or null."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"{source} has no {key!r}, which the model needs")
        return default
    numbers = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, numbers) or not value > 0:
        what = "number" if kind is float else "whole number"
        raise ModelLoadError(f"{source}: {key!r} must be a positive {what}, got {value!r}")
    return kind(value)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: Any, source: str = "config.json") -> "ModelConfig":
        """Read a Hugging Face config; `source` names it in errors (the file's path). A config that
        is not an object, or lacks or garbles a key the model needs, is a ModelLoadError; an
        architecture or RoPE scaling we do not implement, UnsupportedModel."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{source} holds a JSON {type(cfg).__name__}, not an object of model settings")
        mtype = cfg.get("model_type", "")
        if mtype not in SUPPORTED_TYPES:
            raise UnsupportedModel(
                f"model type {mtype!r} in {source} is not supported (supported: {', '.join(sorted(SUPPORTED_TYPES))})"
            )
        heads = _positive(cfg, "num_attention_heads", source)
        hidden = _positive(cfg, "hidden_size", source)
        kv_heads = _positive(cfg, "num_key_value_heads", source, default=heads)
        head_dim = _positive(cfg, "head_dim", source, default=hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(f"{source}: {heads} attention heads cannot share {kv_heads} key-value heads evenly")
        if head_dim % 2:
            raise ModelLoadError(f"{source}: the head size must be even for RoPE, got {head_dim}")
        # transformers 5 moved rope_theta/rope_scaling into rope_parameters; accept both layouts.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ModelLoadError(f"{source}: the RoPE settings must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_KEYS:
            raise UnsupportedModel(f"RoPE scaling {rope_type!r} in {source} is not supported "
                                   f"({', '.join(ROPE_KEYS)} are)")
        for key in ROPE_KEYS[rope_type]:
            _positive(rope, key, f"{source} (RoPE settings)", kind=float)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=mtype,
            vocab_size=_positive(cfg, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_positive(cfg, "intermediate_size", source),
            num_layers=_positive(cfg, "num_hidden_layers", source),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive(cfg, "rms_norm_eps", source, default=1e-6, kind=float),
            rope_theta=_positive(cfg, "rope_theta", source, default=rope.get("rope_theta", 10000.0), kind=float),
            max_position=_positive(cfg, "max_position_embeddings", source, default=2048),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=mtype == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=mtype == "qwen3",
            rope_scaling=rope if rope_type != "default" else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse frequencies as transformers computes them, with the config's scaling."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = self.rope_scaling
        if not scaling:
            return inv_freq
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "linear":
            return inv_freq / scaling["factor"]
        if kind == "llama3":
            factor = scaling["factor"]
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            old_len = scaling["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        raise UnsupportedModel(f"RoPE scaling {kind!r} is not supported (default, linear, llama3 are)")

    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return L * per_layer + emb + h
