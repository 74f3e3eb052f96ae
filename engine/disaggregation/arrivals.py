"""Hand-offs on their way into the engine's KV pool, in the order they arrived: each one once the
batch and the pool have room for its request, and while streams decode, a few layers per step.

Writing a long prompt's K/V into the pool is the decoding core's one share of a hand-off (80 MB
for 1,728 tokens of the default model: 16-21 ms measured, a third of a decode step on one core);
written at once, it would land inside one gap of every running stream. So while some stream
decodes, a step writes only the layers that fit IMPORT_SHARE of a decode step, at the write rate
measured so far; the request joins the batch when its last layer is in.
"""
from __future__ import annotations

import time
from collections import deque

from ..block_manager import BlockManager
from ..model_runner import ModelRunner
from ..scheduler import Scheduler
from ..sequence import Sequence
from .link import Handoff

# The share of a decode step that writing hand-offs may add to it while streams decode.
IMPORT_SHARE = 0.25


class Arrivals:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, scheduler: Scheduler):
        self.runner, self.blocks, self.scheduler = runner, blocks, scheduler
        self.queue: deque[Handoff] = deque()
        self.layers_in = 0                          # of the first hand-off, written so far
        self.write_bps: float | None = None         # bytes per second the pool writes went at

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, handoff: Handoff) -> None:
        self.queue.append(handoff)

    def clear(self) -> None:
        """Drop every hand-off (the worker stopped: their requests are prefilled here)."""
        while self.queue:
            self.queue.popleft().release()
        self.layers_in = 0

    def take(self, waiting: dict[str, Sequence]) -> list[tuple[Sequence, Handoff]]:
        """Write what this step may into the pool; the requests (from `waiting`, by id) whose K/V
        are now all in, with their hand-offs, in order."""
        done: list[tuple[Sequence, Handoff]] = []
        if not self.queue:                           # (every step: nothing to do most of them)
            return done
        budget = self._budget()
        while self.queue and len(self.scheduler.running) + len(done) < self.scheduler.max_num_seqs:
            handoff = self.queue[0]
            seq = waiting.get(handoff.request_id)
            if seq is None or seq.finished:          # cancelled while at the worker, or here
                self.queue.popleft().release()
                self.layers_in = 0
                continue
            if self.layers_in == 0 and not self.blocks.ensure_capacity(seq, handoff.kv.shape[2] + 1):
                break
            budget = self._write(seq, handoff, budget)
            if self.layers_in < handoff.kv.shape[1]:
                break                                # the rest in the next steps
            self.queue.popleft()
            handoff.release()
            self.layers_in = 0
            done.append((seq, handoff))
        return done

    def _budget(self) -> float | None:
        """Bytes this step may write: None (all) unless a stream is decoding and both the decode
        step and the write rate are measured."""
        decode_s = self.scheduler.cost.decode_s
        if not self.scheduler.streaming or decode_s is None or self.write_bps is None:
            return None
        return IMPORT_SHARE * decode_s * self.write_bps

    def _write(self, seq: Sequence, handoff: Handoff, budget: float | None) -> float | None:
        """Write the next layers of `handoff` that fit `budget` (at least one); what is left of it."""
        layers = handoff.kv.shape[1]
        per_layer = handoff.nbytes / layers
        count = layers - self.layers_in if budget is None else max(1, min(layers - self.layers_in,
                                                                           int(budget // per_layer)))
        t0 = time.perf_counter()
        self.runner.write_kv(seq.block_table, handoff.kv, slice(self.layers_in, self.layers_in + count))
        seconds = time.perf_counter() - t0
        if seconds > 0:
            rate = count * per_layer / seconds
            self.write_bps = rate if self.write_bps is None else 0.5 * (self.write_bps + rate)
        self.layers_in += count
        return None if budget is None else budget - count * per_layer
