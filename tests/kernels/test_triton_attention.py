"""Triton store_kv / paged_attention against kernels.reference, at toy sizes.

Without a GPU these run in Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET);
with one, the same cases run compiled on it.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdchat.kernels import reference
from pdchat.kernels import triton_attention as ta

from .batch import Batch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
bf16_dot = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRET, reason="Triton's interpreter multiplies bf16 tl.dot operands as raw uint16 bits"))


def check(out: torch.Tensor, batch: Batch, scale: float, dtype: torch.dtype) -> None:
    assert out.shape == batch.q.shape and out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), batch.expected(scale), **TOL[dtype])


# One batch with every kind of work the scheduler mixes: a fresh prefill, prefill chunks over a
# cached prefix (one longer than a key tile), a decode and a 5-token speculative verification
# whose first position (62) is the last one before a 64-key tile boundary the kernel must mask.
MIXED_Q = [37, 20, 1, 5, 3]
MIXED_C = [37, 70, 45, 67, 150]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, bf16_dot])
@pytest.mark.parametrize("kv_heads, group, head_dim, block_size", [
    (2, 1, 16, 16), (2, 2, 32, 8), (1, 4, 16, 16), (3, 3, 24, 8),   # GQA 1/2/4, and SmolLM's 3
])
def test_mixed_batch(dtype: torch.dtype, kv_heads: int, group: int, head_dim: int, block_size: int) -> None:
    b = Batch(MIXED_Q, MIXED_C, kv_heads, group, head_dim, block_size, dtype, seed=group)
    scale = head_dim ** -0.5
    out = ta.paged_attention(*b.args(DEVICE), scale, query_lens_host=b.qlens, context_lens_host=b.clens)
    check(out, b, scale, dtype)


def test_host_lists_are_optional() -> None:
    b = Batch([4, 1, 9], [4, 33, 60], 2, 2, 16, 16, torch.float32, seed=5)
    check(ta.paged_attention(*b.args(DEVICE), 0.3), b, 0.3, torch.float32)


def test_long_prefill_takes_several_query_tiles() -> None:
    # 70 tokens x group 2 = 140 rows: two 128-row tiles (64 tokens each), the second partial.
    # Over a 1-token cached prefix, the first tile's last query (position 64) opens a new key tile.
    b = Batch([70, 2], [71, 9], 1, 2, 16, 16, torch.float16, seed=7)
    check(ta.paged_attention(*b.args(DEVICE), 0.25, query_lens_host=b.qlens, context_lens_host=b.clens),
          b, 0.25, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_batch(dtype: torch.dtype, group: int) -> None:
    b = Batch([1, 1, 1, 1], [1, 16, 77, 130], 2, group, 32, 16, dtype, seed=group)
    assert ta.decode_splits(4, 2, max(b.clens), 132) == 1     # short contexts: the varlen kernel
    check(ta.paged_attention(*b.args(DEVICE), 0.2, query_lens_host=b.qlens, context_lens_host=b.clens),
          b, 0.2, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, bf16_dot])
@pytest.mark.parametrize("group, num_splits", [(1, 2), (4, 3), (2, 5)])
def test_split_k_decode(dtype: torch.dtype, group: int, num_splits: int) -> None:
    # Contexts from 1 token (all but one split empty) to several key tiles per split.
    b = Batch([1, 1, 1], [300, 1, 95], 2, group, 16, 8, dtype, seed=num_splits)
    out = ta.paged_attention_split_k(*b.args(DEVICE), 0.25, num_splits)
    check(out, b, 0.25, dtype)


def test_empty_context_rows_give_zeros() -> None:
    # A fixed-size decode batch (CUDA graphs) pads with context-0 rows: both paths must give 0, not NaN.
    b = Batch([1, 1], [40, 1], 2, 2, 16, 16, torch.float32, seed=9)
    args = list(b.args(DEVICE))
    args[5] = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)
    want = b.expected(0.25)[0]
    for out in (ta.paged_attention_varlen(*args, 0.25, 1), ta.paged_attention_split_k(*args, 0.25, 2)):
        torch.testing.assert_close(out[0].cpu(), want, **TOL[torch.float32])
        assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))


def test_paged_attention_picks_split_k_for_long_single_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = ta.paged_attention_split_k

    def spy(*args: object) -> torch.Tensor:
        calls.append(args[-1])
        return real(*args)

    monkeypatch.setattr(ta, "paged_attention_split_k", spy)
    monkeypatch.setattr(ta, "_sm_count", lambda device: 132)
    b = Batch([1], [600], 2, 2, 16, 16, torch.float32, seed=11)
    check(ta.paged_attention(*b.args(DEVICE), 0.25, query_lens_host=b.qlens, context_lens_host=b.clens),
          b, 0.25, torch.float32)
    assert calls == [ta.decode_splits(1, 2, 600, 132)] and calls[0] > 1


@pytest.mark.parametrize("num_seqs, kv_heads, max_context, sm_count, expected", [
    (1, 8, 8192, 132, 32),        # capped by MAX_SPLITS
    (1, 8, 1024, 132, 4),         # capped by MIN_SPLIT_TOKENS of context per split
    (4, 8, 8192, 132, 9),         # enough splits for ~2 programs per SM
    (64, 8, 8192, 132, 1),        # 512 programs already fill the GPU
    (1, 8, 300, 132, 1),          # too short to split
])
def test_decode_splits(num_seqs: int, kv_heads: int, max_context: int, sm_count: int, expected: int) -> None:
    assert ta.decode_splits(num_seqs, kv_heads, max_context, sm_count) == expected


@pytest.mark.parametrize("dtype, cache_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
    pytest.param(torch.float32, torch.bfloat16, marks=pytest.mark.skipif(
        INTERPRET, reason="Triton's interpreter truncates fp32->bf16 where the GPU rounds to nearest even")),
])
def test_store_kv_matches_reference_and_skips_padding(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_dim = 6, 8, 3, 24
    T = 11
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[[2, 7]] = -1                                # padding rows
    kv = torch.randn(T, 3 * kv_heads * head_dim, generator=g).to(dtype)
    k = kv[:, kv_heads * head_dim: 2 * kv_heads * head_dim].view(T, kv_heads, head_dim)   # strided views
    v = kv[:, 2 * kv_heads * head_dim:].view(T, kv_heads, head_dim)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(cache_dtype)
    v_cache = torch.randn(shape, generator=g).to(cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, k_ref, v_ref, slots)
    k_out, v_out = k_cache.to(DEVICE, copy=True), v_cache.to(DEVICE, copy=True)
    ta.store_kv(k.to(DEVICE), v.to(DEVICE), k_out, v_out, slots.to(DEVICE))
    assert torch.equal(k_out.cpu(), k_ref) and torch.equal(v_out.cpu(), v_ref)
    assert not torch.equal(k_ref, k_cache)            # the store did write something


def test_kernels_package_imports_without_triton() -> None:
    code = "import sys; sys.modules['triton'] = None; import pdchat.kernels as k; print(k.paged_attention.__module__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "pdchat.kernels.reference"


def test_engine_on_triton_kernels_gives_the_torch_tokens() -> None:
    """The engine wired to the Triton backend (interpreted on CPU here) end to end."""
    from pdchat.engine import Engine, SamplingParams
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = []
    for backend in ("torch", "triton"):
        with Engine(model="random:tiny", device=DEVICE, dtype="float32", kernels=backend, telemetry=False,
                    num_kv_blocks=16) as engine:
            assert engine.ops.name == backend
            outs.append([c.token_ids for c in engine.generate(["hello there", "a b c d e f g"], greedy)])
    assert outs[0] == outs[1]
