"""Speculative decoding: lossless for greedy, distribution-preserving for sampling, no leaks."""
from __future__ import annotations

import random

import pytest
import torch

from pdchat.engine import Engine, SamplingParams
from pdchat.engine.sequence import Sequence
from pdchat.engine.spec import AdaptiveK, Draft, NgramProposer, verify

GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
QUOTE = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. "


def test_ngram_lookup_prefers_longest_latest_match():
    ng = NgramProposer(max_n=3, min_n=1)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ng.lookup(tokens, 2) == [7, 8]             # the latest earlier "1 2 3" is followed by 7 8
    assert ng.lookup([4, 5, 6], 3) == []              # nothing repeats
    assert ng.lookup([5, 1, 5], 4) == [1, 5]          # falls back to a 1-gram
    assert NgramProposer(max_n=3, min_n=2).lookup([5, 1, 5], 4) == []   # unless 1-grams are off


# A separate draft with the target's own weights must be accepted every time: that checks the
# draft's cache is kept in step (a draft with other random weights would accept ~nothing).
@pytest.mark.parametrize("spec,draft", [("ngram", None), ("draft", None), ("draft", "random:tiny")])
def test_greedy_tokens_identical_alone_and_batched(spec, draft):
    rng = random.Random(3)
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=256) as plain:
        prompts = [plain.encode("Repeat exactly: " + QUOTE * 2), plain.encode("hello"),
                   [rng.randrange(1, 250) for _ in range(90)]]
        want = [c.token_ids for c in [plain.submit(p, GREEDY).result() for p in prompts]]
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=256, spec=spec, draft_model=draft,
                prefix_cache=True) as engine:
        alone = [engine.submit(p, GREEDY).result() for p in prompts]
        together = engine.generate(prompts + prompts, GREEDY)        # batched, and with prefix hits
        assert [c.token_ids for c in alone] == want
        assert [c.token_ids for c in together] == want + want
        drafted = sum(c.metrics.spec_drafted for c in alone)
        accepted = sum(c.metrics.spec_accepted for c in alone)
        assert drafted > 0 and 0 < accepted <= drafted
        if draft == "random:tiny":
            assert accepted == drafted
        assert alone[0].metrics.spec_method == engine.proposer.name
        assert engine.stats().kv_blocks_used == 0


def test_default_model_spec_is_lossless(default_engine):
    text = ("Pdchat is a terminal chat app that hosts its own inference engine and shows the prefill "
            "pause, the decode stream, the KV cache and the device at work.")
    prompts = [f"Repeat this sentence exactly: {text}", "Name three rivers in Europe.", "What is 7 times 6?"]
    greedy = SamplingParams(max_tokens=48, temperature=0)
    want = [c.token_ids for c in [default_engine.submit(p, greedy).result() for p in prompts]]
    original = default_engine.config.spec
    try:
        for spec in ("ngram", "draft"):             # draft without --draft-model = int8 self-draft
            default_engine.update(spec=spec)
            alone = default_engine.submit(prompts[0], greedy).result()
            assert alone.token_ids == want[0], spec
            assert alone.metrics.spec_accepted > 0, spec
            together = default_engine.generate(prompts, greedy)          # batched, prefix cache on
            assert [c.token_ids for c in together] == want, spec
    finally:
        default_engine.update(spec=original)


def _fake_seq(params: SamplingParams) -> Sequence:
    return Sequence("s", [1], params)


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_rejection_sampling_recovers_the_target_distribution(one_hot_draft):
    """First emitted token over many trials ~ target p, not draft q (small vocab, synthetic)."""
    p_logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0]).repeat(2, 1)      # target at both positions
    q = torch.tensor([0.05, 0.1, 0.6, 0.2, 0.05])                           # draft disagrees
    target = p_logits[0].softmax(-1)
    params = SamplingParams(temperature=1.0)
    seq = _fake_seq(params)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    trials = 20000
    for _ in range(trials):
        if one_hot_draft:
            token = 2                                                        # an n-gram guess
            draft = Draft([token], None)
        else:
            token = int(torch.multinomial(q, 1, generator=gen))
            draft = Draft([token], q.unsqueeze(0))
        out, _ = verify(p_logits, draft, seq, gen)
        counts[out[0]] += 1
    freq = counts / trials
    assert (freq - target).abs().max() < 0.015, (freq, target)
    assert (freq - q).abs().max() > 0.2


def test_seeded_spec_sampling_is_reproducible():
    p = SamplingParams(max_tokens=40, temperature=0.9, seed=11, ignore_eos=True)
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=64, spec="ngram") as engine:
        ids = engine.encode("Repeat: " + QUOTE * 2)
        a = engine.submit(ids, p).result().token_ids
        b = engine.submit(ids, p).result().token_ids
        assert a == b


def test_adaptive_k_grows_shrinks_and_gives_up():
    ak = AdaptiveK(4, max_k=8, min_rate=0.25, window=8)
    s = _fake_seq(SamplingParams())
    assert ak.next_k(s) == 4
    ak.update(s, 4, 4)
    assert ak.next_k(s) == 6
    ak.update(s, 6, 1)
    assert ak.next_k(s) == 5
    for _ in range(3):
        ak.update(s, 5, 0)
    assert s.spec_off and ak.next_k(s) == 0


def test_spec_under_preemption_is_lossless_and_leak_free():
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 40) for _ in range(rng.randrange(5, 60))] for _ in range(24)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=256) as big:
        want = [c.token_ids for c in big.generate(prompts, params)]
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=20, spec="ngram", max_num_seqs=8) as small:
        got = small.generate(prompts, params)
        assert [c.token_ids for c in got] == want
        assert sum(c.metrics.preemptions for c in got) > 0
        assert sum(c.metrics.spec_accepted for c in got) > 0
        assert small.stats().kv_blocks_used == 0
