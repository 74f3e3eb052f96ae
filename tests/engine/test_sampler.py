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
                         [0.0, 0.0, 0.0]])                  # no mass
    assert usable(rows).tolist() == [True, False, False, False, False]
