"""Turns a step plan into one flat varlen forward over the paged KV cache, and returns logits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

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
    """A step's logits: only the rows that sample, item i's rows from starts[i] to starts[i + 1]."""
    logits: torch.Tensor
    starts: list[int]

    def rows(self, idx: int) -> torch.Tensor:
        return self.logits[self.starts[idx]:self.starts[idx + 1]]


class ModelRunner:
    def __init__(self, model: Transformer, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int):
        self.model = model
        self.device = device
        self.block_size = block_size
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.scale = cfg.head_dim ** -0.5

    @property
    def kv_bytes_total(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def run_step(self, items: list[ScheduledSeq], drafts: dict[int, list[int]],
                 on_layer: Callable[[int], None] | None = None) -> StepLogits:
        """The step's one forward: each item's scheduled tokens, plus its draft tokens (by item
        index) when it verifies; logits for the last row of an item that samples, every row of a
        verify. on_layer follows the forward through the layers (Transformer.forward)."""
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
        return StepLogits(self.forward(work, rows, on_layer), starts)

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
        max_blocks = max(len(i.block_table) for i in items)
        tables = torch.zeros(len(items), max_blocks, dtype=torch.int32)
        for i, item in enumerate(items):
            tables[i, :len(item.block_table)] = torch.tensor(item.block_table, dtype=torch.int32)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True)
        slot_mapping = torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True)
        block_tables = tables.to(dev, non_blocking=True)
        qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev, non_blocking=True)
        context_lens = torch.tensor(clens, dtype=torch.int32).to(dev, non_blocking=True)
        batch = AttentionBatch(self.k_cache, self.v_cache, slot_mapping, block_tables, qsl, context_lens, qlens,
                               clens, self.scale)
        hidden = self.model(input_ids, pos, batch, on_layer)
        return self.model.logits(hidden[torch.tensor(want, dtype=torch.long, device=dev)])
