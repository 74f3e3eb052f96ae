"""Triton norms, rope and SiLU-mul (kernels/triton_layers.py) against kernels.reference.

Without a GPU these run in Triton's interpreter (tests/conftest.py); with one, compiled on it.
The kernels round where PyTorch's ops round, so fp32 and fp16 match to the last bit or nearly;
bf16 is checked on the GPU only (the interpreter truncates fp32 -> bf16 where a GPU rounds).
"""
from __future__ import annotations

import pytest
import torch

from pdchat.kernels import reference
from pdchat.kernels import triton_layers as tl_ops

from .triton_device import DEVICE, DTYPES

# fp32: summation order only. Half precisions: at most one rounding step apart.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols", [(1, 576), (5, 896), (3, 64), (2, 100)])    # 100: not a power of two
def test_rms_norm(dtype, rows, cols) -> None:
    x, w = rand(rows, cols, dtype=dtype), rand(cols, dtype=dtype, seed=1)
    torch.testing.assert_close(tl_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), **TOL[dtype])


def test_rms_norm_reads_strided_rows() -> None:
    wide = rand(4, 96, dtype=torch.float32)
    x, w = wide[:, 16:80], rand(64, dtype=torch.float32, seed=2)      # row stride 96, 64 values each
    torch.testing.assert_close(tl_ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_sum_and_its_norm(dtype) -> None:
    x, d, w = rand(3, 576, dtype=dtype), rand(3, 576, dtype=dtype, seed=1), rand(576, dtype=dtype, seed=2)
    total, normed = tl_ops.add_rms_norm(x, d, w, 1e-5)
    ref_total, ref_normed = reference.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(total, ref_total)                # one rounding of one sum: exact
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (14, 2, 64), (4, 1, 128), (2, 2, 24)])
def test_rope_on_views_of_the_qkv_product(dtype, heads, kv_heads, head_dim) -> None:
    T = 5
    qkv = rand(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim)
    pos = torch.arange(7, 7 + T, device=DEVICE).float()
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    emb = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got_q, got_k = tl_ops.rope(q, k, cos, sin)
    ref_q, ref_k = reference.rope(q, k, cos, sin)
    torch.testing.assert_close(got_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(got_k, ref_k, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 1536), (4, 4864), (2, 100)])
def test_silu_mul(dtype, rows, inter) -> None:
    gu = rand(rows, 2 * inter, dtype=dtype)
    torch.testing.assert_close(tl_ops.silu_mul(gu), reference.silu_mul(gu), **TOL[dtype])


def test_no_rows_is_no_launch() -> None:
    empty = torch.empty(0, 64, device=DEVICE)
    assert tl_ops.rms_norm(empty, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert tl_ops.silu_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n, k, bias", [(1, 576, 576, False), (3, 100, 96, True), (40, 130, 320, False)])
def test_int8_weight_only_product(dtype, rows, n, k, bias) -> None:
    from pdchat.kernels import triton_quant
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    scales = (torch.rand(n, generator=g) / 64 + 1e-3).to(DEVICE)
    x = rand(rows, k, dtype=dtype)
    b = rand(n, dtype=dtype, seed=3) if bias else None
    packed, packed_scales = reference.pack_int8(q, scales, dtype)
    got = triton_quant.linear_int8(x, packed, packed_scales, b)
    want = (x.float() @ (q.float() * packed_scales.float()[:, None]).T) + (b.float() if bias else 0)
    assert got.dtype == dtype and got.shape == (rows, n)
    # against float32 sums of the dequantized weights: the output's rounding, and fp32 sums in
    # another order (tf32 products for float32 activations on a GPU)
    limit = {torch.float32: 4e-3, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert float((got.float() - want).norm() / want.norm()) < limit
