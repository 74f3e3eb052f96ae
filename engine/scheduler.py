"""Continuous batching with a per-step token budget, chunked prefill and preemption.

Each step: running sequences first (decodes before unfinished prefills, so a stream never
stalls behind a long prompt), then waiting requests FCFS while the budget, the batch size and
the KV pool allow. The token budget (chunk size) applies while some request is decoding. Everything planned runs in ONE forward (a mixed batch). When the pool runs
out, the latest-admitted running sequence is preempted by recompute: its blocks are released
(their cached prefix usually survives) and it goes back to the head of the queue.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int          # new tokens computed this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token, so logits are needed."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq.token_ids)


@dataclass
class StepPlan:
    items: list[ScheduledSeq]
    failed: list[Sequence]   # requests that can never fit the pool (finish with an error)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items if i.seq.in_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items if not i.seq.in_prefill)

    @property
    def decode_only(self) -> bool:
        """Running decodes only, one token each: such a step's time says how fast decoding is."""
        return all(i.num_tokens == 1 and i.samples for i in self.items)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, chunk_size: int | None,
                 kv_cache: bool = True):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.chunk_size = chunk_size          # None: each prefill in one piece
        self.kv_cache = kv_cache              # False: naive mode, recompute everything every step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or cancelled sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)

    def schedule(self) -> StepPlan:
        """This step's work: running sequences first (decodes before unfinished prefills, each
        given the blocks it needs, preempting the latest admitted when the pool is full), then
        waiting ones admitted while the batch, the budget and the pool allow."""
        # The budget exists to keep running streams smooth: with no decode to protect, a prompt
        # goes in one piece (on CPU every extra step re-reads all the weights).
        decoding = any(s.t_first_token is not None for s in self.running)
        step = _PlanBuilder(self.chunk_size if (self.chunk_size and self.kv_cache and decoding) else None)
        self._schedule_running(step)
        self._admit_waiting(step)
        return StepPlan(step.items, step.failed)

    def _schedule_running(self, step: "_PlanBuilder") -> None:
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed > 1):
            if seq.status is not Status.RUNNING:          # preempted earlier in this loop
                continue
            if not self.kv_cache:
                seq.num_computed_tokens = 0
            if step.spent and seq.num_uncomputed > 1:
                continue                                   # unfinished prefill waits a step
            n = step.take(seq)
            while not self.blocks.ensure_capacity(seq, seq.num_computed_tokens + n):
                victim = max((s for s in self.running), key=lambda s: s.admitted_order)
                if victim is seq and len(self.running) == 1:
                    # Alone and still out of blocks: the pool cannot hold this sequence.
                    self.running.remove(seq)
                    self.blocks.free_seq(seq)
                    step.failed.append(seq)
                    break
                self._preempt(victim)
                step.preempted = True
                step.unplan(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING and seq not in step.failed:
                step.add(seq, n)

    def _admit_waiting(self, step: "_PlanBuilder") -> None:
        while self.waiting and not step.preempted and len(self.running) < self.max_num_seqs:
            if step.spent:
                break
            seq = self.waiting[0]
            first_admission = seq.num_cached_prompt_tokens is None
            hit = self.blocks.match_prefix(seq) if self.kv_cache else 0
            seq.num_computed_tokens = hit
            n = step.take(seq)
            if not self.blocks.ensure_capacity(seq, seq.num_computed_tokens + n):
                self.blocks.free_seq(seq)
                seq.num_computed_tokens = 0
                if not self.running and not step.items:
                    self.waiting.popleft()
                    step.failed.append(seq)
                    continue
                break
            self.waiting.popleft()
            if first_admission:
                seq.num_cached_prompt_tokens = hit
                self.blocks.record_lookup(seq.num_prompt_tokens, hit)
            if seq.t_first_scheduled is None:
                seq.t_first_scheduled = time.perf_counter()
            seq.status = Status.RUNNING
            seq.admitted_order = next(self._admissions)
            self.running.append(seq)
            step.add(seq, n)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.num_computed_tokens = seq.draft_computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)


class _PlanBuilder:
    """A step's plan while it is being built: the items, the failed, and the token budget left
    (None: no budget, each prefill in one piece)."""

    def __init__(self, budget: int | None):
        self.budget = budget
        self.items: list[ScheduledSeq] = []
        self.failed: list[Sequence] = []
        # After a preemption nothing new is admitted this step.
        self.preempted = False

    @property
    def spent(self) -> bool:
        return self.budget is not None and self.budget <= 0

    def take(self, seq: Sequence) -> int:
        """How many of seq's uncomputed tokens go in: all, or what the budget leaves (at least one)."""
        n = seq.num_uncomputed
        return n if self.budget is None else min(n, max(self.budget, 1))

    def add(self, seq: Sequence, n: int) -> None:
        self.items.append(ScheduledSeq(seq, n))
        if self.budget is not None:
            self.budget -= n

    def unplan(self, seq: Sequence) -> None:
        """A sequence preempted after it was planned leaves the plan and gives its tokens back."""
        for item in [i for i in self.items if i.seq is seq]:
            self.items.remove(item)
            if self.budget is not None:
                self.budget += item.num_tokens
