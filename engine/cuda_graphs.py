"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is bound by kernel launches, not by the GPU: a 30-layer
forward is some 300 launches of a few microseconds each, while its arithmetic takes less. A CUDA
graph records one step's launches once and replays them with one call. A graph needs fixed
shapes and fixed addresses, so:
- a ladder of batch sizes is captured (1, 2, 4, 8, 16, then every 16 up to the batch limit), and a
  batch runs in the graph of the next size up, its extra rows padding (slot -1 stores nothing,
  context 0 attends to nothing);
- the inputs live in static buffers that a step copies into before the replay, and the logits
  come out in the graph's own output tensor (valid until the next replay), with each row's
  greedy token (sampler.greedy, in the graph: an all-greedy step launches nothing after it);
- attention's context split count is fixed per size (what the longest context would use), and
  the graphs are captured again when the weights change (quantization) or the batch limit grows.
A capture that fails leaves the engine decoding eagerly, with a notice. Steps with prompt tokens
still run op by op; what that costs beyond a replay is measured at capture, for the scheduler's
time budget (StepCost.fixed).
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, NamedTuple, Protocol

import torch

from .sampler import greedy

LADDER_STEP = 16      # past 16 rows, sizes every 16: padding wastes at most 15 rows


def ladder(max_batch: int) -> list[int]:
    """The batch sizes captured for a batch limit: 1, 2, 4, 8, 16, 32, 48, ... and the limit."""
    small = [s for s in (1, 2, 4, 8) if s < max_batch]
    return small + list(range(LADDER_STEP, max_batch, LADDER_STEP)) + [max_batch]


def padded_size(sizes: list[int], rows: int) -> int | None:
    """The smallest captured size that holds `rows` (None: more rows than any graph takes)."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


class Graph(Protocol):
    """What DecodeGraphs needs of a graph: record a function once, run its record again (the
    function writes its results into tensors it was given: a graph's outputs are fixed addresses)."""

    def capture(self, fn: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


class CudaGraph:
    """torch.cuda.CUDAGraph; every graph of a DecodeGraphs shares one memory pool."""

    def __init__(self, pool: Any):
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, fn: Callable[[], None]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()     # warm-up outside the capture: Triton compiles, cuBLAS picks kernels, the allocator grows
        torch.cuda.current_stream().wait_stream(side)
        # thread_local: the UI or telemetry threads may touch CUDA while the step thread captures
        with torch.cuda.graph(self._graph, pool=self._pool, capture_error_mode="thread_local"):
            fn()

    def replay(self) -> None:
        self._graph.replay()


class Replayed(NamedTuple):
    """A replay's outputs for its rows, views of the graph's own tensors (valid until the next replay)."""
    logits: torch.Tensor          # [rows, vocab] fp32
    greedy: torch.Tensor          # [rows] int64: each row's argmax, NO_TOKEN for a NaN row


@dataclass
class DecodeBuffers:
    """A decode step's inputs at fixed addresses (rows = the largest captured batch). The three
    int64 inputs are the rows of one tensor (`longs`), so one copy fills them."""
    input_ids: torch.Tensor       # [rows] int64
    positions: torch.Tensor       # [rows] int64
    slot_mapping: torch.Tensor    # [rows] int64, -1 = padding
    block_tables: torch.Tensor    # [rows, max_blocks] int32
    query_start_loc: torch.Tensor  # [rows + 1] int32: one query token per row, fixed
    context_lens: torch.Tensor    # [rows] int32, 0 = padding

    @classmethod
    def allocate(cls, rows: int, max_blocks: int, device: torch.device) -> "DecodeBuffers":
        # Every row starts as padding, so the warm-up and capture runs store no K/V anywhere.
        longs = torch.tensor([[0], [0], [-1]], dtype=torch.long, device=device).repeat(1, rows)
        buffers = cls(longs[0], longs[1], longs[2], torch.zeros((rows, max_blocks), dtype=torch.int32, device=device),
                      torch.arange(rows + 1, dtype=torch.int32, device=device),
                      torch.zeros(rows, dtype=torch.int32, device=device))
        buffers.longs = longs           # not a field: views (first) have no use for it
        return buffers

    def first(self, rows: int) -> "DecodeBuffers":
        """Views of the first `rows` rows (same addresses: what a graph of that size reads)."""
        return DecodeBuffers(**{f.name: getattr(self, f.name)[:rows + (f.name == "query_start_loc")]
                                for f in fields(self)})


class StagedInputs:
    """The buffers' per-row inputs written on the host into pinned memory (numpy views: no tensor
    made per step) and sent in two asynchronous copies, the int64 rows and the int32 lengths. On
    an H200's host, making tensors from lists and four copies from pageable memory took 0.1 ms of
    each 1.2 ms step (2026-11-26). A step waits for the last step's copies before overwriting
    their source."""

    def __init__(self, buffers: DecodeBuffers):
        self._longs, self._lens = buffers.longs, buffers.context_lens
        cuda = self._longs.device.type == "cuda"
        self._host_longs = torch.empty(self._longs.shape, dtype=torch.long, pin_memory=cuda)
        self._host_lens = torch.empty(self._lens.shape, dtype=torch.int32, pin_memory=cuda)
        self._longs_np, self._lens_np = self._host_longs.numpy(), self._host_lens.numpy()
        self._sent = torch.cuda.Event() if cuda else None

    def send(self, rows: "DecodeRows", size: int) -> None:
        """Rows past len(rows) up to `size` become padding; rows past `size` are not read."""
        if self._sent is not None:
            self._sent.synchronize()
        n, longs, lens = len(rows.input_ids), self._longs_np, self._lens_np
        longs[0, :n], longs[1, :n], longs[2, :n] = rows.input_ids, rows.positions, rows.slots
        lens[:n] = rows.context_lens
        longs[0:2, n:size], longs[2, n:size], lens[n:size] = 0, -1, 0
        self._longs.copy_(self._host_longs, non_blocking=True)
        self._lens.copy_(self._host_lens, non_blocking=True)
        if self._sent is not None:
            self._sent.record()


@dataclass
class DecodeRows:
    """One decode step's rows as the host knows them."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]


class DecodeGraphs:
    """The captured ladder and its replays. `forward(buffers)` is the runner's decode forward over
    static buffers (logits for every row); `op_by_op(buffers)` the same forward as a step with
    prompt tokens runs it (default: forward); `new_graph(pool)` makes one graph (tests pass a CPU
    double that re-runs the function on replay)."""

    def __init__(self, forward: Callable[[DecodeBuffers], torch.Tensor], *, max_blocks: int,
                 device: torch.device, notices: list[str],
                 new_graph: Callable[[Any], Graph] | None = None,
                 op_by_op: Callable[[DecodeBuffers], torch.Tensor] | None = None):
        self._forward = forward
        self._op_by_op = op_by_op or forward
        self._max_blocks = max_blocks
        self.device = device
        self._notices = notices
        self._new_graph = new_graph or CudaGraph
        self.enabled = True
        self.failed: str | None = None        # why capture failed: decoding stays eager until toggled again
        self.sizes: list[int] = []
        self._graphs: dict[int, tuple[Graph, Replayed]] = {}
        self._key: Any = None
        self._buffers: DecodeBuffers | None = None
        self._inputs: StagedInputs | None = None
        self._tables: list[list[int]] | None = None   # the block tables the buffers hold
        self.replays = 0                      # decode steps run from a graph
        self.captures = 0                     # times the ladder was captured (replays ahead check it)
        self.eager_extra_s = 0.0              # measured at capture: see mixed_step_extra
        self.last: tuple[int, int] | None = None   # the last replay's (rows, padded size)

    def set_enabled(self, on: bool) -> None:
        self.enabled = on
        if on:
            self.failed = None               # toggling on tries the capture again
        else:
            self.release()

    @property
    def state(self) -> str:
        """'on', 'off' or 'failed: why', for the stats."""
        if self.failed:
            return f"failed: {self.failed}"
        return "on" if self.enabled else "off"

    @torch.inference_mode()
    def prepare(self, max_batch: int, key: Any) -> bool:
        """Have graphs for batches up to max_batch of the weights `key`; capture them if not.
        False (and a notice, once) when capture fails."""
        if not self.enabled or self.failed:
            return False
        if self._key == (max_batch, key):
            return True
        self.release()
        try:
            self._capture(max_batch)
        except Exception as e:            # any capture failure: decoding stays correct, only eager
            self.release()
            self.failed = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            self._notices.append(f"CUDA graphs could not be captured ({self.failed}); decoding eagerly")
            return False
        self._key = (max_batch, key)
        self.captures += 1
        self.eager_extra_s = self._eager_extra()
        return True

    def mixed_step_extra(self) -> float:
        """Seconds a step that runs op by op (one with prompt tokens) costs beyond a replayed
        decode step: the launches the graphs save (0 while there are none)."""
        return self.eager_extra_s if self._key is not None else 0.0

    def _eager_extra(self, repeats: int = 3) -> float:
        """A one-row forward op by op (as a step with prompt tokens runs) minus its graph's replay
        (all-padding rows: nothing stored).
        Off a GPU (the tests' double) a replay is the forward itself: nothing to measure."""
        if self.device.type != "cuda":
            return 0.0
        view, graph = self._buffers.first(1), self._graphs[1][0]

        def seconds(fn: Callable[[], Any]) -> float:
            fn()
            self._sync()
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            self._sync()
            return (time.perf_counter() - t0) / repeats

        return max(0.0, seconds(lambda: self._op_by_op(view)) - seconds(graph.replay))

    def _sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def _capture(self, max_batch: int) -> None:
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self._buffers = buffers = DecodeBuffers.allocate(max_batch, self._max_blocks, self.device)
        self._inputs = StagedInputs(buffers)
        # Every graph writes its logits into one tensor: each keeping its own would hold
        # sum(ladder) rows of the vocabulary (1.3 GB for a batch limit of 256 and a 152K vocabulary).
        probe = self._forward(buffers.first(1))
        logits = torch.empty((max_batch, probe.shape[1]), dtype=probe.dtype, device=probe.device)
        tokens = torch.empty(max_batch, dtype=torch.long, device=probe.device)
        self.sizes = ladder(max_batch)
        for size in reversed(self.sizes):          # largest first: the smaller ones reuse its pool
            graph = self._new_graph(pool)
            view, out = buffers.first(size), Replayed(logits[:size], tokens[:size])
            graph.capture(lambda v=view, o=out: self._step(v, o))
            self._graphs[size] = (graph, out)

    def _step(self, view: DecodeBuffers, out: Replayed) -> None:
        """What a graph records: the forward, its logits copied out, each row's greedy token."""
        out.logits.copy_(self._forward(view))
        out.greedy.copy_(greedy(out.logits))

    def release(self) -> None:
        """Drop the graphs, their memory and the buffers (captured again when next needed)."""
        self._graphs, self._buffers, self._inputs, self._key, self.sizes, self._tables = {}, None, None, None, [], None

    @torch.inference_mode()
    def run(self, rows: DecodeRows, max_batch: int, key: Any,
            ids: torch.Tensor | None = None) -> Replayed | None:
        """The step's logits and greedy tokens from a graph replay (views of the graph's outputs,
        valid until the next replay); None when no graph takes the batch (then the step runs
        eagerly). ids: the input ids on the device (decode ahead), in place of rows.input_ids."""
        n = len(rows.input_ids)
        if self._key != (max_batch, key) and not self.prepare(max_batch, key):
            return None
        size = padded_size(self.sizes, n)
        if size is None:
            return None
        self._fill(rows, size)
        if ids is not None:     # a row that sampled nothing (-1) fails; its replay must not read out of bounds
            torch.clamp(ids, min=0, out=self._buffers.input_ids[:n])
        graph, out = self._graphs[size]
        graph.replay()
        self.replays += 1
        self.last = (n, size)
        return Replayed(out.logits[:n], out.greedy[:n])

    def replay(self, size: int) -> None:
        """Replay the graph of `size` on its buffers as they stand (to time the device's share
        of a decode step alone)."""
        self._graphs[size][0].replay()

    def _fill(self, rows: DecodeRows, size: int) -> None:
        b, n = self._buffers, len(rows.input_ids)
        self._inputs.send(rows, size)
        # A row's table changes once per block_size tokens: copy only when some row's did.
        if rows.block_tables != self._tables:
            width = max(len(t) for t in rows.block_tables)
            tables = torch.zeros(n, width, dtype=torch.int32)
            for i, table in enumerate(rows.block_tables):
                tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
            # A table never outgrows the buffer (a sequence stops at max_model_len). Entries past a
            # row's context are never read, so stale ones beyond `width` may stay.
            b.block_tables[:n, :width].copy_(tables)
            self._tables = [list(t) for t in rows.block_tables]
