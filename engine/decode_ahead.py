"""Decode ahead: a replayed decode step's successor is queued before its tokens come back.

A replayed decode step runs on the GPU while the host waits for its tokens; then the host
post-processes them, schedules and fills the next step, and the GPU waits in turn: 0.23 ms of
each 1.2 ms step on an H200 (2026-11-26, SmolLM2-135M shape, batch 1). So after a replayed step
whose every row will decode again (no drafts, no row at its token or length limit, a block for
its next position: taken now, where the scheduler would take it next step), the runner replays
the next step at once, with the device's own sampled tokens as its input ids, and only then
waits for this step's tokens. The next step takes that replay's logits when its rows are the
same sequences at the positions expected; otherwise (a row ended on EOS or a stop string, a
request arrived or was cancelled, the weights changed) they are dropped. The replay wrote each
row's K/V at its next position: what that position holds if the row goes on, and a slot no one
reads if it does not. On that host it took 0.17-0.27 ms off each step (README, "GPU").
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .cuda_graphs import DecodeGraphs, DecodeRows, Replayed
from .scheduler import ScheduledSeq


class DecodeAhead:
    def __init__(self, graphs: DecodeGraphs, block_size: int, max_model_len: int,
                 reserve: Callable[[Any, int], bool] | None = None):
        self._graphs = graphs
        self._reserve = reserve        # (seq, tokens) -> whether seq now has blocks for them
        self._block_size = block_size
        self._max_model_len = max_model_len
        cuda = graphs.device.type == "cuda"
        self._copied = torch.cuda.Event() if cuda else None
        self._host = torch.empty(0, dtype=torch.long)       # pinned on a GPU: the copy does not wait
        # (key, the rows' sequences and positions, the replay's outputs) of the step replayed ahead
        self._pending: tuple[Any, list[tuple[Any, int]], Replayed] | None = None
        self.used = 0                 # steps that took logits replayed ahead
        self.dropped = 0              # replays ahead that no step took

    def _key(self, max_batch: int, weights: Any) -> tuple:
        return self._graphs.captures, max_batch, weights

    def take(self, items: list[ScheduledSeq], max_batch: int, weights: Any) -> Replayed | None:
        """The replay ahead's outputs for this step, if its rows are the ones expected; whatever
        was pending is gone after this call (the graphs' output changes with the next replay)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        key, rows, replayed = pending
        if key == self._key(max_batch, weights) and len(rows) == len(items) and all(
                item.seq is seq and item.seq.num_computed_tokens == position
                for item, (seq, position) in zip(items, rows)):
            self.used += 1
            return replayed
        self.dropped += 1
        return None

    def read(self, items: list[ScheduledSeq], tokens: torch.Tensor, max_batch: int, weights: Any) -> list[int]:
        """This replayed step's sampled tokens as ints, the next step replayed first where every
        row goes on (see the module's docstring)."""
        rows = self._next_rows(items)
        if rows is None:
            return tokens.tolist()
        host = self._host_rows(len(items))
        host.copy_(tokens, non_blocking=True)               # queued before the replay ahead
        if self._copied is not None:
            self._copied.record()
        replayed = self._graphs.run(rows, max_batch, weights, ids=tokens)
        if replayed is not None:
            expected = [(item.seq, p) for item, p in zip(items, rows.positions)]
            self._pending = (self._key(max_batch, weights), expected, replayed)
        if self._copied is not None:
            self._copied.synchronize()                      # this step's tokens only, not the replay
        return host.tolist()

    def _host_rows(self, n: int) -> torch.Tensor:
        if self._host.shape[0] < n:
            self._host = torch.empty(max(n, 2 * self._host.shape[0]), dtype=torch.long,
                                     pin_memory=self._copied is not None)
        return self._host[:n]

    def _next_rows(self, items: list[ScheduledSeq]) -> DecodeRows | None:
        """The next step's rows (input ids to come from the device), or None when some row may
        not go on or would need a new block first."""
        bs, positions, slots, tables = self._block_size, [], [], []
        for item in items:
            seq = item.seq
            p = seq.num_computed_tokens + 1                 # the position of the token sampled now
            if seq.num_output_tokens + 1 >= seq.params.max_tokens or p + 1 >= self._max_model_len:
                return None
            if p // bs >= len(seq.block_table) and not (self._reserve and self._reserve(seq, p + 1)):
                return None                                  # no block for the next token
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            tables.append(seq.block_table)
        return DecodeRows([0] * len(items), positions, slots, tables, [p + 1 for p in positions])
