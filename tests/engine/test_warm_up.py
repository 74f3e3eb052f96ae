"""The forward an engine runs at load (ModelRunner.warm_up): it happens, and it leaves no trace."""
from __future__ import annotations

import pytest
import torch

from pdchat.engine import Engine, SamplingParams
from pdchat.engine.model_runner import ModelRunner

# Token ids as they are: short enough that the first one decodes inside the warm-up's two blocks.
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13] * 5]


def tiny(**kw) -> Engine:
    return Engine(model="random:tiny", device="cpu", telemetry=False, kv_cache_mb=16, seed=3, **kw)


def answers(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(PROMPTS, params)]


def test_a_cpu_engine_runs_a_prompt_block_and_a_decode_row_at_load(monkeypatch):
    seen = []
    forward = ModelRunner.forward

    def spy(self, items, rows, on_layer=None):
        seen.append([(len(w.tokens), w.start, list(w.block_table)) for w in items])
        return forward(self, items, rows, on_layer)
    monkeypatch.setattr(ModelRunner, "forward", spy)
    with tiny() as engine:
        bs = engine.runner.block_size
        assert seen == [[(bs, 0, [0, 1])], [(1, bs, [0, 1])]]
        # nothing of it shows: every block free, none cached, no step counted
        stats = engine.stats()
        assert engine.blocks.num_free == len(engine.blocks.blocks) and engine.blocks.num_cached_free == 0
        assert (stats.kv_blocks_used, stats.kv_blocks_cached, stats.step_ms, stats.prefix_hit_rate) == (0, 0, None, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Triton's kernels are not interpreted")
def test_triton_on_a_cpu_is_the_interpreter_and_is_not_warmed(monkeypatch):
    seen = []
    monkeypatch.setattr(ModelRunner, "forward", lambda self, items, rows, on_layer=None: seen.append(items))
    with tiny(kernels="triton") as engine:
        assert engine.ops.name == "triton" and seen == []


def test_the_first_requests_answer_as_without_it(monkeypatch):
    """The first request gets blocks 0 and 1, which hold the warm-up's K/V: each slot is written
    before it is read, so the tokens are those of an engine that never warmed up (an attention
    that read one slot too far would see the warm-up's K/V here, and zeros there)."""
    with tiny() as engine:
        warmed = answers(engine)
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: None)
    with tiny() as engine:
        assert answers(engine) == warmed
