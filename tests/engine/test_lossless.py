"""Every optimization gives the same greedy tokens (CPU fp32): prefix cache, chunked prefill of
any size, naive mode (no KV cache), and batching with other requests."""
from __future__ import annotations

import random

import pytest

from pdchat.engine import Engine, ProgressEvent, SamplingParams, TokenEvent

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 250) for _ in range(70)]          # a shared "system prompt"
    return [shared + [rng.randrange(1, 250) for _ in range(n)] for n in (5, 40, 150)]


def reference(preset: str, ps: list[list[int]]) -> list[list[int]]:
    """One request at a time, no prefix cache, no chunking."""
    with Engine(model=f"random:{preset}", telemetry=False, prefix_cache=False, chunk_size=None,
                kv_cache_mb=8) as engine:
        return [engine.submit(p, GREEDY).result().token_ids for p in ps]


SETTINGS = {
    "prefix cache": dict(prefix_cache=True, chunk_size=None),
    "chunk 16": dict(prefix_cache=False, chunk_size=16),
    "chunk 64 + prefix": dict(prefix_cache=True, chunk_size=64),
    "chunk 256": dict(prefix_cache=False, chunk_size=256),
    "time budget 1.5": dict(prefix_cache=False, chunk_size="auto", step_budget=1.5),
    "time budget 8 + prefix": dict(prefix_cache=True, chunk_size="auto", step_budget=8),
    "naive (no KV cache)": dict(kv_cache=False, prefix_cache=False),
}


def run_beside_a_stream(engine: Engine, ps: list[list[int]]) -> tuple[list[list[int]], int]:
    """Run prompts one by one while another request decodes (so the chunk budget applies).
    Returns the tokens and the most prefill steps any prompt took."""
    background = engine.submit([5, 6, 7], SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True))
    for event in background:
        if isinstance(event, TokenEvent):
            break
    outs, most_steps = [], 0
    for p in ps:
        events = list(engine.submit(p, GREEDY))
        outs.append(events[-1].completion.token_ids)
        most_steps = max(most_steps, sum(isinstance(e, ProgressEvent) and e.phase == "prefill" for e in events))
    background.cancel()
    return outs, most_steps


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_toggles_are_lossless(preset):
    ps = prompts(0)
    want = reference(preset, ps)
    for name, setting in SETTINGS.items():
        with Engine(model=f"random:{preset}", telemetry=False, kv_cache_mb=8, **setting) as engine:
            got, steps = run_beside_a_stream(engine, ps)
            again = [engine.submit(p, GREEDY).result().token_ids for p in ps]   # now with prefix hits
            assert got == want, name
            assert again == want, name
            if setting.get("chunk_size") == 16:
                assert steps >= 200 // 16, "the long prompt should have been prefilled in chunks"
            if setting.get("chunk_size") == "auto":
                stats = engine.stats()
                assert stats.sliced_step_planned_ms is not None and stats.sliced_step_ms is not None, name
            if setting.get("prefix_cache"):
                assert engine.stats().prefix_hit_rate > 0.3, name


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_batched_with_seven_random_neighbours_is_lossless(preset):
    ps = prompts(1)
    want = reference(preset, ps)
    rng = random.Random(5)
    with Engine(model=f"random:{preset}", telemetry=False, kv_cache_mb=8, chunk_size=64) as engine:
        for target, expected in zip(ps, want):
            neighbours = [[rng.randrange(1, 250) for _ in range(rng.randrange(1, 300))] for _ in range(7)]
            params = [SamplingParams(max_tokens=rng.randrange(5, 60), temperature=0.8, seed=i, ignore_eos=True)
                      for i in range(7)]
            out = engine.generate(neighbours[:3] + [target] + neighbours[3:], params[:3] + [GREEDY] + params[3:])
            assert out[3].token_ids == expected


def test_default_model_toggles_are_lossless(default_engine):
    question = "Summarize the plot of Romeo and Juliet in three sentences."
    want = default_engine.submit(question, GREEDY).result().token_ids
    prompt_tokens = len(default_engine.encode(question))
    original = default_engine.config
    # Beside a decoding stream, so the chunk budget really applies (alone, a prompt goes in one piece).
    for changes, chunked in ((dict(chunk_size=16), True), (dict(kv_cache=False), False),
                             (dict(chunk_size=None), False)):
        default_engine.update(prefix_cache=False, **changes)
        try:
            (got,), steps = run_beside_a_stream(default_engine, [question])
            assert got == want, changes
            if chunked:
                assert steps >= -(-prompt_tokens // 16), "the prompt should have been prefilled in chunks"
            else:
                assert steps == 1, changes
        finally:
            default_engine.update(chunk_size=original.chunk_size, kv_cache=original.kv_cache,
                                  prefix_cache=original.prefix_cache)
    # a second turn hits the first turn's blocks
    default_engine.submit(question, GREEDY).result()
    before = default_engine.blocks.hit_tokens
    default_engine.submit(question, GREEDY).result()
    assert default_engine.blocks.hit_tokens - before >= 16
