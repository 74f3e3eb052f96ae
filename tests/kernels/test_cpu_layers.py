"""The CPU backend's one-call forward of all layers (pd_layers) against the same kernels called op
by op from engine/model.py: the same numbers, the same KV cache, and the op-by-op path wherever the
C code does not cover a batch."""
from __future__ import annotations

import pytest
import torch

from pdchat.engine import Engine, quant
from pdchat.engine.config import SamplingParams
from pdchat.engine.model_runner import Work
from pdchat.kernels import reference


@pytest.fixture(params=["tiny", "tiny-qwen2", "tiny-qwen3"])
def engine(request):
    with Engine(model=f"random:{request.param}", kernels="cpu", telemetry=False, num_kv_blocks=64) as e:
        yield e


def spy_on_layers(engine, monkeypatch) -> list[bool]:
    """Record whether each forward ran its layers in one call."""
    ops, calls = engine.runner.model.ops, []
    real = ops.run_layers

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]
    monkeypatch.setattr(ops, "run_layers", spy)
    return calls


def both_paths(engine, monkeypatch, items: list[Work], rows: list[list[int]]):
    """Logits and caches after one forward with pd_layers and, from the same cache, without."""
    runner = engine.runner
    before = runner.k_cache.clone(), runner.v_cache.clone()
    fused = runner.forward(items, rows), runner.k_cache.clone(), runner.v_cache.clone()
    runner.k_cache.copy_(before[0])
    runner.v_cache.copy_(before[1])
    with monkeypatch.context() as m:
        m.setattr(runner.model.ops, "run_layers", reference.run_layers)
        plain = runner.forward(items, rows), runner.k_cache, runner.v_cache
    return before, fused, plain


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_one_call_forward_matches_op_by_op(engine, monkeypatch, quant):
    engine.update(quant=quant)
    calls = spy_on_layers(engine, monkeypatch)
    g = torch.Generator().manual_seed(1)
    bs = engine.blocks.block_size
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (7, bs + 5, 3)]
    tables = [[5, 9], [2, 11, 7], [30, 4]]           # scattered blocks, as the block manager leaves them
    steps = [
        ([Work(p, 0, t) for p, t in zip(prompts, tables)], [[len(p) - 1] for p in prompts]),   # prefills
        # decodes beside a 3-token speculative verification
        ([Work([11], len(prompts[0]), tables[0]), Work([12], len(prompts[1]), tables[1]),
          Work([13, 14, 15], len(prompts[2]), tables[2])], [[0], [0], [0, 1, 2]]),
    ]
    for items, rows in steps:
        before, (fused, k1, v1), (plain, k2, v2) = both_paths(engine, monkeypatch, items, rows)
        assert torch.equal(fused, plain) and torch.equal(k1, k2) and torch.equal(v1, v2)
        assert not torch.equal(k1, before[0]), "the forward stored no K/V"
    assert calls == [True, True]


def a_prompt(engine, n: int) -> tuple[list[Work], list[list[int]]]:
    """A prompt of n tokens from scratch in blocks 1, 2, ..., and its last row."""
    blocks = -(-n // engine.blocks.block_size)
    return [Work(list(range(n)), 0, list(range(1, blocks + 1)))], [[n - 1]]


def past_the_fast_rows(engine) -> tuple[list[Work], list[list[int]]]:
    """A prompt of more rows than one C call takes (the build's fast rows)."""
    return a_prompt(engine, engine.runner.model.ops.fast_rows.limit + 2)


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_a_prompt_of_all_the_fast_rows_is_one_call_with_the_op_by_op_numbers(engine, monkeypatch, quant):
    engine.update(quant=quant)
    calls = spy_on_layers(engine, monkeypatch)
    items, rows = a_prompt(engine, engine.runner.model.ops.fast_rows.limit)
    _, (fused, k1, v1), (plain, k2, v2) = both_paths(engine, monkeypatch, items, rows)
    assert calls == [True]
    assert torch.equal(fused, plain) and torch.equal(k1, k2) and torch.equal(v1, v2)


def test_batches_beyond_the_c_code_run_op_by_op(engine, monkeypatch):
    calls = spy_on_layers(engine, monkeypatch)
    logits = engine.runner.forward(*past_the_fast_rows(engine))
    assert calls == [False] and logits.isfinite().all()


def test_plans_follow_the_quant_mode_and_new_weights(engine):
    model = engine.runner.model
    engine.update(spec="draft")                        # the self-draft's int8 copies beside fp32
    fp_plan = model._layer_plan()
    with quant.precision_mode(model.quant_switch, "int8"):
        int8_plan = model._layer_plan()
    assert {t.dtype for t in int8_plan.tensors} > {torch.uint8}
    assert torch.uint8 not in {t.dtype for t in fp_plan.tensors}
    with quant.precision_mode(model.quant_switch, "int8"):
        assert model._layer_plan() is int8_plan        # cached: the self-draft flips every step
    assert model._layer_plan() is fp_plan
    engine.update(spec="off")
    engine.update(quant="int4")                        # new weights: new plans
    int4_plan = model._layer_plan()
    assert int4_plan is not fp_plan and torch.bfloat16 in {t.dtype for t in int4_plan.tensors}
    assert int4_plan.dims[6] == 2                      # pd_layers reads them as int4
    engine.update(quant="none")
    assert model._layer_plan() is not fp_plan          # read again: new tensors, a new plan


def test_the_pool_spins_only_through_a_one_call_forward(engine, monkeypatch):
    # Between the op-by-op forward's kernels OpenMP's threads (BLAS, SDPA) run: a C worker
    # spinning for the next job would take a core from them.
    kernels = engine.runner.model.ops.run_layers.__self__        # the CpuKernels behind the ops
    told, lib = [], kernels.lib

    class Spy:
        def __getattr__(self, name):
            return getattr(lib, name)

        def pd_pool_spin(self, on):
            told.append(bool(on))
            lib.pd_pool_spin(on)

    monkeypatch.setattr(kernels, "lib", Spy())
    calls = spy_on_layers(engine, monkeypatch)
    runner = engine.runner
    runner.forward([Work([3, 4, 5], 0, [1])], [[2]])                          # one C call
    runner.forward(*past_the_fast_rows(engine))                                # op by op
    assert calls == [True, False] and told == [True, False]


def test_the_one_call_forward_times_the_attention_of_sequences_of_several_queries(engine):
    runner, ops = engine.runner, engine.runner.model.ops
    runner.forward([Work(list(range(1, 8)), 0, [3])], [[6]])          # a 7-token prompt: tiles
    assert ops.tile_seconds() > 0
    runner.forward([Work([9], 7, [3])], [[0]])                          # a decode: no tiles
    assert ops.tile_seconds() == 0.0
    runner.forward(*past_the_fast_rows(engine))                         # op by op: not timed
    assert ops.tile_seconds() is None


def test_each_step_hands_the_scheduler_its_slices_attention_time(engine, monkeypatch):
    seen = []
    real = engine.scheduler.record

    def record(plan, seconds, drafted, tile_seconds=None):
        seen.append((plan.prompt_tokens, tile_seconds))
        return real(plan, seconds, drafted, tile_seconds)
    monkeypatch.setattr(engine.scheduler, "record", record)
    engine.generate([list(range(1, 12))], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    prompt, *decodes = seen
    assert prompt[0] == 11 and prompt[1] > 0
    assert decodes and all(tokens == 0 and t == 0.0 for tokens, t in decodes)
