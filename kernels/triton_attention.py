"""Triton paged KV store and paged attention, with the semantics of `reference` (read it first).

Three kernels serve the attention:
- `_varlen_kernel`: any mixed batch (prefill chunks over a cached prefix, decodes, k+1-token
  verifications). One program per (sequence, query tile, KV head). The query tile packs
  BLOCK_Q tokens x the GROUP query heads that share the KV head into BLOCK_M rows, so each K/V
  tile is read once for the whole group and the QK^T / PV products are tensor-core `tl.dot`s.
- `_decode_split_kernel` + `_decode_reduce_kernel`: flash-decoding for decode-only batches with
  few sequences and long contexts, where one program per (sequence, KV head) would leave most
  SMs idle. Each sequence's context is cut into num_splits parts, attended independently, and the
  partial (acc, max, sum) triples are merged by the reduce kernel.
K/V are gathered token by token through the block table, so the key tile size is independent of
the cache block size; each token's head_dim vector is contiguous, so loads coalesce.
Softmax runs online in fp32 in the exp2 domain (the scale is pre-multiplied by log2(e)).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_pdl import dependent_launches, launch_options, wait_then_release

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256     # below this much context per split the reduce costs more than it saves
MAX_SPLITS = 32


# ---- KV store ------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_cb, stride_cr, stride_ch, stride_cd,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:                  # a padding row: nothing to store
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cr
           + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write rows k[t], v[t] ([T, kv_heads, head_dim]) to slot slot_mapping[t]; slot -1 is skipped."""
    T, kv_heads, head_dim = k.shape
    if T == 0:
        return
    _check_caches(k_cache, v_cache)
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


# ---- attention: one key tile -----------------------------------------------------------------
@triton.jit
def _attend_tile(acc, m_i, l_i, q, start_n, q_pos, key_end, bt_row_ptr, k_base, v_base,
                 stride_cb, stride_cr, stride_cd, qk_scale,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Fold keys [start_n, start_n + BLOCK_N) into the running (acc, m_i, l_i) of q's rows.

    Unmasked tiles (the bulk) lie wholly below every row's position; MASKED tiles apply the
    causal rule key <= q_pos and never read at or past key_end.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if MASKED:
        n_ok = offs_n < key_end
        blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        k_mask = d_ok[:, None] & n_ok[None, :]
        v_mask = n_ok[:, None] & d_ok[None, :]
    else:
        blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
        k_mask = d_ok[:, None]
        v_mask = d_ok[None, :]
    rows = blk * stride_cb + (offs_n % BLOCK_SIZE) * stride_cr            # [BLOCK_N]
    kt = tl.load(k_base + rows[None, :] + offs_d[:, None] * stride_cd, mask=k_mask, other=0.0)    # [D, N]
    qk = tl.dot(q, kt, input_precision=PRECISION) * qk_scale                # [M, N], log2 domain
    if MASKED:
        qk = tl.where(offs_n[None, :] <= q_pos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + rows[:, None] + offs_d[None, :] * stride_cd, mask=v_mask, other=0.0)       # [N, D]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_range(acc, m_i, l_i, q, lo, full_end, hi, q_pos, key_end, bt_row_ptr, k_base, v_base,
                  stride_cb, stride_cr, stride_cd, qk_scale,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
    """Keys [lo, hi): tiles below full_end need no mask (the cheap bulk), the rest are masked."""
    for start_n in range(lo, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start_n, q_pos, key_end, bt_row_ptr, k_base, v_base,
                                     stride_cb, stride_cr, stride_cd, qk_scale,
                                     BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, False, PRECISION)
    for start_n in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start_n, q_pos, key_end, bt_row_ptr, k_base, v_base,
                                     stride_cb, stride_cr, stride_cd, qk_scale,
                                     BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, True, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _load_q(q_ptr, tok, head, row_ok, stride_qt, stride_qh, stride_qd,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DTYPE: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    return tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0).to(DTYPE)


# ---- attention: mixed varlen batch -----------------------------------------------------------
@triton.jit
def _varlen_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr,
                   context_lens_ptr, qk_scale,
                   stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
                   stride_cb, stride_cr, stride_ch, stride_cd, stride_bt,
                   GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P2
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = tile * BLOCK_Q
    if first >= q_len:            # the grid is sized for the longest query; shorter ones stop here
        return
    ctx = tl.load(context_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    tok = first + offs_m // GROUP_P2                # row -> (query token, head within the group)
    g = offs_m % GROUP_P2
    head = kvh * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    q_pos = ctx - q_len + tok                       # causal with offset: row sees keys <= q_pos
    dtype = k_cache_ptr.dtype.element_ty
    q = _load_q(q_ptr, q_start + tok, head, row_ok, stride_qt, stride_qh, stride_qd, HEAD_DIM, BLOCK_D, dtype)

    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)  # finite, so all-masked padding rows stay NaN-free
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kvh * stride_ch
    v_base = v_cache_ptr + kvh * stride_ch
    first_pos = ctx - q_len + first
    last_end = ctx - q_len + tl.minimum(first + BLOCK_Q, q_len)     # one past the tile's last position
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N                # tiles every row sees in full
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, 0, full_end, last_end, q_pos, ctx, bt_row, k_base, v_base,
                                  stride_cb, stride_cr, stride_cd, qk_scale,
                                  BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, PRECISION)

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]     # rows that saw no key (padding) give 0
    offs_d = tl.arange(0, BLOCK_D)
    out = (out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
           + offs_d[None, :] * stride_od)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


# ---- attention: split-K decode -------------------------------------------------------------
@triton.jit
def _decode_split_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                         block_tables_ptr, query_start_loc_ptr, context_lens_ptr, qk_scale, num_splits,
                         stride_qt, stride_qh, stride_qd,
                         stride_cb, stride_cr, stride_ch, stride_cd, stride_bt,
                         NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                         PDL: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:
        wait_then_release()
    ctx = tl.load(context_lens_ptr + seq)
    # num_splits is a runtime value: as contexts grow the heuristic changes it, and a constexpr
    # would mean a JIT compile mid-conversation for each new value.
    # Each sequence splits its own context evenly (whole key tiles per part), so the grid depends
    # on num_splits only and the kernel can be replayed in a CUDA graph as lengths grow.
    part = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    lo = split * part
    hi = tl.maximum(tl.minimum(lo + part, ctx), lo)     # a part past the context is empty
    # Parts are whole key tiles, so only the part holding the context's end has a masked tail.

    g = tl.arange(0, BLOCK_M)                       # rows: the query heads of this KV head
    head = kvh * GROUP + g
    row_ok = g < GROUP
    tok = tl.load(query_start_loc_ptr + seq) + tl.zeros((BLOCK_M,), tl.int32)
    dtype = k_cache_ptr.dtype.element_ty
    q = _load_q(q_ptr, tok, head, row_ok, stride_qt, stride_qh, stride_qd, HEAD_DIM, BLOCK_D, dtype)
    q_pos = tl.zeros((BLOCK_M,), tl.int32) + (ctx - 1)  # the query is the sequence's last token

    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kvh * stride_ch
    v_base = v_cache_ptr + kvh * stride_ch
    full_end = lo + ((hi - lo) // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, lo, full_end, hi, q_pos, hi, bt_row, k_base, v_base,
                                  stride_cb, stride_cr, stride_cd, qk_scale,
                                  BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, PRECISION)

    # Partials, unnormalised: [seq, head, split] for m and l, [seq, head, split, HEAD_DIM] for acc.
    # An empty split (a short sequence) leaves m = -1e30, l = 0, acc = 0: weight 0 in the reduce.
    idx = (seq * NUM_HEADS + head) * num_splits + split
    tl.store(part_m_ptr + idx, m_i, mask=row_ok)
    tl.store(part_l_ptr + idx, l_i, mask=row_ok)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc,
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _decode_reduce_kernel(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, query_start_loc_ptr, num_splits,
                          stride_ot, stride_oh, stride_od,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if PDL:
        wait_then_release()
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    idx = (seq * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + idx, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + idx, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(l * w, 0)
    # A context of 0 (a padding row of a fixed-size decode batch) yields 0, as the varlen kernel does.
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    row = tl.load(query_start_loc_ptr + seq)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=d_ok)


# ---- host side -------------------------------------------------------------------------------
def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # The kernels address both caches with one set of strides.
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must share shape, strides and dtype")


def _precision(dtype: torch.dtype) -> str:
    # fp32 caches are the accuracy mode (they must match the torch oracle): no TF32 rounding.
    return "ieee" if dtype == torch.float32 else "tf32"


def _tiles(max_query_len: int, group_p2: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a tile of max_query_len tokens x group_p2 heads.

    tl.dot needs >= 16 rows; decode-heavy batches keep tiles small so padding rows do not
    multiply the work, long prefills take big ones. Sizes were checked by compiling for sm_90
    (no spills) and against the ~99 KB of shared memory of sm_86/89 parts. fp32 runs its dots
    in IEEE fp32 on CUDA cores, which needs far more registers per tile than tensor cores.
    """
    if dtype.itemsize == 2:
        cap_m, block_n = (128, 64) if head_dim <= 128 else (64, 32)
    else:
        cap_m, block_n = 32, 16
    block_m = max(16, group_p2, min(cap_m, triton.next_power_of_2(max_query_len * group_p2)))
    # fp32 values each thread of 4 warps holds live (accumulator + score tile); past the budget
    # ptxas spills, so spread the tile over 8 warps.
    live = block_m * (head_dim + block_n) // 128
    return block_m, block_n, 8 if live > (64 if dtype.itemsize == 2 else 32) else 4


def decode_splits(num_seqs: int, kv_heads: int, max_context: int, sm_count: int) -> int:
    """How many context parts a decode-only batch should use (1 = no split-K).

    Split until about two programs per SM are busy, but never below MIN_SPLIT_TOKENS of context
    per part: with many sequences or short contexts the plain kernel already fills the GPU.
    """
    programs = num_seqs * kv_heads
    by_occupancy = -(-2 * sm_count // programs)
    by_length = max_context // MIN_SPLIT_TOKENS
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def graph_decode_splits(num_seqs: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """The split count for a decode batch captured once and replayed at any context length up to
    max_context: what the longest context would use (a short one leaves the extra parts empty)."""
    return decode_splits(num_seqs, kv_heads, max_context, _sm_count(device))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132   # the interpreter (CPU tensors): behave as on an H100


def paged_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, max_query_len: int) -> torch.Tensor:
    """The general kernel for any batch; max_query_len sizes the grid."""
    _check_caches(k_cache, v_cache)
    _, H, D = q.shape
    kv_heads = k_cache.shape[2]
    group = H // kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_m, block_n, num_warps = _tiles(max_query_len, group_p2, D, k_cache.dtype)
    block_q = block_m // group_p2
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (block_tables.shape[0], triton.cdiv(max_query_len, block_q), kv_heads)
    _varlen_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale * LOG2E,
        *q.stride(), *out.stride(), *k_cache.stride(), block_tables.stride(0),
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=D, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(D),
        PRECISION=_precision(k_cache.dtype), num_warps=num_warps, num_stages=2,
    )
    return out


def paged_attention_split_k(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, num_splits: int) -> torch.Tensor:
    """Flash-decoding for a batch where every sequence has exactly one query token."""
    _check_caches(k_cache, v_cache)
    _, H, D = q.shape
    B = block_tables.shape[0]
    kv_heads = k_cache.shape[2]
    group = H // kv_heads
    block_m, block_n, num_warps = _tiles(1, triton.next_power_of_2(group), D, k_cache.dtype)
    block_d = triton.next_power_of_2(D)
    part_acc = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
    part_m = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    pdl = dependent_launches(q.device)
    launch = launch_options(pdl)
    _decode_split_kernel[(B, kv_heads, num_splits)](
        part_acc, part_m, part_l, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        scale * LOG2E, num_splits, *q.stride(), *k_cache.stride(), block_tables.stride(0),
        NUM_HEADS=H, GROUP=group, HEAD_DIM=D, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=_precision(k_cache.dtype), PDL=pdl, num_warps=num_warps, num_stages=2, **launch,
    )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _decode_reduce_kernel[(B, H)](
        out, part_acc, part_m, part_l, query_start_loc, num_splits, *out.stride(),
        NUM_HEADS=H, HEAD_DIM=D, BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d, PDL=pdl, num_warps=1 if block_d <= 64 else 2, **launch,
    )
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, *,
                    query_lens_host: list[int] | None = None,
                    context_lens_host: list[int] | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """q: [T, H, D] -> out [T, H, D]. The *_host lists, when given, spare a device->host copy.
    num_splits (reference.paged_attention): a decode-only batch's split count, fixed by the
    caller; no host list is read then."""
    if num_splits is not None:
        if num_splits > 1:
            return paged_attention_split_k(q, k_cache, v_cache, block_tables, query_start_loc,
                                           context_lens, scale, num_splits)
        return paged_attention_varlen(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, 1)
    if query_lens_host is not None:
        max_query_len = max(query_lens_host)
    else:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 1:
        max_context = max(context_lens_host) if context_lens_host is not None else int(context_lens.max())
        splits = decode_splits(block_tables.shape[0], k_cache.shape[2], max_context, _sm_count(q.device))
        if splits > 1:
            return paged_attention_split_k(q, k_cache, v_cache, block_tables, query_start_loc,
                                           context_lens, scale, splits)
    return paged_attention_varlen(q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                                  scale, max_query_len)
