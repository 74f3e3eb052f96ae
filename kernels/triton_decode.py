"""A one-row decode step in as few launches as its data flow allows (GPU), with the semantics of
the op-by-op forward (engine/model.py) and `reference`.

A decode step of one sequence reads every weight once and does little arithmetic on each, so it
is bound by memory and by launches. Op by op, a layer is 11 launches; on an H200 (2026-11-26)
cuBLAS took 3-6 µs for each of the small matrix-vector products (and split the down product in
two launches), and the norms, RoPE, K/V store and SiLU-mul about 1.1-1.8 µs each. Here a layer is
7 launches:
  qkv product, the residual add and RMSNorm done in its loads
  -> RoPE (and Qwen3's q/k norms) and the K/V store, one launch
  -> attention (triton_attention's decode kernels: split-K and its reduce)
  -> o product -> gate/up product, add and norm in its loads -> down product, SiLU-mul in its loads;
the first product gathers the token's embedding row itself, and the vocabulary product folds in
the final norm and writes fp32 logits. The matrix-vector kernel reads [BLOCK_N, BLOCK_K] weight
tiles row-contiguous and sums in fp32; measured on the same H200 it was 1.3-1.9x faster than
cuBLAS on the small products and 1.02-1.06x on the large ones. Each program rebuilds its input
(the norm's sum of squares, the activation): a few KB from L2 against its weight tile's reads.
Values are rounded where the reference rounds them, except the normalised row (kept in fp32: see
_matvec_kernel) and the products' summation order. On Hopper every launch of the step uses
programmatic dependent launch (triton_pdl.py). The whole step: 0.96 -> 0.41 ms of GPU time a
token on the SmolLM2-135M shape, 1.11 -> 0.84 ms on the Llama-3.2-1B shape (0.46 and 0.87 with
the graph's greedy argmax, on another machine: README, "GPU").
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import triton_attention
from .triton_layers import _weighted
from .triton_pdl import dependent_launches, launch_options, wait_then_release

# what a product does to its input as it loads it (constexpr: the kernel branches on them)
PLAIN, NORM, SILU = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


class DecodePlan(NamedTuple):
    layers: list          # model.LayerWeights, full-precision weights only
    heads: int
    kv_heads: int
    head_dim: int
    eps: float


def prepare_layers(layers: list, num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> DecodePlan | None:
    """The plan for decode_forward; None for quantized weights (they run op by op)."""
    linears = [lw for layer in layers for lw in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if any(scales is not None for _, scales, _ in linears):
        return None
    return DecodePlan(layers, num_heads, num_kv_heads, head_dim, eps)


@triton.jit
def _matvec_kernel(out_ptr, w_ptr, bias_ptr, x_ptr, ids_ptr, d_ptr, sum_ptr, norm_ptr,
                   N, K, stride_w, stride_x, eps,
                   PROLOGUE: tl.constexpr, GATHER: tl.constexpr, ADD: tl.constexpr, WRITE_SUM: tl.constexpr,
                   HAS_BIAS: tl.constexpr, PDL: tl.constexpr, ONE_TILE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n] = sum_k W[n, k] * a[k] for one row a made from x as it is loaded:
    PLAIN a = x; NORM a = rms_norm(x (+ d)) * norm (program 0 writes x (+ d) to sum_ptr when
    WRITE_SUM); SILU a = silu(x[:K]) * x[K:]. GATHER: x is row ids[0] of a table.
    NORM sums W * norm * s and the squares of s in one pass and scales the sum by 1/rms(s) at
    the end: no pass over the row before the weights stream (the reference rounds the normalised
    row to the activations' dtype; here it stays fp32). PDL: kernels/triton_pdl.py. ONE_TILE: K
    fits one tile, so the program's whole weight slice is read before the wait, while the kernel
    before still runs (the SmolLM2-135M shape's step 0.486 -> 0.450 ms on an H200, 2026-11-27)."""
    pid = tl.program_id(0)
    dt = w_ptr.dtype.element_ty
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_w + ks[None, :]
    if ONE_TILE:        # weights never depend on the kernel before: read them while it finishes
        w_all = tl.load(w_ptrs, mask=row_ok[:, None] & (ks[None, :] < K), other=0.0, eviction_policy="evict_first")
    if PDL:
        wait_then_release()           # launched early (PDL): the inputs are ready from here on
    row_ptr = x_ptr
    if GATHER:
        row_ptr = x_ptr + tl.load(ids_ptr).to(tl.int64) * stride_x
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        ok = kk < K
        if ONE_TILE:
            w = w_all
        else:
            w = tl.load(w_ptrs + k0, mask=row_ok[:, None] & ok[None, :], other=0.0,
                        eviction_policy="evict_first")      # read once per step: keep L2 for activations
        if PROLOGUE == NORM:
            s = tl.load(row_ptr + kk, mask=ok, other=0.0)
            if ADD:             # the residual add, rounded as the reference's `x + delta`
                s = (s.to(tl.float32) + tl.load(d_ptr + kk, mask=ok, other=0.0).to(tl.float32)).to(s.dtype)
            if WRITE_SUM:
                if pid == 0:
                    tl.store(sum_ptr + kk, s, mask=ok)
            s = s.to(tl.float32)
            squares += s * s
            a = tl.load(norm_ptr + kk, mask=ok, other=0.0).to(tl.float32) * s
        elif PROLOGUE == SILU:
            g = tl.load(row_ptr + kk, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(row_ptr + K + kk, mask=ok, other=0.0).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            a = (act * u).to(dt).to(tl.float32)
        else:
            a = tl.load(row_ptr + kk, mask=ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * a[None, :]
    out = tl.sum(acc, axis=1)
    if PROLOGUE == NORM:          # the norm's scale, known only once the row's squares are summed
        out = out * tl.rsqrt(tl.sum(squares, 0) / K + eps)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(dt).to(out_ptr.dtype.element_ty), mask=row_ok)


def _tiles(n: int, k: int, prologue: int, on_gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) for an [n, k] product: the fastest in sweeps of a whole decode
    step's GPU time on an H200 (2026-11-26 and -27, SmolLM2-135M and Llama-3.2-1B shapes), each
    kind of matrix tried in place: small matrices want many programs of few rows and long K
    tiles (one tile where K allows: its weights are then read before the wait, see _matvec_kernel),
    large ones wider rows. Against the tiles before, the down product (SILU) took 2048-wide K
    tiles (0.450 -> 0.413 ms a step on the 135M shape, where that is one tile; 0.893 -> 0.877 on
    the 1B shape) and the gate/up product 128-wide ones (0.893 -> 0.856, 1B). A program that rebuilds
    its input (norm, SiLU) takes at least 8 rows, so the input's re-reads stay well below the
    weight's. Triton's interpreter (tests off a GPU) runs programs one at a time in Python:
    there, few programs of many rows."""
    if not on_gpu:
        return 64, 128, 4
    if n >= 65536:
        return 16, 256, 4
    if n >= 8192:
        return 32, 128, 4
    if prologue == SILU:
        return 8, 2048, 8
    rows = 4 if n <= 2048 else 8
    return (max(rows, 8) if prologue != PLAIN else rows), 1024, 8


def matvec(weights: tuple, x: torch.Tensor, *, prologue: int = PLAIN, ids: torch.Tensor | None = None,
           delta: torch.Tensor | None = None, norm: torch.Tensor | None = None, eps: float = 0.0,
           sum_out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One row through a full-precision linear layer ([N, K] weight, optional bias), its input
    made as `prologue` says (see _matvec_kernel). x: the row [K] (SILU: [2K]), or with `ids` a
    table whose row ids[0] is the input. Returns [1, N]."""
    weight, _, bias = weights
    N, K = weight.shape
    out = torch.empty((1, N), dtype=out_dtype or weight.dtype, device=weight.device)
    block_n, block_k, warps = _tiles(N, K, prologue, weight.device.type == "cuda")
    block_k = min(block_k, triton.next_power_of_2(K))
    pdl = dependent_launches(weight.device)
    _matvec_kernel[(triton.cdiv(N, block_n),)](
        out, weight, bias if bias is not None else weight, x, ids if ids is not None else x,
        delta if delta is not None else x, sum_out if sum_out is not None else x, norm if norm is not None else x,
        N, K, weight.stride(0), x.stride(0) if ids is not None else 0, eps,
        PROLOGUE=prologue, GATHER=ids is not None, ADD=delta is not None, WRITE_SUM=sum_out is not None,
        HAS_BIAS=bias is not None, PDL=pdl, ONE_TILE=K <= block_k, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=3,
        **launch_options(pdl))
    return out


@triton.jit
def _head_norm(x1, x2, w_ptr, offs, ok, HALF: tl.constexpr, eps, DTYPE: tl.constexpr):
    """Qwen3's per-head RMSNorm of one head's two halves (fp32 in and out, rounded as the reference)."""
    rstd = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
    return (_weighted(x1, rstd, w_ptr, offs, ok, DTYPE).to(tl.float32),
            _weighted(x2, rstd, w_ptr + HALF, offs, ok, DTYPE).to(tl.float32))


@triton.jit
def _rope_store_kernel(q_out_ptr, qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
                       k_cache_ptr, v_cache_ptr, slot_ptr, stride_qkv, stride_cb, stride_cr, stride_ch, eps,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, h): query head h (h < HEADS) or key/value head h - HEADS of row t. RoPE's
    cos and sin are the tables' rows at the position ([positions, 2 HALF], as Transformer.rope
    computes them); keys and values go to the row's cache slot (-1: a padding row, stored nowhere)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    ok = offs < HALF
    dt = q_out_ptr.dtype.element_ty
    if PDL:
        wait_then_release()
    src = qkv_ptr + t * stride_qkv + h * 2 * HALF          # k's heads follow q's in the product
    x1 = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    if QK_NORM:
        if h < HEADS:
            x1, x2 = _head_norm(x1, x2, q_norm_ptr, offs, ok, HALF, eps, dt)
        else:
            x1, x2 = _head_norm(x1, x2, k_norm_ptr, offs, ok, HALF, eps, dt)
    row = tl.load(pos_ptr + t).to(tl.int64) * 2 * HALF
    c1 = tl.load(cos_ptr + row + offs, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row + offs, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded as PyTorch's ops round them
    lo = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    hi = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    if h < HEADS:
        dst = q_out_ptr + (t * HEADS + h) * 2 * HALF
        tl.store(dst + offs, lo, mask=ok)
        tl.store(dst + HALF + offs, hi, mask=ok)
    else:
        head = h - HEADS
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            at = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cr + head * stride_ch
            tl.store(k_cache_ptr + at + offs, lo.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(k_cache_ptr + at + HALF + offs, hi.to(k_cache_ptr.dtype.element_ty), mask=ok)
            v_src = qkv_ptr + t * stride_qkv + (HEADS + KV_HEADS + head) * 2 * HALF
            v1 = tl.load(v_src + offs, mask=ok, other=0.0)
            v2 = tl.load(v_src + HALF + offs, mask=ok, other=0.0)
            tl.store(v_cache_ptr + at + offs, v1.to(v_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(v_cache_ptr + at + HALF + offs, v2.to(v_cache_ptr.dtype.element_ty), mask=ok)


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor],
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, plan: DecodePlan,
               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] -> the rotated queries [T, H, D]; the rotated keys and the values
    are written to one layer's caches ([blocks, block_size, KVH, D]) at slot_mapping. table:
    contiguous cos and sin [positions, D], looked up at each row's position."""
    T, H, KVH, D = qkv.shape[0], plan.heads, plan.kv_heads, plan.head_dim
    if k_cache.stride(-1) != 1:
        raise ValueError("the K/V cache's head_dim values must be contiguous")
    cos, sin = table
    pdl = dependent_launches(qkv.device)
    q = torch.empty((T, H, D), dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(T, H + KVH)](
        q, qkv, positions, cos, sin, q_norm if q_norm is not None else cos,
        k_norm if k_norm is not None else cos, k_cache, v_cache, slot_mapping, qkv.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), plan.eps,
        HEADS=H, KV_HEADS=KVH, HALF=D // 2, BLOCK_SIZE=k_cache.shape[1], QK_NORM=q_norm is not None,
        PDL=pdl, BLOCK=triton.next_power_of_2(D // 2), num_warps=1, **launch_options(pdl))
    return q


def decode_forward(plan: DecodePlan | None, head, input_ids: torch.Tensor, positions: torch.Tensor,
                   batch) -> torch.Tensor | None:
    """A one-row decode step's fp32 logits [1, vocab] (head: model.HeadWeights, batch:
    model.AttentionBatch); None when
    this backend cannot run it whole (more rows, quantized weights) and the model runs it op by op."""
    if plan is None or input_ids.shape[0] != 1 or head.lm_head[1] is not None:
        return None
    residual, delta, norm = head.embed, None, head.first_norm
    ids: torch.Tensor | None = input_ids          # the first product gathers the embedding row
    for i, layer in enumerate(plan.layers):
        block_in = torch.empty_like(head.embed[0])       # the residual stream entering the block
        qkv = matvec(layer.qkv, residual, prologue=NORM, ids=ids, delta=delta, norm=norm, eps=plan.eps,
                     sum_out=block_in)
        q = rope_store(qkv, positions, head.rope_table, batch.k_cache[i], batch.v_cache[i], batch.slot_mapping, plan,
                       layer.q_norm, layer.k_norm)
        attn = triton_attention.paged_attention(
            q, batch.k_cache[i], batch.v_cache[i], batch.block_tables, batch.query_start_loc, batch.context_lens,
            batch.scale, query_lens_host=batch.query_lens_host, context_lens_host=batch.context_lens_host,
            num_splits=batch.decode_splits)
        attn_out = matvec(layer.o, attn.view(-1))
        mid = torch.empty_like(block_in)                 # block_in + attention
        gate_up = matvec(layer.gate_up, block_in, prologue=NORM, delta=attn_out.view(-1), norm=layer.norm_mlp,
                         eps=plan.eps, sum_out=mid)
        mlp_out = matvec(layer.down, gate_up.view(-1), prologue=SILU)
        residual, delta, norm, ids = mid, mlp_out.view(-1), layer.next_norm, None
    return matvec(head.lm_head, residual, prologue=NORM, ids=ids, delta=delta, norm=norm, eps=plan.eps,
                  out_dtype=torch.float32)
