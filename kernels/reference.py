"""Pure-PyTorch paged KV store and paged attention: the semantics every kernel must match.

Cache layout (per layer): k_cache, v_cache = [num_blocks, block_size, kv_heads, head_dim].
A sequence's token at position p lives in block block_table[p // block_size], row p % block_size;
its "slot" is block * block_size + row.

A batch is flat and ragged: sequence i owns queries q[query_start_loc[i]:query_start_loc[i+1]]
(n_i tokens), and after the store its cache holds context_lens[i] = c_i tokens, the n_i new ones
last. Query j of sequence i sits at position c_i - n_i + j and attends to keys 0..that position
(causal with offset). This one rule covers a prefill chunk over a cached prefix, a single-token
decode, and a k+1-token speculative verification.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write rows k[t], v[t] ([T, kv_heads, head_dim]) to slot slot_mapping[t]; slot -1 is skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` rows of one sequence's cache: [length, kv_heads, head_dim]."""
    bs = cache.shape[1]
    blocks = block_table[: (length + bs - 1) // bs]
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float, causal: bool = False) -> torch.Tensor:
    """q: [B, H, n, D], k/v: [B, KVH, c, D] -> [B, H, n, D], grouped-query heads shared."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, *,
                    query_lens_host: list[int] | None = None,
                    context_lens_host: list[int] | None = None) -> torch.Tensor:
    """q: [T, H, D] -> out [T, H, D]. The *_host lists, when given, spare a device->host copy."""
    qlens = query_lens_host or (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    clens = context_lens_host or context_lens.tolist()
    out = torch.empty_like(q)
    if all(n == 1 for n in qlens):
        return _decode(q, k_cache, v_cache, block_tables, clens, scale, out)
    start = 0
    for i, (n, c) in enumerate(zip(qlens, clens)):
        qi = q[start:start + n].transpose(0, 1).unsqueeze(0)                  # [1, H, n, D]
        ki = _gather(k_cache, block_tables[i], c).transpose(0, 1).unsqueeze(0)  # [1, KVH, c, D]
        vi = _gather(v_cache, block_tables[i], c).transpose(0, 1).unsqueeze(0)
        if n == c:
            oi = _sdpa(qi, ki, vi, None, scale, causal=n > 1)
        else:
            mask = torch.ones(n, c, dtype=torch.bool, device=q.device).tril(c - n)
            oi = _sdpa(qi, ki, vi, mask, scale)
        out[start:start + n] = oi[0].transpose(0, 1)
        start += n
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            clens: list[int], scale: float, out: torch.Tensor) -> torch.Tensor:
    """All sequences have one query: gather them padded to the longest and attend in one call."""
    B = len(clens)
    bs = k_cache.shape[1]
    max_c = max(clens)
    tables = block_tables[:, : (max_c + bs - 1) // bs]
    flat = tables.reshape(-1)                         # index_select is far cheaper than fancy indexing
    k = k_cache.index_select(0, flat).view(B, -1, *k_cache.shape[2:])[:, :max_c].transpose(1, 2)  # [B, KVH, c, D]
    v = v_cache.index_select(0, flat).view(B, -1, *v_cache.shape[2:])[:, :max_c].transpose(1, 2)
    mask = None
    if min(clens) != max_c:
        lens = torch.tensor(clens, device=q.device)
        mask = (torch.arange(max_c, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    o = _sdpa(q.view(B, q.shape[1], 1, q.shape[2]), k, v, mask, scale)       # [B, H, 1, D]
    out.copy_(o.view(B, q.shape[1], q.shape[2]))
    return out
