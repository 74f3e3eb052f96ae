"""Turns a step plan into one flat varlen forward over the paged KV cache, and returns logits."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .cuda_graphs import DecodeBuffers, DecodeGraphs, DecodeRows, Graph, Replayed
from .decode_ahead import DecodeAhead
from .model import AttentionBatch, Transformer
from .model_config import ModelConfig
from .scheduler import ScheduledSeq
from .sequence import Sequence


@dataclass
class Work:
    """One sequence's share of a forward: tokens at positions start.., in its block table."""
    tokens: list[int]
    start: int
    block_table: list[int]

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> "Work":
        start = seq.num_computed_tokens
        return cls(seq.token_ids[start:start + num_tokens], start, seq.block_table)


@dataclass
class StepLogits:
    """A step's logits: only the rows that sample, item i's rows from starts[i] to starts[i + 1];
    and the seconds its forward spent in the attention of sequences of several queries, where the
    kernels time it (the step cost model's measure of a slice's attention)."""
    logits: torch.Tensor
    starts: list[int]
    tile_seconds: float | None = None
    # a replayed decode step's: each row's greedy token, computed in its graph (every item samples,
    # in order, so these line up with first_rows of all items)
    greedy: torch.Tensor | None = None

    def rows(self, idx: int) -> torch.Tensor:
        return self.logits[self.starts[idx]:self.starts[idx + 1]]

    def first_rows(self, items: list[int]) -> torch.Tensor:
        """The first logits row of each of `items`, stacked; a decode step's logits are already
        exactly those rows, in order, and come back without a copy."""
        at = [self.starts[i] for i in items]
        return self.logits if at == list(range(self.logits.shape[0])) else self.logits[at]


class ModelRunner:
    def __init__(self, model: Transformer, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, max_model_len: int):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_heads = cfg.num_kv_heads
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.scale = cfg.head_dim ** -0.5
        self.graphs: DecodeGraphs | None = None     # decode steps from CUDA graphs (use_graphs)
        self.ahead: DecodeAhead | None = None        # the next decode step replayed early (with graphs)
        self._replayed = False                       # the last step ran from a graph
        self.max_batch = 1                           # the batch limit the graphs are captured for

    def use_graphs(self, notices: list[str], new_graph: Callable[[Any], Graph] | None = None,
                   reserve: Callable[[Any, int], bool] | None = None) -> DecodeGraphs:
        """Replay decode steps from CUDA graphs (the Triton kernels only: the others read host
        lengths a replay cannot update). new_graph: a CPU double in tests. reserve(seq, tokens):
        the block manager's, for decoding ahead into a new block (DecodeAhead)."""
        from pdchat.kernels.triton_attention import graph_decode_splits
        if self.graphs is not None:
            self.graphs.release()
        blocks = -(-self.max_model_len // self.block_size)

        def batch(b: DecodeBuffers) -> AttentionBatch:
            rows = b.input_ids.shape[0]
            return AttentionBatch(self.k_cache, self.v_cache, b.slot_mapping, b.block_tables, b.query_start_loc,
                                  b.context_lens, [1] * rows, None, self.scale,
                                  decode_splits=graph_decode_splits(rows, self.kv_heads, self.max_model_len,
                                                                    self.device))

        def forward(b: DecodeBuffers) -> torch.Tensor:
            return self.model.decode_logits(b.input_ids, b.positions, batch(b), self.max_model_len)

        def op_by_op(b: DecodeBuffers) -> torch.Tensor:      # what a step with prompt tokens runs
            return self.model.logits(self.model(b.input_ids, b.positions, batch(b)))

        self.graphs = DecodeGraphs(forward, max_blocks=blocks, device=self.device, notices=notices,
                                   new_graph=new_graph, op_by_op=op_by_op)
        self.ahead = DecodeAhead(self.graphs, self.block_size, self.max_model_len, reserve)
        return self.graphs

    def close(self) -> None:
        """Let the KV pool, the graphs and the model go, even while something still holds this
        runner (the runtime settings, the time budget's fixed-cost source)."""
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = self.ahead = self.k_cache = self.v_cache = self.model = None

    def _weights_key(self) -> tuple[str, int]:
        switch = self.model.quant_switch
        return (switch.mode, switch.version) if switch is not None else ("none", 0)

    def prepare_graphs(self) -> None:
        """Capture now (at start, or when toggled on) rather than in the next decode step."""
        if self.graphs is not None:
            self.graphs.prepare(self.max_batch, self._weights_key())

    def warm_up(self) -> None:
        """A block of prompt tokens and one decode row through the model, into the pool's first two
        blocks, before any request: the first forward pays one-time costs (the C pool's threads,
        buffers and cache pages faulted in, torch's first calls), and the first prompt's TTFT
        should not. On the default model, 2-core AMD EPYC, 2026-11-27 (README): 60-370 ms here;
        the app's first prefill step then took 140-192 ms where it had taken 145-730, and ~25 ms of
        first-time cost is left in a headless engine's first request. Nothing owns those blocks:
        whoever gets them writes each slot before reading it, and the prefix cache knows them by no
        hash. A CPU's kernels only: a GPU's graphs are captured at start already, and a prefill
        warm-up there is not measured; Triton's kernels on a CPU are its interpreter (tests), where
        these two forwards warm nothing and took 2.8 s (2-core AMD EPYC, 2026-11-28)."""
        bs = self.block_size
        if (self.device.type != "cpu" or self.model.ops.name == "triton" or self.k_cache.shape[1] < 2
                or self.max_model_len <= bs):
            return
        self.forward([Work([0] * bs, 0, [0, 1])], [[bs - 1]])
        self.forward([Work([0], bs, [0, 1])], [[0]])

    @property
    def kv_bytes_total(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def read_kv(self, block_table: list[int], num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The K and V of a sequence's first num_tokens tokens, [2, layers, tokens, kv heads, head
        dim], into `out` if given (a link's send area): what a prefill worker hands over."""
        slots = self._slots(block_table, num_tokens)
        if out is None:
            out = self.k_cache.new_empty((2, self.k_cache.shape[0], num_tokens, *self.k_cache.shape[3:]))
        for cache, part in zip((self.k_cache, self.v_cache), out):
            if part.device == cache.device:
                torch.index_select(cache.flatten(1, 2), 1, slots, out=part)
            else:                                   # a GPU's pool into a link's host memory
                part.copy_(cache.flatten(1, 2).index_select(1, slots))
        return out

    def write_kv(self, block_table: list[int], kv: torch.Tensor, layers: slice = slice(None)) -> None:
        """Put read_kv's tensor for tokens 0.. into the slots of block_table (a hand-off arriving),
        all layers or those of `layers`."""
        slots = self._slots(block_table, kv.shape[2])
        for cache, part in zip((self.k_cache, self.v_cache), kv):
            cache[layers].flatten(1, 2).index_copy_(1, slots, part[layers].to(self.device, cache.dtype))

    def _slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """The pool slots of tokens 0..num_tokens-1 (a cache flattened to [layers, slots, ...])."""
        bs = self.block_size
        return torch.tensor([block_table[p // bs] * bs + p % bs for p in range(num_tokens)],
                            dtype=torch.long, device=self.device)

    def run_step(self, items: list[ScheduledSeq], drafts: dict[int, list[int]],
                 on_layer: Callable[[int], None] | None = None) -> StepLogits:
        """The step's one forward: each item's scheduled tokens, plus its draft tokens (by item
        index) when it verifies; logits for the last row of an item that samples, every row of a
        verify. on_layer follows the forward through the layers (Transformer.forward)."""
        self._replayed = False
        if self.graphs is not None:
            replayed = self._decode_from_graphs(items, drafts)
            if replayed is not None:
                return StepLogits(replayed.logits, list(range(len(items) + 1)), greedy=replayed.greedy)
        work, rows = [], []
        for idx, item in enumerate(items):
            w = Work.of(item.seq, item.num_tokens)
            if idx in drafts:                      # verify: the last token plus k draft tokens
                w.tokens = w.tokens + drafts[idx]
                rows.append(list(range(len(w.tokens))))
            else:
                rows.append([item.num_tokens - 1] if item.samples else [])
            work.append(w)
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + len(r))
        logits = self.forward(work, rows, on_layer)
        return StepLogits(logits, starts, self.model.ops.tile_seconds())

    def _decode_from_graphs(self, items: list[ScheduledSeq], drafts: dict[int, list[int]]) -> Replayed | None:
        """A decode-only step's outputs from a graph: replayed ahead by the last step, or now; None
        for any other step, or a batch no graph takes."""
        decode = not drafts and all(i.num_tokens == 1 and i.samples for i in items)
        ahead = self.ahead.take(items if decode else [], self.max_batch, self._weights_key())
        if not decode:
            return None
        replayed = ahead if ahead is not None else self._replay(items)
        self._replayed = replayed is not None
        return replayed

    def tokens_to_host(self, tokens: torch.Tensor, goes_on: list[ScheduledSeq] | None = None) -> list[int]:
        """A step's sampled tokens (on the device) as ints. goes_on: the step's rows when every one
        decodes next without drafts; after a replayed step the next one is then replayed before
        these are read (decode_ahead.py)."""
        if goes_on is None or not self._replayed:
            return tokens.tolist()
        return self.ahead.read(goes_on, tokens, self.max_batch, self._weights_key())

    def _replay(self, items: list[ScheduledSeq]) -> Replayed | None:
        bs = self.block_size
        seqs = [item.seq for item in items]
        positions = [s.num_computed_tokens for s in seqs]
        rows = DecodeRows([s.token_ids[p] for s, p in zip(seqs, positions)], positions,
                          [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)],
                          [s.block_table for s in seqs], [p + 1 for p in positions])
        return self.graphs.run(rows, self.max_batch, self._weights_key())

    @torch.inference_mode()
    def forward(self, items: list[Work], rows: list[list[int]],
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute K/V for each item's tokens and return fp32 logits for the requested rows.

        rows[i] lists offsets within item i's tokens (e.g. [n-1] for the last one).
        """
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        clens: list[int] = []
        want: list[int] = []
        for item, item_rows in zip(items, rows):
            start, end = item.start, item.start + len(item.tokens)
            table = item.block_table
            want.extend(len(ids) + r for r in item_rows)
            ids.extend(item.tokens)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qlens.append(len(item.tokens))
            clens.append(end)
        # Two host tensors, the fields views of them: a tensor per field and one per block table
        # took 0.29 ms of a 6.4 ms decode step with int8 weights, these 0.14 (2-core AMD EPYC,
        # 2026-11-27; with the RoPE rows looked up, the step 0.3-4.5% faster in alternating runs).
        T, S = len(ids), len(items)
        max_blocks = max(len(i.block_table) for i in items)
        longs = torch.tensor(ids + positions + slots, dtype=torch.long).to(self.device, non_blocking=True)
        ints = torch.tensor(list(itertools.accumulate(qlens, initial=0)) + clens
                            + [b for i in items for b in i.block_table + [0] * (max_blocks - len(i.block_table))],
                            dtype=torch.int32).to(self.device, non_blocking=True)
        batch = AttentionBatch(self.k_cache, self.v_cache, longs[2 * T:], ints[2 * S + 1:].view(S, max_blocks),
                               ints[:S + 1], ints[S + 1:2 * S + 1], qlens, clens, self.scale)
        hidden = self.model(longs[:T], longs[T:2 * T], batch, on_layer)
        if want != list(range(T)):        # (a decode step wants every row, in order)
            hidden = hidden[torch.tensor(want, dtype=torch.long, device=self.device)]
        return self.model.logits(hidden)
