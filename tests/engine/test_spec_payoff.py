"""Speculative decoding turns itself off where it measurably does not pay (spec_payoff.py)."""
from __future__ import annotations

import pytest

from pdchat.engine import Engine, SamplingParams
from pdchat.engine import spec_payoff
from pdchat.engine.spec_payoff import MIN_PROBES, MIN_SPEC_STEPS, PROBE_EVERY, SpecPayoff


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


@pytest.mark.parametrize("loss, stays_on", [(1e6, False), (0.0, True)])
def test_the_engine_turns_speculation_off_when_it_does_not_pay(monkeypatch, loss, stays_on):
    """`loss` stands in for the machine: 1e6 makes any draft too slow, 0 never."""
    monkeypatch.setattr(spec_payoff, "LOSS", loss)
    greedy = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 10
    with Engine(model="random:tiny", telemetry=False, kv_cache_mb=16) as plain:
        expected = plain.submit(prompt, greedy).result().token_ids
    with Engine(model="random:tiny", telemetry=False, kv_cache_mb=16, spec="ngram") as engine:
        engine.speculative.adaptive.min_rate = 0.0           # acceptance alone never stops it here
        done = engine.submit(prompt, greedy).result()
        assert done.token_ids == expected                    # greedy output is the same either way
        assert (engine.config.spec == "ngram") is stays_on
        off = [n for n in engine.notices if n.startswith("speculative decoding turned off: ngram decoded")]
        assert len(off) == (0 if stays_on else 1)
