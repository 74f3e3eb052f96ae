"""A request's state as the engine tracks it: tokens, computed count, blocks, timestamps."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

from .config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: Hashable = None            # prefix-cache namespace (e.g. a model or adapter id)
    token_ids: list[int] = field(default_factory=list)      # prompt + output
    # Tokens whose K/V are in the cache. Explicit state, never inferred from other fields.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # of committed full blocks, in order
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    admitted_order: int = -1              # larger = admitted later (preemption picks the largest)
    num_cached_prompt_tokens: int | None = None
    preemptions: int = 0
    # timestamps (time.perf_counter seconds)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first_scheduled: float | None = None
    t_first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    # speculative decoding counters
    spec_method: str | None = None
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0
    spec_k: int = 0                       # current draft length (adaptive); 0 = not set yet
    spec_off: bool = False                # speculation stopped for this request (low acceptance)
    spec_recent: list[tuple[int, int]] = field(default_factory=list)   # (drafted, accepted)
    draft_computed: int = 0               # positions whose K/V a draft model holds in its own pool
    # disaggregated prefill (engine/disaggregation): when the prefill worker finished this prompt,
    # when its K/V were in this engine's pool, and how many bytes crossed
    t_prefilled: float | None = None
    t_kv_arrived: float | None = None
    kv_transfer_bytes: int | None = None
    generator: Any = None                 # torch.Generator of a seeded request
    sink: Any = None                      # where events go (a RequestStream)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """Still computing tokens it already has (prompt, or all of it again after preemption)."""
        return self.num_uncomputed > 1 or self.t_first_token is None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
