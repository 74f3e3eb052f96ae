from __future__ import annotations

import pytest
import torch

from pdchat.engine.config import SamplingParams
from pdchat.engine.errors import InvalidRequest
from pdchat.engine.sampler import sample, target_probs


def test_greedy_is_argmax_with_first_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0)] * 2, [None, None])
    assert out.tolist() == [1, 0]


def test_top_p_keeps_the_boundary_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    p = target_probs(probs.log(), [SamplingParams(temperature=1.0, top_p=0.6)])
    # 0.5 < 0.6, so the token that crosses the boundary (0.3) stays; the rest go.
    assert torch.allclose(p, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))


def test_top_k_and_min_p_and_temperature():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    p = target_probs(logits, [SamplingParams(temperature=1.0, top_k=2)])
    assert (p[0, 2:] == 0).all() and torch.isclose(p[0, :2].sum(), torch.tensor(1.0))
    p = target_probs(logits, [SamplingParams(temperature=1.0, min_p=0.3)])
    full = logits.softmax(-1)[0]
    assert ((p[0] > 0) == (full >= 0.3 * full.max())).all()
    hot = target_probs(logits, [SamplingParams(temperature=2.0)])
    assert torch.allclose(hot, (logits / 2).softmax(-1))


def test_per_row_parameters_in_one_batch():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 2)
    p = target_probs(logits, [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=3)])
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert p[1, 3] == 0 and (p[1, :3] > 0).all()


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=1.0)]

    def draws(seed):
        g = torch.Generator().manual_seed(seed)
        return [sample(logits, params, [g]).item() for _ in range(3000)]

    a, b = draws(7), draws(7)
    assert a == b and a != draws(8)
    freq = torch.bincount(torch.tensor(a), minlength=3).float() / len(a)
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.03)


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1),
                                 dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=1.0)])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(InvalidRequest):
        SamplingParams(**bad)


def test_usable_needs_finite_non_negative_rows_with_mass():
    from pdchat.engine.sampler import usable
    rows = torch.tensor([[0.2, 0.8, 0.0],                   # a distribution
                         [float("nan"), 0.5, 0.5],
                         [float("inf"), 0.0, 0.0],
                         [0.6, -0.1, 0.5],                  # negative weight, positive sum
                         [0.0, 0.0, 0.0],                   # no mass
                         [0.5, float("nan"), 0.5],          # a NaN past the first weight
                         [0.5, 0.5, -float("inf")],
                         [3e38, 3e38, 1.0]])                # finite weights whose fp32 sum overflows
    assert usable(rows).tolist() == [True, False, False, False, False, False, False, True]


# ---- target_probs on values worked out by hand (exact in float32) ------------------------------------
def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kw})


def test_top_k_of_one_is_the_argmax_alone():
    probs = target_probs(torch.tensor([[0.0, 2.0, 1.0, 1.5]]), [sp(top_k=1)])
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k_drops_the_rest_even_where_the_kept_mass_rounds_below_one():
    # The three kept probabilities sum to 0.99999988 in float32: a top-p of 1.0 applied on top
    # of them must not let the other five back in.
    logits = torch.tensor([[-0.5663175, 0.3731146, -0.8919953, -1.5091077, 0.3703935, 1.4565026, 0.9398099,
                            0.7748488]])
    probs = target_probs(logits, [sp(top_k=3)])
    assert (probs[0] > 0).nonzero().flatten().tolist() == [5, 6, 7]
    torch.testing.assert_close(probs[0, 5:], logits[0, 5:].softmax(-1))


def test_top_p_can_leave_the_first_token_alone():
    probs = target_probs(torch.tensor([[0.0, 2.0, 0.0]]), [sp(top_p=0.5)])     # the top one is 0.79
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_top_p_of_one_keeps_tokens_after_the_mass_rounds_to_one():
    probs = target_probs(torch.tensor([[30.0, 0.0, 0.0, 0.0]]), [sp(top_p=1.0)])
    assert probs[0, 0] == 1.0 and bool((probs[0, 1:] > 0).all())      # ~1e-13 each, not dropped


def test_top_p_drops_a_token_once_the_mass_before_it_reaches_p_exactly():
    probs = target_probs(torch.zeros(1, 4), [sp(top_p=0.5)])          # 0.25 each: 0, .25, .5, .75 before
    assert sorted(probs[0].tolist()) == [0.0, 0.0, 0.5, 0.5]


def test_top_k_and_top_p_together_apply_both():
    probs = target_probs(torch.zeros(1, 4), [sp(top_k=2, top_p=0.99)])
    assert sorted(probs[0].tolist()) == [0.0, 0.0, 0.5, 0.5]


def test_min_p_keeps_tokens_level_with_its_threshold():
    ln2 = torch.log(torch.tensor(2.0)).item()
    probs = target_probs(torch.tensor([[ln2, 0.0, 0.0]]), [sp(min_p=0.5)])     # 0.25 = 0.5 x the top
    assert probs.tolist() == [[0.5, 0.25, 0.25]]


def test_min_p_renormalizes_each_row_of_a_batch_by_itself():
    ln2 = torch.log(torch.tensor(2.0)).item()
    logits = torch.tensor([[ln2, 0.0, 0.0, -10.0], [0.0, 0.0, -10.0, -10.0], [0.0, 1.0, 2.0, 3.0]])
    probs = target_probs(logits, [sp(min_p=0.4), sp(min_p=0.5), sp()])
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.25, 0.25, 0.0]))
    torch.testing.assert_close(probs[1], torch.tensor([0.5, 0.5, 0.0, 0.0]))
    torch.testing.assert_close(probs[2], torch.tensor([0.0, 1.0, 2.0, 3.0]).softmax(-1))


def test_a_greedy_row_stays_one_hot_beside_a_nan_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [float("nan")] * 3])
    probs = target_probs(logits, [SamplingParams(temperature=0.0), sp()])
    assert probs[0].tolist() == [0.0, 1.0, 0.0] and bool(probs[1].isnan().all())


def test_draw_follows_the_distribution_and_never_picks_a_zero():
    """draw's inverse-CDF pick: frequencies match the probabilities (chi-square), tokens of zero
    probability (at either end and inside) never come, a seeded generator repeats its tokens."""
    from pdchat.engine.sampler import draw
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(7)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(n)]), minlength=6).double()
    assert counts[0] == counts[2] == counts[5] == 0
    expected = probs.double()[[1, 3, 4]] * n
    chi2 = float(((counts[[1, 3, 4]] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8                                      # p = 0.001 for 2 degrees of freedom
    tiny = torch.full((49152,), 1e-12)
    tiny[-1] = 1.0                                          # almost all mass on the last of a big vocabulary
    assert all(draw(tiny, torch.Generator().manual_seed(s)) == 49151 for s in range(20))
    assert [draw(probs, torch.Generator().manual_seed(3)) for _ in range(2)] == [draw(probs, torch.Generator().manual_seed(3))] * 2


def test_draw_rows_at_the_ends_of_the_uniform_range(monkeypatch):
    """The pick is the first token whose cumulative mass exceeds u times the row's own total: at
    u = 0 a leading token of no probability is skipped, rows need not sum to one (each is scaled
    by its total), and a draw that rounds up to the total (u = 1 here) stays in the vocabulary."""
    from pdchat.engine import sampler
    probs = torch.tensor([[0.0, 2.0, 0.0, 2.0], [0.0, 0.0, 1.0, 1.0]])
    for u, want in ((0.0, [1, 2]), (0.75, [3, 3]), (0.3, [1, 2]), (1.0, [3, 3])):
        monkeypatch.setattr(sampler.torch, "rand", lambda n, **kw: torch.full((n,), u, dtype=torch.float64))
        assert sampler.draw_rows(probs, [None, None]).tolist() == want, u


def test_a_min_p_of_zero_leaves_the_softmax_as_it_is():
    # No pass at all: renormalising would move rows whose softmax sums to an ulp off one.
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    probs = target_probs(logits, [SamplingParams(temperature=1.0, min_p=0.0)] * 4)
    assert torch.equal(probs, logits.softmax(-1))
