"""The one-row decode step in few launches (kernels/triton_decode.py) against the reference ops and
the op-by-op forward of engine/model.py.

Without a GPU these run in Triton's interpreter (tests/conftest.py); with one, compiled on it,
bf16 included. Products sum in another order than the reference's, so values agree to rounding.
"""
from __future__ import annotations

import pytest
import torch

from pdchat.engine import Engine
from pdchat.engine.model import AttentionBatch
from pdchat.engine.model_runner import Work
from pdchat.kernels import reference
from pdchat.kernels import triton_decode as td

from .triton_device import DEVICE, DTYPES, INTERPRET

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=6e-2, rtol=3e-2)}


def rand(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# (N, K): K not a multiple of the K tile, N not of the row tile; the GPU adds the large-row tiles
SHAPES = [(37, 100), (300, 576)] + ([] if INTERPRET else [(9000, 96), (70000, 64)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", SHAPES)
def test_a_plain_product_with_bias(dtype, n, k) -> None:
    w, x, b = rand(n, k, dtype=dtype, scale=0.1), rand(k, dtype=dtype, seed=1), rand(n, dtype=dtype, seed=2)
    got = td.matvec((w, None, b), x)
    torch.testing.assert_close(got, reference.linear(x[None], w, b), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", SHAPES)
def test_the_residual_add_and_norm_in_the_products_loads(dtype, n, k) -> None:
    w, x, d = rand(n, k, dtype=dtype, scale=0.1), rand(k, dtype=dtype, seed=1), rand(k, dtype=dtype, seed=2)
    norm = rand(k, dtype=dtype, seed=3)
    total = torch.full((k,), float("nan"), dtype=dtype, device=DEVICE)
    got = td.matvec((w, None, None), x, prologue=td.NORM, delta=d, norm=norm, eps=1e-5, sum_out=total)
    ref_total, ref_normed = reference.add_rms_norm(x[None], d[None], norm, 1e-5)
    assert torch.equal(total, ref_total[0])            # one rounding of one sum, by program 0 only
    torch.testing.assert_close(got, reference.linear(ref_normed, w), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_first_product_gathers_its_embedding_row(dtype) -> None:
    table, norm = rand(50, 96, dtype=dtype), rand(96, dtype=dtype, seed=2)
    w = rand(70, 96, dtype=dtype, seed=1, scale=0.1)
    ids = torch.tensor([33], device=DEVICE)
    row = torch.empty(96, dtype=dtype, device=DEVICE)
    got = td.matvec((w, None, None), table, prologue=td.NORM, ids=ids, norm=norm, eps=1e-6, sum_out=row)
    assert torch.equal(row, table[33])
    torch.testing.assert_close(got, reference.linear(reference.rms_norm(table[33:34], norm, 1e-6), w), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_in_the_down_products_loads(dtype) -> None:
    gate_up, w = rand(2 * 150, dtype=dtype), rand(40, 150, dtype=dtype, seed=1, scale=0.1)
    got = td.matvec((w, None, None), gate_up, prologue=td.SILU)
    torch.testing.assert_close(got, reference.linear(reference.silu_mul(gate_up[None]), w), **TOL[dtype])


def test_the_vocabulary_product_writes_float32_rounded_as_the_reference() -> None:
    w, x = rand(60, 64, dtype=torch.float16, scale=0.3), rand(64, dtype=torch.float16, seed=1)
    got = td.matvec((w, None, None), x, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, got.half().float())       # rounded to the weights' dtype first, as .float() of it
    torch.testing.assert_close(got, reference.linear(x[None], w).float(), **TOL[torch.float16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_the_kv_store_in_one_launch(dtype, qk_norm) -> None:
    T, H, KVH, D, bs = 3, 6, 2, 32, 4
    plan = td.DecodePlan([], H, KVH, D, 1e-6)
    qkv = rand(T, (H + 2 * KVH) * D, dtype=dtype)
    positions = torch.tensor([5, 0, 17], device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    emb = torch.cat([torch.arange(32, device=DEVICE).float()[:, None] * inv[None, :]] * 2, dim=-1)
    table = emb.cos().to(dtype), emb.sin().to(dtype)
    q_norm, k_norm = (rand(D, dtype=dtype, seed=5), rand(D, dtype=dtype, seed=6)) if qk_norm else (None, None)
    # the caches are the middle of larger pools: a store outside them shows in the pools' ends
    k_pool, v_pool = rand(8, bs, KVH, D, dtype=dtype, seed=7), rand(8, bs, KVH, D, dtype=dtype, seed=8)
    k_cache, v_cache = k_pool[1:7], v_pool[1:7]
    slots = torch.tensor([9, -1, 22], device=DEVICE)     # the middle row is padding: stored nowhere
    want_k, want_v = k_pool.clone()[1:7], v_pool.clone()[1:7]
    ends = [pool[i].clone() for pool in (k_pool, v_pool) for i in (0, 7)]
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k, v = q.reshape(T, H, D), k.reshape(T, KVH, D), v.reshape(T, KVH, D)
    if qk_norm:
        q = reference.rms_norm(q.reshape(-1, D), q_norm, 1e-6).view(T, H, D)
        k = reference.rms_norm(k.reshape(-1, D), k_norm, 1e-6).view(T, KVH, D)
    want_q, k = reference.rope(q, k, table[0][positions], table[1][positions])
    reference.store_kv(k, v, want_k, want_v, slots)
    got_q = td.rope_store(qkv, positions, table, k_cache, v_cache, slots, plan, q_norm, k_norm)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(k_cache, want_k, **TOL[dtype])
    assert torch.equal(v_cache, want_v)                  # values are copied, not computed
    assert all(torch.equal(pool[i], end) for pool, i, end in zip((k_pool, k_pool, v_pool, v_pool), (0, 7) * 2, ends))


@pytest.fixture(params=["tiny", "tiny-qwen2", "tiny-qwen3"])
def engine(request):
    """float32 on both paths: the one-call step must give the op-by-op step's numbers."""
    with Engine(model=f"random:{request.param}", device=DEVICE, kernels="triton", dtype="float32", telemetry=False,
                num_kv_blocks=64) as e:
        yield e


def decode_batch(runner, table: list[int], position: int, splits: int | None) -> AttentionBatch:
    bs = runner.block_size
    slot = table[position // bs] * bs + position % bs

    def ints(values, dtype=torch.long):
        return torch.tensor(values, dtype=dtype, device=DEVICE)
    return AttentionBatch(runner.k_cache, runner.v_cache, ints([slot]), ints([table], torch.int32),
                          ints([0, 1], torch.int32), ints([position + 1], torch.int32), [1], [position + 1],
                          runner.scale, decode_splits=splits)


@pytest.mark.parametrize("splits", [None, 3])
def test_a_decode_step_in_one_call_matches_the_op_by_op_step(engine, monkeypatch, splits) -> None:
    runner, model = engine.runner, engine.runner.model
    prompt, table = list(range(3, 40)), [5, 9, 2, 7]      # scattered blocks, as the block manager leaves them
    runner.forward([Work(prompt, 0, table)], [[len(prompt) - 1]])
    ids, positions = torch.tensor([17], device=DEVICE), torch.tensor([len(prompt)], device=DEVICE)
    before = runner.k_cache.clone(), runner.v_cache.clone()
    whole = []
    monkeypatch.setattr(model.ops, "decode_forward",
                        lambda *a: whole.append(td.decode_forward(*a)) or whole[-1])
    fused = model.decode_logits(ids, positions, decode_batch(runner, table, len(prompt), splits), 64)
    assert whole and whole[0] is not None                 # the step did run in one call
    after = runner.k_cache.clone(), runner.v_cache.clone()
    runner.k_cache.copy_(before[0])
    runner.v_cache.copy_(before[1])
    plain = model.logits(model(ids, positions, decode_batch(runner, table, len(prompt), splits)))
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after[0], runner.k_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after[1], runner.v_cache, atol=1e-5, rtol=1e-5)
    assert not torch.equal(after[0], before[0])           # the new token's K was stored


def test_quantized_weights_and_several_rows_run_op_by_op() -> None:
    with Engine(model="random:tiny", device=DEVICE, kernels="triton", dtype="float32", telemetry=False,
                num_kv_blocks=64) as engine:
        model = engine.runner.model
        plan = model._layer_plan()
        assert plan is not None
        batch = decode_batch(engine.runner, [1, 2], 3, None)
        assert td.decode_forward(plan, model._head_weights(64), torch.tensor([1, 2], device=DEVICE),
                                 torch.tensor([3, 3], device=DEVICE), batch) is None
        engine.update(quant="int8")
        assert model._layer_plan() is None                 # int8 products stay op by op
