"""One request's fault ends that request alone: the others in its batch finish as if it were not there.

Faults are injected where a hostile or unlucky request can cause them (its logits turning non-finite,
its detokenizer or stop handling raising); the victims run greedy, so their text is checked exactly
against a solo run.
"""
from __future__ import annotations

import math

import pytest
import torch

from pdchat.engine import Engine, InvalidRequest, SamplingFailed, SamplingParams
from pdchat.engine.detokenizer import TextOutput
from pdchat.engine.sampler import NO_TOKEN, sample
from pdchat.engine.spec import Draft, verify
from pdchat.engine.sequence import Sequence

VICTIM = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["the first victim", "a second victim here", "and the third"]


@pytest.fixture(scope="module")
def engine():
    with Engine(model="random:tiny", device="cpu", telemetry=False, kv_cache_mb=16) as e:
        yield e


@pytest.fixture(scope="module")
def solo(engine):
    return {p: engine.submit(p, VICTIM).result().text for p in PROMPTS}


def run_with(engine, bad: SamplingParams):
    """The victims and one bad request, submitted together so they share steps."""
    streams = [engine.submit(p, VICTIM) for p in PROMPTS]
    bad_stream = engine.submit("the bad request", bad)
    return [s.result(timeout=60) for s in streams], bad_stream.result(timeout=60)


def assert_untouched(engine, victims, solo):
    assert [c.finish_reason for c in victims] == ["length"] * len(PROMPTS)
    assert [c.text for c in victims] == [solo[p] for p in PROMPTS]
    assert engine.stats().kv_blocks_used == 0


def test_a_tiny_temperature_is_greedy_and_harms_no_one(engine, solo):
    victims, bad = run_with(engine, SamplingParams(max_tokens=24, temperature=1e-40, ignore_eos=True))
    assert_untouched(engine, victims, solo)
    assert bad.finish_reason == "length"
    assert bad.text == engine.submit("the bad request", VICTIM).result().text


def test_non_finite_logits_fail_only_their_request(engine, solo, poisoned_sampling):
    victims, bad = run_with(engine, SamplingParams(max_tokens=24, temperature=poisoned_sampling, ignore_eos=True))
    assert_untouched(engine, victims, solo)
    assert bad.finish_reason == "error"
    assert isinstance(bad.exception, SamplingFailed) and "non-finite" in bad.error


def test_a_detokenizer_fault_fails_only_its_request(engine, solo, monkeypatch):
    real_add = TextOutput.add

    def add(self, token_id):
        if self.stop == ["<boom>"]:
            raise UnicodeError("this tokenizer cannot decode that")
        return real_add(self, token_id)

    monkeypatch.setattr(TextOutput, "add", add)
    victims, bad = run_with(engine, VICTIM.with_(stop=["<boom>"]))
    assert_untouched(engine, victims, solo)
    assert bad.finish_reason == "error" and "UnicodeError" in bad.error


def test_a_failed_forward_ends_its_step_and_the_engine_goes_on(engine, solo, monkeypatch):
    real_forward = engine.runner.forward
    calls = {"n": 0}

    def forward(work, rows, on_layer=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return real_forward(work, rows, on_layer)

    monkeypatch.setattr(engine.runner, "forward", forward)
    first = engine.submit(PROMPTS[0], VICTIM).result(timeout=60)
    assert first.finish_reason == "error" and "simulated device fault" in first.error
    assert first.exception is None             # not an EngineError: the engine's own fault
    again = engine.submit(PROMPTS[0], VICTIM).result(timeout=60)
    assert again.finish_reason == "length" and again.text == solo[PROMPTS[0]]
    assert engine.stats().kv_blocks_used == 0


def test_sample_marks_unusable_rows_and_samples_the_rest():
    logits = torch.tensor([[0.0, 5.0, 1.0], [math.nan, 1.0, 0.0], [1.0, 0.0, 9.0], [math.inf, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.5),
              SamplingParams(temperature=0), SamplingParams(temperature=0.5)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    out = sample(logits, params, gens).tolist()
    assert out[1] == NO_TOKEN and out[3] == NO_TOKEN
    assert out[0] in (0, 1, 2) and out[2] == 2
    greedy = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4).tolist()
    assert greedy[1] == NO_TOKEN and greedy[0] == 1 and greedy[2] == 2


def test_a_greedy_row_with_nan_logits_is_unusable_beside_sampled_rows():
    logits = torch.tensor([[math.nan, 1.0, 0.0], [0.0, 5.0, 1.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5)]
    out = sample(logits, params, [None, torch.Generator().manual_seed(0)]).tolist()
    assert out[0] == NO_TOKEN and out[1] in (0, 1, 2)
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=0))
    with pytest.raises(SamplingFailed):                      # a greedy verify with NaN logits
        verify(logits[[0, 0]], Draft([1], None), seq, None)


def test_verify_refuses_non_finite_logits():
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=0.8))
    logits = torch.zeros(3, 5)
    logits[1, 2] = math.nan
    with pytest.raises(SamplingFailed):
        verify(logits, Draft([1, 2], None), seq, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kwargs", [{"temperature": math.nan}, {"temperature": math.inf},
                                    {"temperature": -1.0}, {"seed": 2**64}, {"seed": -(2**63) - 1},
                                    {"seed": 2**70}, {"top_p": math.nan}, {"min_p": math.nan},
                                    {"max_tokens": 0}])
def test_sampling_params_refuse_values_that_cannot_work(kwargs):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_every_64_bit_seed_is_accepted_and_reproducible(engine, seed):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
    a, b = (engine.submit("seeded", params).result(timeout=60) for _ in range(2))
    assert a.finish_reason == "length" and a.token_ids == b.token_ids
