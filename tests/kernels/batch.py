"""A ragged paged-attention batch shared by the kernel tests."""
from __future__ import annotations

import torch

from pdchat.kernels import reference


class Batch:
    """A flat ragged batch over a paged cache whose blocks are shuffled and interleaved."""

    def __init__(self, qlens: list[int], clens: list[int], kv_heads: int, group: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.qlens, self.clens = qlens, clens
        need = [-(-c // block_size) for c in clens]
        num_blocks = sum(need) + 3                      # spare blocks hold garbage nobody may read
        ids = torch.randperm(num_blocks, generator=g).tolist()
        # Padding entries point at a real (garbage) block, so reading past a table shows up.
        self.block_tables = torch.full((len(clens), max(need) + 1), ids[-1], dtype=torch.int32)
        for i, n in enumerate(need):
            self.block_tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
            ids = ids[n:]
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=g).to(dtype)
        self.v_cache = torch.randn(shape, generator=g).to(dtype)
        H, T = kv_heads * group, sum(qlens)
        # q as the engine makes it: a strided view into a fused qkv projection.
        qkv = torch.randn(T, (H + 2 * kv_heads) * head_dim, generator=g).to(dtype)
        self.q = qkv[:, : H * head_dim].view(T, H, head_dim)
        self.query_start_loc = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.context_lens = torch.tensor(clens, dtype=torch.int32)

    def args(self, device: str) -> tuple:
        return tuple(x.to(device) for x in (self.q, self.k_cache, self.v_cache, self.block_tables,
                                            self.query_start_loc, self.context_lens))

    def expected(self, scale: float) -> torch.Tensor:
        # The oracle in fp32 on the very values the kernel sees: the exact answer to compare with.
        q, k, v = self.q.float(), self.k_cache.float(), self.v_cache.float()
        return reference.paged_attention(q, k, v, self.block_tables, self.query_start_loc, self.context_lens,
                                         scale, query_lens_host=self.qlens, context_lens_host=self.clens)
