"""Triton kernels for a layer's small ops on GPUs, one launch each, with the semantics of
`reference` (read it first).

In PyTorch each of these ops is several launches (the fp32 upcast, the norm, the downcast, the
weight; rope's products, negation and concatenation): some 25 of a layer's launches, counted from
the ops' code, where a decode step of a small model is bound by launches, not by bytes. These
kernels make each op one launch (a layer is 11 launches with them; measured on an H200 in a CUDA
graph, the 135M shape's 30 layers take 0.96 ms a step). They round where the PyTorch ops round (each intermediate back to the
activations' dtype), so greedy decoding matches the reference path bit for bit where the
arithmetic does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _weighted(s, rstd, w_ptr, offs, ok, DTYPE: tl.constexpr):
    """weight * (s * rstd), rounded where the reference's rms_norm rounds (s: fp32)."""
    normed = (s * rstd).to(DTYPE).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    return (w * normed).to(DTYPE)


@triton.jit
def _norm_row(s, w_ptr, offs, ok, n_cols, eps, DTYPE: tl.constexpr):
    """weight * (s / rms(s)) for one row s (fp32, already rounded to the activations' dtype)."""
    return _weighted(s, tl.rsqrt(tl.sum(s * s, 0) / n_cols + eps), w_ptr, offs, ok, DTYPE)


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, w_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o + offs, _norm_row(x, w_ptr, offs, ok, n_cols, eps, dtype), mask=ok)


@triton.jit
def _add_rms_norm_kernel(sum_ptr, out_ptr, x_ptr, d_ptr, w_ptr, stride_x, stride_d, n_cols, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * stride_d + offs, mask=ok, other=0.0).to(tl.float32)
    s = (x + d).to(dtype)                       # the residual, rounded as `x + delta` rounds
    tl.store(sum_ptr + row * n_cols + offs, s, mask=ok)
    tl.store(out_ptr + row * n_cols + offs, _norm_row(s.to(tl.float32), w_ptr, offs, ok, n_cols, eps, dtype),
             mask=ok)


def _block(n: int) -> int:
    return triton.next_power_of_2(n)


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def _rows(x: torch.Tensor) -> torch.Tensor:
    # The kernels step rows by a stride but read each row's values contiguously.
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, N] -> weight * x / rms(x), in x's dtype."""
    x = _rows(x)
    T, N = x.shape
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T:
        block = _block(N)
        _rms_norm_kernel[(T,)](out, x, weight, x.stride(0), out.stride(0), N, eps, BLOCK=block,
                               num_warps=_warps(block))
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) in one pass."""
    x, delta = _rows(x), _rows(delta)
    T, N = x.shape
    total = torch.empty((T, N), dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    if T:
        block = _block(N)
        _add_rms_norm_kernel[(T,)](total, out, x, delta, weight, x.stride(0), delta.stride(0), N, eps,
                                   BLOCK=block, num_warps=_warps(block))
    return total, out


@triton.jit
def _rope_heads(out_ptr, src_ptr, stride_h, c1, c2, s1, s2, offs, ok,
                NUM: tl.constexpr, NUM_P2: tl.constexpr, HALF: tl.constexpr):
    """One token's NUM heads (rows stride_h apart in src, packed in out), rotated."""
    heads = tl.arange(0, NUM_P2)[:, None]
    mask = (heads < NUM) & ok[None, :]
    src = src_ptr + heads * stride_h + offs[None, :]
    dst = out_ptr + heads * 2 * HALF + offs[None, :]
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded as PyTorch's ops round them
    lo = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    hi = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(dst, lo.to(dtype), mask=mask)
    tl.store(dst + HALF, hi.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(q_out_ptr, k_out_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                 HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, KV_HEADS_P2: tl.constexpr,
                 HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)          # a token: its position's cos and sin read once for all its heads
    offs = tl.arange(0, BLOCK)
    ok = offs < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + offs, mask=ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs, mask=ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_st + offs, mask=ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_st + HALF + offs, mask=ok, other=0.0).to(tl.float32)[None, :]
    _rope_heads(q_out_ptr + t * HEADS * 2 * HALF, q_ptr + t * stride_qt, stride_qh, c1, c2, s1, s2, offs, ok,
                HEADS, HEADS_P2, HALF)
    _rope_heads(k_out_ptr + t * KV_HEADS * 2 * HALF, k_ptr + t * stride_kt, stride_kh, c1, c2, s1, s2, offs, ok,
                KV_HEADS, KV_HEADS_P2, HALF)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, H, D] and k [T, KVH, D] (views into the QKV product are fine:
    each head's D values must be contiguous) in one launch; cos/sin [T, D]. One program per token,
    all its heads at once: a program per (token, head) re-read the token's cos and sin for each
    head, and in Triton's CPU interpreter, where every program is Python, took a quarter of the
    decode-graph tests' time."""
    T, H, D = q.shape
    KVH = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    cos, sin = _rows(cos), _rows(sin)
    q_out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, KVH, D), dtype=k.dtype, device=k.device)
    if T:
        half = D // 2
        block = _block(half)
        _rope_kernel[(T,)](q_out, k_out, q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           cos.stride(0), sin.stride(0), HEADS=H, KV_HEADS=KVH, HEADS_P2=_block(H),
                           KV_HEADS_P2=_block(KVH), HALF=half, BLOCK=block, num_warps=_warps(_block(H) * block))
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(out_ptr, gu_ptr, stride_gu, n_cols, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_cols
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + t * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + n_cols + offs, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)        # F.silu, rounded, then the product
    tl.store(out_ptr + t * n_cols + offs, (act * u).to(dtype), mask=ok)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up, [T, I]."""
    gate_up = _rows(gate_up)
    T, two_i = gate_up.shape
    n = two_i // 2
    out = torch.empty((T, n), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        _silu_mul_kernel[(T, triton.cdiv(n, SILU_BLOCK))](out, gate_up, gate_up.stride(0), n, BLOCK=SILU_BLOCK,
                                                            num_warps=4)
    return out
