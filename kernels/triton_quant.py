"""Weight-only int8 products on GPUs in Triton, with the semantics of `reference.linear_int8`
(weights q int8 [N, K] with one scale per output row, packed as `reference.pack_int8` packs them).

A decode step is bound by the bytes of weights it reads, and int8 weights are half of bf16's.
aten's int8 weight-only product ran decode 4-7x slower than bf16 on an H200, so it never paid.
Here each program streams a strip of weight rows once, converts them to the activations' dtype in
registers and multiplies on the tensor cores (rows padded to 16, which costs nothing while the
weights' bytes decide the time); the scale is applied to the sums.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _int8_kernel(out_ptr, x_ptr, w_ptr, s_ptr, b_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    y = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _blocks(rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): decode-sized batches take thin strips of weight rows
    (many programs, so the memory system is kept busy), prompts take square tiles."""
    if rows <= 16:
        return 16, 16, 256, 4
    return 64, 64, 64, 4


def linear_int8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (scales[:, None] * packed).T (+ bias) -> [M, N] in x's dtype."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    M, K = x.shape
    N = packed.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        bm, bn, bk, warps = _blocks(M)
        _int8_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
            out, x, packed, scales, bias if bias is not None else scales, M, N, K, x.stride(0), packed.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out


def int8_supported(device: torch.device) -> bool:
    """Triton runs the int8 product on any CUDA GPU (and in its interpreter, for tests)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
