"""Speculative sampling follows the target distribution: at every drafted position, and end to end.

Two levels:
- `verify` alone, with k = 3 draft tokens and four different target rows and three different draft
  rows, so a residual or bonus token drawn from the wrong row shows.
- The engine: sampled outputs (temperature > 0, k >= 3) with an n-gram proposer and with draft
  models are scored under the target's own distribution at each position, computed by a plain
  engine on the same weights. For a correct sampler each token's randomized PIT value is an
  independent Uniform(0, 1) draw (whatever the earlier tokens were), and the probability the
  target gave the sampled token has a known mean and variance given the past, so both statistics
  have exact null distributions.

Every check uses a fixed seed, so runs are repeatable; the thresholds are set so that a correct
sampler would fail them for fewer than 1 in 1,000 seeds (stated per check below).
"""
from __future__ import annotations

import math

import pytest
import torch

from pdchat.engine import Engine, SamplingParams
from pdchat.engine.sampler import target_probs
from pdchat.engine.sequence import Sequence
from pdchat.engine.spec import Draft, verify

# Chi-square p-values below this fail: 1e-4 per check, at most 8 checks per test.
P_FAIL = 1e-4
# |z| above this fails: two-sided normal tail 6e-5.
Z_FAIL = 4.0


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value; categories with under 5 expected counts are pooled."""
    n = float(observed.sum())
    expected = expected_probs.double() * n
    order = expected.argsort()
    obs, exp = observed.double()[order], expected[order]
    small = exp < 5
    if small.any():
        obs = torch.cat([obs[small].sum().view(1), obs[~small]])
        exp = torch.cat([exp[small].sum().view(1), exp[~small]])
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# ---- verify alone ------------------------------------------------------------------------------

def _rows(gen: torch.Generator, n: int, v: int, sharpness: float) -> torch.Tensor:
    return (torch.randn(n, v, generator=gen, dtype=torch.float64) * sharpness).softmax(-1).float()


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_verify_with_three_drafts_gives_the_target_row_at_every_position(one_hot_draft):
    V, k, trials = 6, 3, 12000
    gen = torch.Generator().manual_seed(1234)
    p = _rows(gen, k + 1, V, 1.5)                     # the target: a different row per position
    q = 0.4 * p[:k] + 0.6 * _rows(gen, k, V, 1.5)     # the draft: near the target, not equal
    seq = Sequence("s", [1], SamplingParams(temperature=1.0))
    counts = torch.zeros(k + 1, V)
    for _ in range(trials):
        if one_hot_draft:                              # an n-gram guess: the draft's likeliest tokens
            tokens = q.argmax(-1).tolist()
            draft = Draft(tokens, None)
        else:
            tokens = torch.multinomial(q, 1, generator=gen).view(-1).tolist()
            draft = Draft(tokens, q)
        out, accepted = verify(p.log(), draft, seq, gen)
        assert len(out) == accepted + 1 and out[:accepted] == tokens[:accepted]
        for j, token in enumerate(out):
            counts[j, token] += 1
    for j in range(k + 1):
        assert counts[j].sum() > 500, f"position {j} reached too rarely to test"
        assert chi_square_p(counts[j], p[j]) > P_FAIL, (j, counts[j] / counts[j].sum(), p[j])


# ---- the engine --------------------------------------------------------------------------------

PROMPT = "Repeat: the cat sat on the mat. the cat sat on the mat. the cat sat"
SAMPLES, TOKENS = 48, 40
# Low enough that drafts get accepted on a random model (its distributions are otherwise nearly
# uniform and speculation would rarely run); top_p exercises the processed distribution.
PARAMS = dict(max_tokens=TOKENS, temperature=0.3, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def scorer():
    with Engine(model="random:tiny", device="cpu", telemetry=False, num_kv_blocks=64) as engine:
        yield engine


def score(scorer: Engine, prompt: list[int], outputs: list[list[int]], params: SamplingParams,
          gen: torch.Generator) -> tuple[torch.Tensor, float]:
    """PIT values of every output token, and the z-score of the summed target probabilities of the
    sampled tokens against their mean and variance given the past."""
    pits, s, mean, var = [], 0.0, 0.0, 0.0
    for out in outputs:
        logits = scorer.prompt_logits(prompt + out)[len(prompt) - 1:-1]
        probs = target_probs(logits, [params] * len(out)).double()
        for row, token in zip(probs, out):
            below = float(row[:token].sum())
            pits.append(below + float(torch.rand(1, generator=gen, dtype=torch.float64)) * float(row[token]))
            s += float(row[token])
            p2, p3 = float((row ** 2).sum()), float((row ** 3).sum())
            mean += p2
            var += p3 - p2 * p2
    return torch.tensor(pits), (s - mean) / math.sqrt(var)


@pytest.mark.parametrize("spec,draft", [("ngram", None), ("draft", None), ("draft", "random:tiny-qwen2")])
def test_sampled_engine_output_follows_the_target_distribution(scorer, spec, draft):
    with Engine(model="random:tiny", device="cpu", telemetry=False, num_kv_blocks=512, spec=spec,
                draft_model=draft, spec_tokens=4, spec_always=True) as engine:
        prompt = engine.encode(PROMPT)
        params = [SamplingParams(seed=1000 + i, **PARAMS) for i in range(SAMPLES)]
        done = engine.generate([prompt] * SAMPLES, params)
    assert all(c.finish_reason == "length" and len(c.token_ids) == TOKENS for c in done)
    drafted = sum(c.metrics.spec_drafted for c in done)
    accepted = sum(c.metrics.spec_accepted for c in done)
    assert drafted >= SAMPLES, "speculation hardly ran: the test would prove nothing"
    if draft is None and spec == "draft":
        assert accepted > drafted / 2          # self-draft: many bonus tokens and several positions
    pits, z = score(scorer, prompt, [c.token_ids for c in done], SamplingParams(**PARAMS),
                    torch.Generator().manual_seed(7))
    bins = torch.histc(pits.float(), bins=10, min=0.0, max=1.0)
    assert chi_square_p(bins, torch.full((10,), 0.1)) > P_FAIL, bins
    assert abs(z) < Z_FAIL, z


def test_the_engine_check_sees_a_sampler_that_ignores_top_p(scorer):
    """The same statistics reject outputs sampled from another distribution (here without top_p
    and hotter): the engine test above can fail."""
    with Engine(model="random:tiny", device="cpu", telemetry=False, num_kv_blocks=512) as engine:
        prompt = engine.encode(PROMPT)
        other = {**PARAMS, "temperature": 0.45, "top_p": 1.0}
        done = engine.generate([prompt] * SAMPLES, [SamplingParams(seed=i, **other) for i in range(SAMPLES)])
    pits, z = score(scorer, prompt, [c.token_ids for c in done], SamplingParams(**PARAMS),
                    torch.Generator().manual_seed(7))
    bins = torch.histc(pits.float(), bins=10, min=0.0, max=1.0)
    assert chi_square_p(bins, torch.full((10,), 0.1)) < P_FAIL or abs(z) > Z_FAIL
