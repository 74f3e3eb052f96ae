"""The CPU backend's attention (cpu_kernels.c through ctypes): the paged KV store and paged
attention in C for the sequences the C kernel takes, flash SDPA (the reference) for the others,
a mixed step split between them. CpuKernels (cpu.py) adds the other ops on top."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_products, reference
from .cpu_products import CpuProducts


@dataclass
class KernelShare:
    """The sequences of a mixed step that one attention kernel takes: their rows of q (a slice
    when they are one run) and their own batch layout."""
    in_c: bool
    rows: slice | torch.Tensor
    tables: torch.Tensor
    starts: torch.Tensor
    context_lens: torch.Tensor
    qlens: list[int]
    clens: list[int]


def _split_by_kernel(block_tables: torch.Tensor, context_lens: torch.Tensor, qlens: list[int], clens: list[int],
                     in_c: list[bool]) -> list[KernelShare]:
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    shares = []
    for use_c in (True, False):
        seqs = [i for i, flag in enumerate(in_c) if flag == use_c]
        if seqs == list(range(seqs[0], seqs[-1] + 1)):
            rows: slice | torch.Tensor = slice(starts[seqs[0]], starts[seqs[-1] + 1])
        else:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
        sub_qlens = [qlens[i] for i in seqs]
        index = torch.tensor(seqs)
        shares.append(KernelShare(use_c, rows, block_tables[index], torch.tensor([0] + sub_qlens, dtype=torch.int32)
                                  .cumsum(0, dtype=torch.int32), context_lens[index], sub_qlens,
                                  [clens[i] for i in seqs]))
    return shares


def long_attention_runs(kernels: "CpuAttention") -> cpu_products.Runs:
    """A long prompt's attention by the C tiles and by flash SDPA (whose products are BLAS's), for
    CpuAttention.long_attention_in_c to time at the first such attention: a 512-token prompt with a
    default model's heads (9 of 64 dims, 3 KV heads), 26-36 ms in all on the Zen 5 below. On a 2-core AMD EPYC (Zen
    5, 2026-12-02), where MKL's products ran at half the C code's, the default model's 1,728-token
    prompt took 1.8-2.1 s with the tiles, 2.2-2.5 with flash SDPA; on a 2-core Intel Xeon
    (2026-12-01) flash SDPA took a whole prompt's attention in 0.63 s, the tiles 0.75 (README)."""
    T, H, KVH, D, bs = 512, 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g)
    k_cache, v_cache = (torch.randn(T // bs, bs, KVH, D, generator=g) for _ in range(2))
    tables = torch.arange(T // bs, dtype=torch.int32)[None]
    starts, lens = torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, starts, lens, D ** -0.5)
    return (lambda: kernels._attention_c(*args),
            lambda: reference.paged_attention(*args, query_lens_host=[T], context_lens_host=[T]))


class CpuAttention(CpuProducts):
    """The attention ops of one build of the library, on top of its matrix products: each checks
    that its tensors suit the C code and falls back to the reference otherwise."""

    def __init__(self, lib: ctypes.CDLL):
        super().__init__(lib)
        self._split: tuple[torch.Tensor, list[KernelShare]] | None = None   # this forward's (paged_attention)

    def attention_in_c(self, query_len: int) -> bool:
        """Whether the C kernel rather than flash SDPA attends for one sequence's share of a batch:
        up to the fast rows' queries, over any context, so a batch of that many rows (decodes, a
        verify, a prefill slice beside a stream) runs as one C call. Sequences of 4 or more
        queries go by tiles of 16 (query, head) rows vectorized across the rows: alone, slower
        than flash SDPA from ~32 queries over 1K keys on some machines, but a step in one call
        beats the op-by-op forward around SDPA (a 32-token slice over 1K cached tokens: 86-105 vs
        115-167 ms; README, 2026-11-26). Past the fast rows, whichever this machine runs faster
        (long_attention_in_c)."""
        return query_len <= self.fast_rows.limit or self.long_attention_in_c()

    def long_attention_in_c(self) -> bool:
        """Whether this machine attends a long prompt faster by the C tiles than by flash SDPA
        (timed once: long_attention_runs)."""
        return cpu_products.chosen_once(self.lib, "attention", lambda: long_attention_runs(self))

    @staticmethod
    def _rows(t: torch.Tensor) -> bool:
        """Rows of contiguous [.., D] blocks at any row stride (views into a fused projection)."""
        return t.stride(-1) == 1 and (t.dim() == 2 or t.stride(1) == t.shape[2])

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if not (self._ok(k, v, k_cache, v_cache) and self._rows(k) and self._rows(v)
                and k_cache.is_contiguous() and v_cache.is_contiguous()
                and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
            return reference.store_kv(k, v, k_cache, v_cache, slot_mapping)
        self.lib.pd_store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                             v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], k.shape[1], k.shape[2])

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, *,
                        query_lens_host: list[int] | None = None,
                        context_lens_host: list[int] | None = None,
                        num_splits: int | None = None) -> torch.Tensor:
        # num_splits: see reference.paged_attention (these kernels do not split a context)
        qlens, clens = reference.host_lengths(query_start_loc, context_lens, query_lens_host, context_lens_host)
        fits = (q.shape[2] <= 512 and self._ok(q, k_cache, v_cache) and self._rows(q)
                and k_cache.is_contiguous() and v_cache.is_contiguous())
        in_c = [fits and self.attention_in_c(n) for n in qlens]
        if all(in_c):
            return self._attention_c(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)
        if not any(in_c):
            return reference.paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                                             scale, query_lens_host=qlens, context_lens_host=clens)
        # A mixed step (say a prefill slice beside decodes): each sequence to its better kernel. The
        # split is the same in every layer of a forward, so it is made once (tensors of one
        # forward are the key) and a kernel's sequences in one run of rows are a view, not a copy.
        if self._split is None or self._split[0] is not block_tables:
            self._split = (block_tables, _split_by_kernel(block_tables, context_lens, qlens, clens, in_c))
        out = torch.empty_like(q)
        for part in self._split[1]:
            args = (q[part.rows], k_cache, v_cache, part.tables, part.starts, part.context_lens, scale)
            out[part.rows] = (self._attention_c(*args) if part.in_c else reference.paged_attention(
                *args, query_lens_host=part.qlens, context_lens_host=part.clens))
        return out

    def _attention_c(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
        tables = block_tables.to(torch.int32).contiguous()
        cu_q = query_start_loc.to(torch.int32).contiguous()
        ctx = context_lens.to(torch.int32).contiguous()
        T, H, D = q.shape
        out = q.new_empty(T, H, D)
        self.lib.pd_paged_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                    tables.data_ptr(), tables.shape[1], cu_q.data_ptr(), ctx.data_ptr(),
                                    len(ctx), H, k_cache.shape[2], D, k_cache.shape[1], scale,
                                    out.data_ptr(), torch.get_num_threads())
        return out
