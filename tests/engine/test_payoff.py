"""Speculative decoding turns itself off where it measurably does not pay (payoff.py)."""
from __future__ import annotations

import pytest

from pdchat.engine import Engine, SamplingParams
from pdchat.engine import payoff
from pdchat.engine.payoff import MIN_PROBES, MIN_SPEC_STEPS, PROBE_EVERY, QUANT_STEPS, QuantPayoff, SpecPayoff


def _feed(payoff: SpecPayoff, spec_rate: float, plain_rate: float, requests: int = 1, steps: int = 200):
    """Steps as the engine runs them: drafted ones, with a probe whenever one is due."""
    for _ in range(steps):
        probe = payoff.probe_now()
        rate = plain_rate if probe else spec_rate
        reason = payoff.record(requests, int(rate * requests), 1.0, drafted=not probe, method="self-draft")
        if reason is not None:
            return reason
    return None


def test_probes_come_every_few_speculative_steps():
    payoff = SpecPayoff()
    pattern = []
    for _ in range(3 * (PROBE_EVERY + 1)):
        probe = payoff.probe_now()
        pattern.append(probe)
        payoff.record(1, 1, 1.0, drafted=not probe, method="ngram")
    assert pattern == ([False] * PROBE_EVERY + [True]) * 3


def test_a_slower_method_is_stopped_with_both_figures_and_a_faster_one_is_not():
    reason = _feed(SpecPayoff(), spec_rate=20, plain_rate=30)
    assert reason.startswith("self-draft decoded 20.0 tok/s per request against 30.0 without drafts")
    assert f"{MIN_SPEC_STEPS} steps measured at batch 1" in reason
    assert _feed(SpecPayoff(), spec_rate=45, plain_rate=30) is None
    assert _feed(SpecPayoff(), spec_rate=29, plain_rate=30) is None                  # within the margin


def test_no_verdict_before_enough_of_both_nor_across_batch_sizes():
    payoff = SpecPayoff()
    for _ in range(MIN_SPEC_STEPS - 1):
        assert payoff.record(1, 1, 1.0, drafted=True, method="ngram") is None
    for _ in range(MIN_PROBES):
        assert payoff.record(1, 100, 1.0, drafted=False, method="ngram") is None   # 15 drafted steps only
    assert payoff.record(2, 2, 1.0, drafted=True, method="ngram") is None           # another batch size
    assert payoff.record(1, 1, 1.0, drafted=True, method="ngram") is not None       # the 16th at batch 1
    payoff.reset()
    assert payoff.record(1, 1, 1.0, drafted=True, method="ngram") is None


@pytest.mark.parametrize("loss, always, stays_on", [(1e6, False, False), (0.0, False, True), (1e6, True, True)])
def test_the_engine_turns_speculation_off_when_it_does_not_pay(monkeypatch, loss, always, stays_on):
    """`loss` stands in for the machine: 1e6 makes any draft too slow, 0 never; spec_always keeps it on."""
    monkeypatch.setattr(payoff, "LOSS", loss)
    greedy = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 10
    with Engine(model="random:tiny", telemetry=False, kv_cache_mb=16) as plain:
        expected = plain.submit(prompt, greedy).result().token_ids
    with Engine(model="random:tiny", telemetry=False, kv_cache_mb=16, spec="ngram", spec_always=always) as engine:
        engine.speculative.adaptive.min_rate = 0.0           # acceptance alone never stops it here
        done = engine.submit(prompt, greedy).result()
        assert done.token_ids == expected                    # greedy output is the same either way
        assert (engine.config.spec == "ngram") is stays_on
        off = [n for n in engine.notices if n.startswith("speculative decoding turned off: ngram decoded")]
        assert len(off) == (0 if stays_on else 1)


def _steps(payoff: QuantPayoff, mode: str, seconds: float, n: int = QUANT_STEPS, requests: int = 1):
    said = [payoff.record(mode, requests, seconds) for _ in range(n)]
    return [s for s in said if s is not None]


def test_quantized_weights_no_faster_are_explained_once_with_the_figures():
    payoff = QuantPayoff()
    assert _steps(payoff, "float32", 0.030) == []
    payoff.switched("float32", "int8", 538_000_000, 135_000_000)
    assert _steps(payoff, "int8", 0.029, n=QUANT_STEPS - 1) == []                  # not measured enough yet
    said = _steps(payoff, "int8", 0.029, n=3)
    assert len(said) == 1 and said[0].startswith("int8 weights decode at 1.03x the speed of float32")
    assert "saves memory (538 -> 135 MB of weights), not time" in said[0]


def test_quantized_weights_larger_than_the_exact_blocks_are_said_to_save_nothing():
    """Full precision held in exact Q4 blocks takes fewer bytes than int8 weights would."""
    payoff = QuantPayoff()
    _steps(payoff, "float32", 0.011)
    payoff.switched("float32", "int8", 112_000_000, 141_000_000)
    said = _steps(payoff, "int8", 0.012)
    assert len(said) == 1 and said[0].startswith("int8 weights decode at 0.92x the speed of float32")
    assert "hold no less memory (112 -> 141 MB of weights" in said[0]
    assert said[0].endswith("so int8 saves neither time nor memory here") and "saves memory" not in said[0]


def test_faster_quantized_weights_and_full_precision_say_nothing():
    payoff = QuantPayoff()
    _steps(payoff, "float32", 0.030)
    payoff.switched("float32", "int4", 538_000_000, 95_000_000)
    assert _steps(payoff, "int4", 0.010, n=3 * QUANT_STEPS) == []
    payoff.switched("int4", None, 95_000_000, 538_000_000)                      # back to float32
    assert _steps(payoff, "float32", 0.050, n=3 * QUANT_STEPS) == []
    payoff.switched("float32", "int8", 538_000_000, 135_000_000)
    assert _steps(payoff, "int8", 0.020, n=QUANT_STEPS, requests=4) == []          # another batch size


def test_the_engine_explains_quantized_weights_that_are_no_faster(monkeypatch):
    """QUANT_GAIN stands in for the machine: at 1e6 no CPU's int8 is fast enough."""
    monkeypatch.setattr(payoff, "QUANT_GAIN", 1e6)
    greedy = SamplingParams(max_tokens=3 * QUANT_STEPS, temperature=0, ignore_eos=True)
    with Engine(model="random:tiny", telemetry=False, kv_cache_mb=16) as engine:
        engine.submit([5, 6, 7], greedy).result()
        engine.update(quant="int8")
        engine.submit([5, 6, 7], greedy).result()
        said = [n for n in engine.take_notices() if "weights decode at" in n]
        assert len(said) == 1 and said[0].startswith("int8 weights decode at") and "of float32" in said[0]
        assert engine.config.quant == "int8" and engine.take_notices() == []    # kept, and told once
