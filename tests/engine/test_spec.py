"""Speculative decoding: lossless for greedy, distribution-preserving for sampling, no leaks."""
from __future__ import annotations

import random

import pytest
import torch

from pdchat.engine import Engine, SamplingParams
from pdchat.engine.sampler import draw
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
    # spec_always: drafting with a copy of the target does not pay, and these tests are about losslessness
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=256, spec=spec, draft_model=draft,
                prefix_cache=True, spec_always=True) as engine:
        alone = [engine.submit(p, GREEDY).result() for p in prompts]
        together = engine.generate(prompts + prompts, GREEDY)        # batched, and with prefix hits
        assert [c.token_ids for c in alone] == want
        assert [c.token_ids for c in together] == want + want
        drafted = sum(c.metrics.spec_drafted for c in alone)
        accepted = sum(c.metrics.spec_accepted for c in alone)
        assert drafted > 0 and 0 < accepted <= drafted
        if draft == "random:tiny":
            assert accepted == drafted
        assert alone[0].metrics.spec_method == engine.speculative.proposer.name
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
            default_engine.update(spec=spec, spec_always=True)
            alone = default_engine.submit(prompts[0], greedy).result()
            assert alone.token_ids == want[0], spec
            assert alone.metrics.spec_accepted > 0, spec
            together = default_engine.generate(prompts, greedy)          # batched, prefix cache on
            assert [c.token_ids for c in together] == want, spec
    finally:
        default_engine.update(spec=original, spec_always=False)


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
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=64, spec="ngram", spec_always=True) as engine:
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
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=20, spec="ngram", max_num_seqs=8,
                spec_always=True) as small:
        got = small.generate(prompts, params)
        assert [c.token_ids for c in got] == want
        assert sum(c.metrics.preemptions for c in got) > 0
        assert sum(c.metrics.spec_accepted for c in got) > 0
        assert small.stats().kv_blocks_used == 0


# ---- unit checks of the proposers and AdaptiveK (they kill mutants: see docs/mutation.md) -------

def test_ngram_defaults_and_overlapping_repeats():
    ng = NgramProposer()
    assert (ng.max_n, ng.min_n) == (3, 2)
    # The latest earlier occurrence may overlap the tail by all but one token.
    assert ng.lookup([5, 5, 5], 2) == [5]
    assert ng.lookup([1, 2, 3, 4, 2, 3, 4, 2, 3, 4], 3) == [2, 3, 4]
    # A 4-gram repeat is not preferred over the latest 3-gram one with default max_n = 3.
    assert ng.lookup([1, 2, 3, 4, 8, 9, 0, 2, 3, 4, 7, 1, 2, 3, 4], 1) == [7]


class _FakeRunner:
    """A draft model whose logits favour token (last input token + 1) mod V; NaN logits for a
    sequence whose block table is [-1]."""

    def __init__(self, vocab: int = 16, flat: bool = False, switch=None):
        self.vocab, self.flat, self.switch = vocab, flat, switch
        self.calls: list[list[tuple[list[int], int]]] = []
        self.modes_seen: list[str] = []

    def forward(self, work, positions):
        self.calls.append([(list(w.tokens), w.start) for w in work])
        if self.switch is not None:
            self.modes_seen.append(self.switch.mode)
        logits = torch.zeros(len(work), self.vocab)
        for row, w in enumerate(work):
            if not self.flat:
                logits[row, (w.tokens[-1] + 1) % self.vocab] = 8.0
            if w.block_table == [-1]:
                logits[row] = float("nan")
        return logits


def _draft_seq(rid: str, tokens: list[int], **params) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(**params))


def test_draft_proposer_drafts_k_tokens_per_sequence_and_tracks_its_cache():
    from pdchat.engine.spec import DraftProposer
    runner = _FakeRunner()
    prop = DraftProposer("draft:x", runner)
    assert prop.name == "draft:x" and prop.switch is None
    a, b, c = (_draft_seq("a", [1, 2, 3], temperature=0), _draft_seq("b", [7], temperature=1.0, min_p=0.5),
               _draft_seq("c", [4, 5], temperature=0))
    drafts = prop.propose([a, b, c], [3, 1, 0])
    assert [d.tokens for d in drafts] == [[4, 5, 6], [8], []]
    assert drafts[0].probs is None                         # greedy: one-hot, nothing built
    assert drafts[1].probs.shape == (1, 16) and drafts[1].probs[0, 8] == 1.0      # sampled: its distribution
    assert drafts[2].probs is None                         # nothing drafted: no distribution
    # Step 0 catches up from draft_computed; later steps feed one token each.
    assert runner.calls == [[([1, 2, 3], 0), ([7], 0)], [([4], 3)], [([5], 4)]]
    assert (a.draft_computed, b.draft_computed, c.draft_computed) == (5, 1, 0)


def test_draft_proposer_skips_an_unusable_row_but_not_the_others():
    from pdchat.engine.spec import DraftProposer
    runner = _FakeRunner()
    a, b = _draft_seq("a", [1, 2], temperature=1.0), _draft_seq("b", [3], temperature=0)
    c = _draft_seq("c", [6], temperature=0)          # greedy, with NaN logits: its argmax means nothing
    a.block_table = c.block_table = [-1]
    drafts = DraftProposer("d", runner).propose([a, b, c], [2, 2, 2])
    assert drafts[0].tokens == [] and drafts[0].probs is None
    assert drafts[1].tokens == [4, 5]
    assert drafts[2].tokens == [] and drafts[2].probs is None
    assert (a.draft_computed, b.draft_computed, c.draft_computed) == (2, 2, 1)


def test_draft_proposer_samples_with_the_request_generator():
    from pdchat.engine.spec import DraftProposer
    V, k = 1000, 4

    def drafted(seed):
        s = _draft_seq("s", [1, 2], temperature=1.0)
        s.generator = torch.Generator().manual_seed(seed)
        return DraftProposer("d", _FakeRunner(vocab=V, flat=True)).propose([s], [k])[0].tokens

    g = torch.Generator().manual_seed(5)
    uniform = torch.full((V,), 1.0 / V)
    want = [draw(uniform, g) for _ in range(k)]
    torch.manual_seed(0)
    assert drafted(5) == want and drafted(5) == want and drafted(6) != want


def test_self_draft_runs_in_int8_mode_and_restores_it():
    from types import SimpleNamespace

    from pdchat.engine.spec import DraftProposer
    switch = SimpleNamespace(mode="none")
    runner = _FakeRunner(switch=switch)
    prop = DraftProposer("self-draft", runner, switch=switch)
    assert prop.switch is switch
    prop.propose([_draft_seq("s", [1], temperature=0)], [2])
    assert runner.modes_seen == ["int8", "int8"] and switch.mode == "none"


def test_self_draft_attends_over_the_targets_cache_so_it_feeds_only_the_last_token():
    from types import SimpleNamespace

    from pdchat.engine.spec import DraftProposer
    switch = SimpleNamespace(mode="none")
    runner = _FakeRunner(switch=switch)
    seq = _draft_seq("s", [1, 2, 3, 4], temperature=0)
    seq.num_computed_tokens = 3         # the target holds the K/V of all but the last token
    drafts = DraftProposer("self-draft", runner, switch=switch).propose([seq], [2])
    assert runner.calls == [[([4], 3)], [([5], 4)]]     # a draft model's pool would start from 0
    assert drafts[0].tokens == [5, 6]


def test_a_self_draft_writes_no_kv_the_target_has_computed():
    # Its guesses' K/V go where the verify writes the target's next; a draft that fed one token
    # too many would overwrite the target's K/V of an earlier token with int8 ones (close enough
    # that greedy tokens rarely show it).
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=64, spec="draft", spec_always=True) as engine:
        runner, speculative, bs = engine.runner, engine.speculative, engine.blocks.block_size
        kept: list[bool] = []           # per proposal: the computed positions' K/V unchanged
        drafts: list[int] = []
        propose = speculative.propose

        def computed_kv(seqs: list[Sequence]) -> torch.Tensor:
            slots = [s.block_table[p // bs] * bs + p % bs for s in seqs for p in range(s.num_computed_tokens)]
            return torch.stack([c.flatten(1, 2)[:, slots] for c in (runner.k_cache, runner.v_cache)]).clone()

        def checked_propose(items, blocks, max_model_len):
            seqs = [i.seq for i in items]
            before = computed_kv(seqs)
            drafted = propose(items, blocks, max_model_len)
            kept.append(torch.equal(before, computed_kv(seqs)))
            drafts.append(len(drafted[0]))
            return drafted

        speculative.propose = checked_propose
        engine.submit("Repeat exactly: " + QUOTE * 2, GREEDY).result()
        assert sum(drafts) > 5 and all(kept)


def test_self_draft_shares_the_targets_kv_pool_and_a_draft_model_has_its_own_even_when_turned_on_later():
    sized = dict(model="random:tiny", telemetry=False, kv_cache_mb=1)
    with Engine(**sized) as plain:
        blocks = plain.blocks.num_blocks
    with Engine(**sized, spec="draft", spec_always=True) as self_drafting:
        assert self_drafting.blocks.num_blocks == blocks
        assert self_drafting.speculative.proposer.runner is self_drafting.runner
        done = self_drafting.submit("Repeat exactly: " + QUOTE, GREEDY).result()
        assert done.metrics.spec_drafted > 0 and self_drafting.stats().kv_blocks_used == 0
    with Engine(**sized, spec="draft", draft_model="random:tiny", spec_always=True) as two_models:
        assert two_models.blocks.num_blocks == blocks // 2      # the budget holds both pools
        assert two_models.speculative.proposer.runner is not two_models.runner
    with Engine(**sized, draft_model="random:tiny", spec_always=True) as later:
        later.update(spec="draft")                   # the named draft, loaded now: not a self-draft
        assert later.speculative.proposer.name == "draft:random:tiny"
        assert later.speculative.proposer.runner is not later.runner
        done = later.submit("Repeat exactly: " + QUOTE, GREEDY).result()
        assert done.metrics.spec_accepted == done.metrics.spec_drafted > 0     # its own weights' copy


def test_adaptive_k_defaults_and_boundaries():
    ak = AdaptiveK(3)
    assert (ak.k0, ak.max_k, ak.min_rate, ak.window) == (3, 6, 0.3, 16)
    s = _fake_seq(SamplingParams())
    s.spec_k = 2
    ak.update(s, 2, 0)
    assert s.spec_k == 1                                    # shrinks down to 1, not below
    ak.update(s, 1, 0)
    assert s.spec_k == 1
    # A rate exactly at min_rate keeps speculating; one exactly `window` drafts long is judged.
    at = AdaptiveK(4, min_rate=0.25, window=8)
    s = _fake_seq(SamplingParams())
    at.update(s, 4, 1)
    at.update(s, 4, 1)
    assert not s.spec_off and at.next_k(s) == 2
    low = AdaptiveK(4, min_rate=0.25, window=8)
    s = _fake_seq(SamplingParams())
    low.update(s, 4, 1)
    low.update(s, 4, 0)
    assert s.spec_off and low.next_k(s) == 0


def test_verify_draws_its_tokens_from_the_request_generator():
    # A seeded request must get the same tokens from verify as from its own generator: the bonus
    # token (no draft) and the residual after a certain rejection (draft token has p = 0).
    V = 1000
    seq = _fake_seq(SamplingParams(temperature=1.0))
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    p = logits.softmax(-1)
    for seed in range(5):
        want = draw(p[0], torch.Generator().manual_seed(seed))
        torch.manual_seed(100 + seed)                       # the global generator must not be used
        assert verify(logits[:1], Draft([], None), seq, torch.Generator().manual_seed(seed)) == ([want], 0)
        masked = logits.clone()
        masked[0, 7] = float("-inf")                          # the drafted token 7 has p = 0
        g = torch.Generator().manual_seed(seed)
        torch.rand(1, generator=g)                            # verify's accept draw
        residual = masked[0].softmax(-1)
        want = draw(residual, g)
        assert verify(masked, Draft([7], None), seq, torch.Generator().manual_seed(seed)) == ([want], 0)


def test_verify_refuses_non_finite_target_logits_with_a_clear_error():
    from pdchat.engine.errors import SamplingFailed
    seq = _fake_seq(SamplingParams(temperature=1.0))
    logits = torch.zeros(2, 8)
    logits[1, 3] = float("nan")
    with pytest.raises(SamplingFailed) as failed:
        verify(logits, Draft([2], None), seq, None)
    assert str(failed.value) == "the model's output has no usable distribution to sample from (non-finite logits)"


def test_verify_accepts_p_equal_q_without_drawing():
    # p(token) == q(token) accepts outright: no uniform is drawn, so the bonus token is the
    # generator's first draw (a seeded request's stream depends on it).
    V = 1000
    seq = _fake_seq(SamplingParams(temperature=1.0))
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
    p = logits.softmax(-1)
    for seed in range(5):
        want = draw(p[1], torch.Generator().manual_seed(seed))
        out = verify(logits, Draft([11], p[:1].clone()), seq, torch.Generator().manual_seed(seed))
        assert out == ([11, want], 1)


def test_verify_falls_back_to_the_target_row_when_the_residual_is_empty():
    # Rounding can leave max(0, p - q) all zero after a rejection (q >= p everywhere, q(t) > p(t)):
    # the token then comes from p itself, never from a 0/0 row (whose draw is the last token, one
    # that p never gives here).
    seq = _fake_seq(SamplingParams(temperature=1.0))
    logits = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]).log()
    q = torch.tensor([[0.5, 0.9, 0.1]])
    gen = torch.Generator().manual_seed(0)
    rejected = 0
    for _ in range(200):
        out, accepted = verify(logits, Draft([1], q), seq, gen)
        assert out[0] in (0, 1) and len(out) == accepted + 1
        rejected += accepted == 0
    assert rejected > 40                      # 1 - 0.5 / 0.9 = 44 % of the drafts are rejected


def test_greedy_verify_accepts_up_to_the_first_token_off_the_targets_argmax_and_draws_nothing():
    from pdchat.engine.errors import SamplingFailed
    seq = _fake_seq(SamplingParams(temperature=0))
    logits = torch.full((4, 8), -1.0)
    for row, best in enumerate([5, 2, 6, 1]):
        logits[row, best] = 1.0
    logits[1, 7] = float("inf")                  # an infinite logit is still the row's argmax
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    assert verify(logits, Draft([5, 7, 6], None), seq, gen) == ([5, 7, 6, 1], 3)    # all, and a bonus
    assert verify(logits, Draft([5, 7, 4], None), seq, gen) == ([5, 7, 6], 2)       # the third is off
    assert verify(logits, Draft([3, 7, 6], None), seq, gen) == ([5], 0)
    assert verify(logits[:1], Draft([], None), seq, gen) == ([5], 0)
    assert torch.equal(gen.get_state(), state)   # greedy takes no random number
    logits[2, 0] = float("nan")
    with pytest.raises(SamplingFailed):
        verify(logits, Draft([5, 7, 6], None), seq, gen)
