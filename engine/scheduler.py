"""Continuous batching with a per-step budget, chunked prefill and preemption.

Each step: running sequences first (decodes before unfinished prefills, so a stream never
stalls behind a long prompt), then waiting requests FCFS while the budget, the batch size and
the KV pool allow. Everything planned runs in ONE forward (a mixed batch).

The budget applies while some request is decoding, to keep its stream smooth. By default it is
time: a step may take `step_budget` decode steps, and prompt slices are sized by the cost model
(step_cost.py) to fill it: small late in a long prompt, where attention costs more, larger early
on. A fixed `chunk_size` budgets tokens instead. With no stream to protect a prompt goes in one
piece (on a CPU every extra step re-reads all the weights).

When the pool runs out, the latest-admitted running sequence is preempted by recompute: its
blocks are released (their cached prefix usually survives) and it goes back to the head of the
queue.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from pdchat.kernels import FastRows

from .block_manager import BlockManager
from .sequence import Sequence, Status
from .step_cost import StepCost, attention_pairs

# Where rows go by any count (a GPU), a prompt slice is never smaller than this while any budget is
# left: below it a step runs far below the prefill's efficiency. Where they go by vectors (a CPU)
# the floor is the slice that ends the vector the step's decodes began (_PlanBuilder._min_slice).
MIN_SLICE = 16
# Before a decode step was measured, a time budget cannot be sized: a fixed slice stands in.
FIRST_SLICE = 32


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int          # new tokens computed this step, starting at seq.num_computed_tokens
    start: int = 0           # seq.num_computed_tokens when planned

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token, so logits are needed."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq.token_ids)


@dataclass
class StepPlan:
    items: list[ScheduledSeq]
    failed: list[Sequence]   # requests that can never fit the pool (finish with an error)
    prompt_tokens: int = 0   # prompt tokens computed (prefill), and the query-key pairs they score
    prompt_pairs: int = 0
    predicted_s: float = 0.0         # the cost model's guess of a step with prompt tokens (prefill progress)
    timed: bool = False              # a time budget sized the step's prompt slices

    @property
    def planned_s(self) -> float | None:
        """The step's predicted time where a time budget sized it (what the panel compares)."""
        return self.predicted_s if self.timed else None

    @property
    def num_decode_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items) - self.prompt_tokens

    @property
    def decode_only(self) -> bool:
        """Running decodes only, one token each: such a step's time says how fast decoding is."""
        return all(i.num_tokens == 1 and i.samples for i in self.items)


class Scheduler:
    def __init__(self, blocks: BlockManager, cost: StepCost, *, max_num_seqs: int, chunk_size: int | str | None,
                 step_budget: float, kv_cache: bool = True):
        self.blocks = blocks
        # Learned step times (the engine records each step), and the kernels' fast path
        # (cost.fast_rows): a time-budgeted slice stops at its rows, past which a step cost ~2x what
        # its rows say (measured: a 44-token slice 109-137 ms where 62-75 were planned, when the
        # path ended at 40 rows).
        self.cost = cost
        self.max_num_seqs = max_num_seqs
        self.chunk_size = chunk_size          # "auto": time budget; N: N tokens; None: prompts whole
        self.step_budget = step_budget        # a step's time while others decode, in decode steps
        self.kv_cache = kv_cache              # False: naive mode, recompute everything every step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def streaming(self) -> bool:
        """Some running request is decoding: its stream is what a step's budget protects."""
        return any(s.t_first_token is not None for s in self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose prompt was prefilled elsewhere (its K/V already in its blocks) joins
        the batch; its next step computes the prompt's last token and samples."""
        seq.status = Status.RUNNING
        seq.admitted_order = next(self._admissions)
        self.running.append(seq)

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
        step = self._budget()
        self._schedule_running(step)
        self._admit_waiting(step)
        return step.plan()

    def record(self, plan: StepPlan, seconds: float, drafted: bool, tile_seconds: float | None = None) -> None:
        """What a step took, for the cost model: a decode-only step without drafts gives the decode
        time, a step with prompt tokens the cost of its prefill work (and of their attention alone,
        `tile_seconds`, where the kernels timed it and no verify's tiles are in it)."""
        if plan.prompt_tokens:
            sliced = _as_slice(plan.prompt_tokens, plan.num_decode_tokens, self.cost.fast_rows)
            self.cost.record_prefill(plan.prompt_tokens, plan.prompt_pairs, sliced, seconds, plan.num_decode_tokens,
                                     attention_s=None if drafted else tile_seconds, timed=plan.timed)
        elif plan.decode_only and not drafted:
            self.cost.record_decode(seconds)

    def _budget(self) -> "_PlanBuilder":
        """This step's budget: none unless someone is decoding; else tokens (a fixed chunk) or
        time (the prefill's share of step_budget decode steps, as the cost model predicts it)."""
        if not (self.streaming and self.kv_cache and self.chunk_size):
            return _PlanBuilder(None, None, self.cost)
        if self.chunk_size != "auto":
            return _PlanBuilder(self.chunk_size, None, self.cost)
        if self.cost.decode_s is None:
            return _PlanBuilder(FIRST_SLICE, None, self.cost)
        return _PlanBuilder(None, self.cost.prompt_seconds(self.step_budget), self.cost)

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


def _as_slice(prompt_tokens: int, other_rows: int, fast_rows: FastRows | None) -> bool:
    """Whether a step's prompt work runs as a time-budgeted slice does, so that the cost model's
    fit of slices is the one to predict or learn it: beside decodes and within the fast path's
    rows. A fixed chunk past them runs op by op, as a lone prompt does, at another cost per token
    (beside a decode, 64 tokens took 118-132 ms, 47 in one call 75): counted with the slices it
    would skew the next ones' size for as long as the fit remembers it."""
    return other_rows > 0 and (fast_rows is None or prompt_tokens + other_rows <= fast_rows.limit)


class _PlanBuilder:
    """A step's plan while it is being built: the items, the failed, and what the budget leaves of
    prompt tokens (`tokens`) or of predicted prefill seconds (`seconds`); neither: no budget, each
    prompt in one piece. Decodes are not charged to a time budget: it is their step to begin with."""

    def __init__(self, tokens: int | None, seconds: float | None, cost: StepCost):
        self.tokens, self.seconds, self.cost = tokens, seconds, cost
        self.items: list[ScheduledSeq] = []
        self.failed: list[Sequence] = []
        self._charged: dict[int, float] = {}       # id(item) -> predicted prefill seconds
        # After a preemption nothing new is admitted this step.
        self.preempted = False

    @property
    def spent(self) -> bool:
        left = self.tokens if self.seconds is None else self.seconds
        return left is not None and left <= 0

    def take(self, seq: Sequence) -> int:
        """How many of seq's uncomputed tokens go in: all, or what the budget leaves (at least
        one; a prompt slice at least the smallest, _min_slice)."""
        n = seq.num_uncomputed
        if self.seconds is not None:
            if n == 1:
                return 1
            planned = sum(i.num_tokens for i in self.items)     # (the decodes are planned first)
            rows = self.cost.fast_rows
            most = None if rows is None else max(min(rows.limit, self.cost.slice_rows_cap(planned)) - planned, 1)
            floor = self.cost.step_seconds(sum(self._charged.values()))    # the step without this slice
            fits = self.cost.tokens_within(self.seconds, seq.num_computed_tokens, planned, most, floor)
            return min(n, max(fits, self._min_slice(planned)), most or n)
        return n if self.tokens is None else min(n, max(self.tokens, 1))

    def _min_slice(self, planned: int) -> int:
        """The smallest slice beside `planned` rows: where rows go by vectors, the one that ends the
        vector the decodes began, or fills the next one where they ended theirs (7 tokens beside
        one decode with vectors of 8: fewer pay the weights' trip for almost nothing, more pay a
        vector they do not fill); else MIN_SLICE. One vector rather than two, so that a step keeps
        to the budget where two do not fit it: until 2026-12-01 the floor was 16 tokens, and late
        slices of a 1,728-token newcomer on a Zen 1 (its products paced by arithmetic, 15 queries'
        attention over 1,600 keys ~45 ms) took 110-140 ms beside a 26 ms decode, worst gaps
        4.7-5.8x the stream's TPOT at budget 3 (3.5-4.0x with one vector)."""
        g = self.cost.granule
        return (planned + g) // g * g - planned if g > 1 else MIN_SLICE

    def add(self, seq: Sequence, n: int) -> None:
        item = ScheduledSeq(seq, n, seq.num_computed_tokens)
        self.items.append(item)
        if self.tokens is not None:
            self.tokens -= n
        if self.seconds is not None and seq.in_prefill:
            others = sum(i.num_tokens for i in self.items) - n
            self._charged[id(item)] = cost = self.cost.prefill_seconds(item.start, n, other_rows=others)
            self.seconds -= cost

    def unplan(self, seq: Sequence) -> None:
        """A sequence preempted after it was planned leaves the plan and gives its budget back."""
        for item in [i for i in self.items if i.seq is seq]:
            self.items.remove(item)
            if self.tokens is not None:
                self.tokens += item.num_tokens
            if self.seconds is not None:
                self.seconds += self._charged.pop(id(item), 0.0)

    def plan(self) -> StepPlan:
        prompt = [i for i in self.items if i.seq.in_prefill]
        tokens = sum(i.num_tokens for i in prompt)
        pairs = sum(attention_pairs(i.start, i.num_tokens) for i in prompt)
        predicted = 0.0
        if prompt:
            others = sum(i.num_tokens for i in self.items) - tokens
            sliced = _as_slice(tokens, others, self.cost.fast_rows)
            predicted = self.cost.step_seconds(self.cost.work_seconds(self.cost.charged(tokens, others, sliced),
                                                                      pairs, sliced))
        return StepPlan(self.items, self.failed, tokens, pairs, predicted,
                        timed=self.seconds is not None and bool(prompt))
