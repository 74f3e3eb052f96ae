"""What a step costs, learned from the steps that ran; how many prompt tokens fit a time budget.

A step is modeled as the decode step it carries plus its prefill work:

    seconds = decode + per_token * tokens + per_pair * pairs

`decode` is the measured time of a decode-only step (an exponentially weighted average over the
recent ones: the running streams' TPOT, which the step budget is a multiple of). `tokens` are the
prompt tokens the step computes and `pairs` the query-key pairs their attention scores: a token at
position p sees p + 1 keys, so a slice late in a long prompt costs more than an early one. The
coefficients are fitted online (least squares, recent steps weighted more), each pulled slightly
towards a prior: a 16-token slice costing about a decode step, and a pair costing what the
model's FLOPs say relative to a token. Where the kernels time a slice's attention apart (the
CPU's one-call forward) the pair's price is fitted on that time alone (see _Fit).

Where the kernels take rows by vectors (a CPU's fp32 products: strips of 8 rows, half an
AVX-512 vector; its int8 ones 16 at a time there) a slice's `tokens` are the charged ones: the
step's rows rounded up to whole vectors, less its decodes' rows (`charged_tokens`; a whole prompt
on BLAS is charged as it is).
With vectors of 16, 17 prompt tokens beside one decode cost what 31 do (measured at the start of
a prompt, default model: the decode alone 26 ms, with 15 tokens 39, with 31 56, with 47 75); slices
sized by tokens alone mostly ended inside a vector (39, 32, 16 tokens beside a decode: 40, 33, 17
rows). The products now go by strips of 8, so a step may end at 24 rows where 32 are past the
budget.
And a step's vectors are not alike, so the charged tokens count by the vector of the step they are
in, each vector with its own coefficient (`vector_split`). A decode alone is bound by reading the
weights: the rows that fill its vector ride that read, while each further vector is paid in
arithmetic, and on some CPUs a third costs more than a second (2-core AMD EPYC, the default
model's 30 layers of products: 16 rows 22 ms, 32 rows 41, 48 rows 69 as one strip, 62-63 as the
three strips of 16 that the kernels now take there). One coefficient for all,
fitted mostly on one-vector slices, planned two-vector slices 15-25% short (62-71 ms planned,
68-87 taken) and a three-vector one at 48 ms that took 75: the longest steps of stutter runs. A
vector not measured yet is priced as the one before it, and none below the one before it
(`_non_decreasing`): a row's arithmetic does not get cheaper as a step widens.

Two fits: prompt slices beside decoding streams (what the budget sizes), and prompts prefilled
with no stream to protect (whole, and the prefill progress's estimate) or in steps past the
kernels' fast path (a fixed chunk). They run on different paths at different efficiency (a CPU: a
slice within the fast rows, 48 or 144, as one C call; a whole prompt op by op, on BLAS and flash
attention or the C kernels, whichever the machine runs faster: half a slice's cost per token where
this was measured): one fit of both sized the first slices after a long lone prompt twice too
large.

One fixed cost is known rather than fitted: where decode steps replay a CUDA graph while steps
with prompt tokens run op by op (a GPU), the latter pay the launches the graph saves, about ten
decode steps of a small model; the graphs measure it when they are captured (`StepCost.fixed`).
Where that alone exceeds the budget the stall is paid anyway, so a slice may cost as much again: a
few such stalls instead of one per 16 tokens (measured on an H200: a 1,055-token newcomer waited
2.7 s behind 16-token slices, 60-101 ms with this rule, 20 ms unchunked).

Beyond that there is no separate fixed cost of a step with a prompt slice: the slices the budget
picks are mostly alike, so a fixed part and a per-token part cannot be told apart from them, and a wrong
split made the slices ever smaller (measured: a fitted 40 ms fixed part where a direct timing
showed under 10). A real fixed part shows up as a per-token cost a little too high for small
slices: predictions err towards shorter steps.
"""
from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from pdchat.kernels import FastRows

    from .model_config import ModelConfig

DECAY = 0.9              # weight of an observation after each newer one (the fit follows the machine)
RECENT_SLICES = 10       # slices whose widths say what was measured lately: about the fit's memory
GROWTH = 1.5             # a slice's rows may reach this times the widest measured lately (or a vector more)
FORGOTTEN_AFTER = 30     # steps after which a vector measured once weighs as much as its neighbour's price
PRIOR_WEIGHT = 1e-4       # of the prior against one observation: it only matters before there are some
PRIOR_SLICE = 16         # tokens whose prefill costs about one decode step, before anything is measured
PRIOR_TOKEN_SECONDS = 1e-3   # per prompt token, before even a decode step was measured


def attention_pairs(start: int, tokens: int) -> int:
    """Query-key pairs of `tokens` tokens at positions start, start + 1, ...: each sees itself and
    every position before it."""
    return tokens * start + tokens * (tokens + 1) // 2


def pair_flops_ratio(cfg: "ModelConfig") -> float:
    """A query-key pair's attention FLOPs (a score and a weighted value per head, every layer) over
    a token's FLOPs in the linear layers: the prior of per_pair / per_token."""
    d, hd = cfg.hidden_size, cfg.head_dim
    linear = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * d + 3 * d * cfg.intermediate_size
    return (2 * cfg.num_heads * hd) / linear


def charged_tokens(tokens: int, other_rows: int, granule: int) -> int:
    """What `tokens` prompt rows cost in a step with `other_rows` rows besides (its decodes) on
    kernels that take rows `granule` at a time: the rows past the last whole vector are paid as a
    whole vector (a slice of 17 tokens beside one decode costs what 31 do), the vector the other
    rows began is free to fill."""
    vectors = -(-(tokens + other_rows) // granule)
    return vectors * granule - other_rows


def vector_split(tokens: int, other_rows: int, granule: int, vectors: int) -> tuple[int, ...]:
    """A slice's charged tokens (charged_tokens) by the vector of its step they are in: the first
    `vectors` - 1 vectors one count each, the last count for the rest. The step's `other_rows` (its
    decodes) come first; where rows go by any count (granule 1) every token counts as the first's."""
    if granule <= 1:
        return (tokens,) + (0,) * (vectors - 1)
    end = other_rows + charged_tokens(tokens, other_rows, granule)      # the end of the step's last vector
    counts = [max(0, min(end, (k + 1) * granule) - max(other_rows, k * granule)) for k in range(vectors)]
    counts[-1] += max(0, end - max(other_rows, vectors * granule))
    return tuple(counts)


class Coefficients(NamedTuple):
    """Seconds per charged token in each vector of a step (vector_split), and per query-key pair."""
    vectors: tuple[float, ...]
    pair: float

    @property
    def token(self) -> float:
        """Seconds per token in the first vector: every token's where rows go by any count."""
        return self.vectors[0]

    def work(self, split: tuple[int, ...], pairs: int) -> float:
        return sum(c * n for c, n in zip(self.vectors, split)) + self.pair * pairs


class StepCost:
    def __init__(self, pair_ratio: float, fast_rows: "FastRows | None" = None):
        # The kernels' fast path (a CPU's one-call forward): the scheduler keeps a time-budgeted
        # slice within its rows, and this model charges a slice's rows by its vectors.
        self.fast_rows = fast_rows
        self.decode_s: float | None = None          # a decode-only step, recent average
        # What a step with prompt tokens costs beyond a decode step whatever its tokens (seconds;
        # the engine wires in the CUDA graphs' measurement, else none)
        self.fixed: Callable[[], float] = lambda: 0.0
        # Vectors a step on the fast path may have (one where rows go by any count)
        self.vectors = -(-fast_rows.limit // fast_rows.granule) if fast_rows else 1
        forget = self.granule ** 2 * DECAY ** FORGOTTEN_AFTER
        self._beside = _Fit(pair_ratio, self.vectors, forget)       # prompt slices in steps with decodes
        self._alone = _Fit(pair_ratio, self.vectors, forget)        # prompt work in steps without
        self._slice_rows: deque[int] = deque(maxlen=RECENT_SLICES)    # rows of the latest steps with a slice

    def record_decode(self, seconds: float) -> None:
        """A decode-only step (no prompt tokens, no drafts) took `seconds`."""
        self.decode_s = seconds if self.decode_s is None else DECAY * self.decode_s + (1 - DECAY) * seconds

    def record_prefill(self, tokens: int, pairs: int, decoded: bool, seconds: float, other_rows: int = 0,
                       attention_s: float | None = None, timed: bool = True) -> None:
        """A step computed `tokens` prompt tokens scoring `pairs` query-key pairs (beside decodes
        when `decoded`, `other_rows` rows of them) in `seconds`, `attention_s` of them in the pairs'
        attention where the kernels timed it; `timed`: its slice was sized by the budget (not a
        fixed chunk, whose width does not count as measured: slice_rows_cap)."""
        if tokens > 0:
            if decoded:
                self._slice_rows.append(tokens + other_rows if timed else 0)
            work = seconds - (self.decode_s or 0.0) - self.fixed()
            (self._beside if decoded else self._alone).add(self.charged(tokens, other_rows, decoded), pairs,
                                                           max(work, 0.0), attention_s)

    @property
    def granule(self) -> int:
        """Rows the kernels' products take at a time (1: any count costs by the row)."""
        return self.fast_rows.granule if self.fast_rows else 1

    def charged(self, tokens: int, other_rows: int, decoded: bool = True) -> tuple[int, ...]:
        """The tokens a step's prompt work is charged for, by the vector they are in (vector_split):
        by whole vectors for slices beside decodes (the kernels' fast path), as they are elsewhere
        (a whole prompt op by op, all counted as the first vector's)."""
        if decoded:
            return vector_split(tokens, other_rows, self.granule, self.vectors)
        return (tokens,) + (0,) * (self.vectors - 1)

    def slice_rows_cap(self, other_rows: int) -> int:
        """The most rows a step with a slice beside `other_rows` rows of decodes may have before a
        step about that wide is measured: half as wide again as the widest of the latest slices
        that the budget sized (at least a vector more), or two vectors (one past the decodes' rows
        where they fill more). A vector not measured lately is priced as the one before it, and
        they are not alike: on a 2-core AMD EPYC (Zen 3, AVX2, 2026-12-02), early in a prompt, 8
        more rows beside a decode cost 13, 16 and 16-20 ms from 24, 32 and 40 rows, so a step
        widened past what was measured runs over its plan by what its new vectors cost beyond
        their neighbour's price. Fitted on the first slice alone, the second was planned at 47
        tokens for 40-48 ms and took 74-78: a stall of 3.8-4.1 decode steps in each of three fresh
        engines (a fixed first slice, before a decode step is measured, does not count). Widened
        by doubling (until 2026-12-02), a newcomer's first slice after a prompt's late slices of
        16 rows took 32, planned with two vectors not measured since the last prompt: 1.10-1.39x
        its plan in four rounds, the worst gap of one. A fixed chunk's steps are measured but do
        not widen the cap: all alike, they do not tell a step's vectors apart (after chunks of 32
        tokens the fit priced five vectors at 1.01 ms a token each, and the first slices, 40-48
        rows, took 1.07-1.54x their plans, the bench's worst gap in two of its three rounds)."""
        g = self.granule
        widest = max(self._slice_rows, default=0)
        grown = max(-(-int(GROWTH * widest) // g) * g, widest + g) if widest else 0
        return max(grown, 2 * g, other_rows + g)

    def prompt_seconds(self, step_budget: float) -> float:
        """Seconds of prompt work a step beside decodes may take: the budget's share past its
        decode step and the fixed cost, or the fixed cost again where that alone exceeds it."""
        fixed = self.fixed()
        return max((step_budget - 1) * (self.decode_s or 0.0) - fixed, fixed)

    def step_seconds(self, prefill_s: float) -> float:
        """A step's predicted time: its decode step, the fixed cost and `prefill_s` of prompt work."""
        return (self.decode_s or 0.0) + self.fixed() + prefill_s

    def coefficients(self, decoded: bool = True) -> Coefficients:
        """Seconds per charged token and per query-key pair, beside decodes or alone."""
        prior = self.decode_s / PRIOR_SLICE if self.decode_s else PRIOR_TOKEN_SECONDS
        return (self._beside if decoded else self._alone).coefficients(prior)

    def prefill_seconds(self, start: int, tokens: int, decoded: bool = True, other_rows: int = 0) -> float:
        """Predicted cost of prefilling `tokens` tokens from position `start` within a step that
        has `other_rows` rows besides."""
        return self.work_seconds(self.charged(tokens, other_rows, decoded), attention_pairs(start, tokens), decoded)

    def work_seconds(self, charged: tuple[int, ...], pairs: int, decoded: bool = True) -> float:
        """Predicted prompt work of `charged` tokens (StepCost.charged) scoring `pairs` pairs."""
        return self.coefficients(decoded).work(charged, pairs)

    def tokens_within(self, seconds: float, start: int, other_rows: int = 0, most: int | None = None,
                      floor_s: float | None = None) -> int:
        """The prompt tokens (up to `most`) from position `start` to prefill beside decodes
        (`other_rows` rows of them) within `seconds` (may be 0), in a step that costs `floor_s`
        whatever the slice (its decodes, the other slices planned; by default its decode step).

        Where rows go by any count: the most that fit. Where they go by vectors: per count of
        vectors, what fits of its last one (early in a prompt it fills it, late, where attention
        dominates, it may be part full), and of those the count that gives the most tokens per
        second of the step. A few tokens past a vector pay for a whole one: beside a decode, 16
        tokens took 51-54 ms where 15 took 33-44 (default model, 2-core AMD EPYC), and the most
        that fit took the 16."""
        if seconds <= 0:
            return 0
        c = self.coefficients()
        most = 1 << 30 if most is None else most
        if self.granule <= 1:
            return min(most, _quadratic_tokens(c.token, c.pair, start, seconds))
        floor_s = self.step_seconds(0.0) if floor_s is None else floor_s
        g, best, best_rate = self.granule, 0, 0.0
        for k in range(other_rows // g + 1, self.vectors + 1):
            full = k * g - other_rows                  # the tokens that fill k vectors
            linear = c.work(self.charged(full, other_rows), 0)
            room = seconds - linear
            if room < 0 or full - g >= most:
                break
            n = min(full, most, _quadratic_tokens(0.0, c.pair, start, room))
            rate = n / (floor_s + linear + c.pair * attention_pairs(start, n)) if n > 0 else 0.0
            if rate > best_rate:
                best, best_rate = n, rate
        return best


def _quadratic_tokens(a: float, b: float, start: int, seconds: float) -> int:
    """The most n with a*n + b*(n*start + n*(n+1)/2) <= seconds."""
    linear = a + b * (start + 0.5)
    if b <= 0:
        return int(seconds / linear) if linear > 0 else 1 << 30
    return max(0, int((-linear + math.sqrt(linear * linear + 2 * b * seconds)) / b))


class _Fit:
    """Prefill seconds ~ sum over a step's vectors of per_token[k] * its tokens in vector k
    (vector_split) + per_pair * pairs: exponentially weighted least squares over (tokens by vector,
    pairs in token units). Where the kernels time the attention apart (`attention_s`) per_pair is
    fitted on that time alone and the vectors on the rest: from the step times alone the two trade
    places, since the slices a budget picks late in a prompt are alike (one vector, their pairs
    growing slowly), and the vectors' prices with them (measured: a second vector's price drifted
    from 1.1 to 2.7-3.1 ms a token as the first vector's fell to zero, and no two-vector slice was
    planned again). Each vector past the first is pulled towards the price of the one before it
    with a fixed weight (`forget`): a vector measured once and not since is priced as its
    neighbour again after a while, so one slow step cannot keep slices of that width out for good."""

    def __init__(self, pair_ratio: float, vectors: int, forget: float):
        self.pair_ratio, self.vectors, self.forget = pair_ratio, vectors, forget
        n = vectors + 1                     # the vectors' tokens, then the pairs
        self._xx = [[0.0] * n for _ in range(n)]
        self._xy = [0.0] * n
        self._attention = [0.0, 0.0]        # sums of pairs * attention seconds and of pairs^2
        self._fit: tuple[float, Coefficients] | None = None    # (prior, coefficients)

    def add(self, charged: tuple[int, ...], pairs: int, seconds: float, attention_s: float | None = None) -> None:
        x = (*map(float, charged), pairs * self.pair_ratio)
        for i, xi in enumerate(x):
            self._xy[i] = DECAY * self._xy[i] + xi * seconds
            for j, xj in enumerate(x):
                self._xx[i][j] = DECAY * self._xx[i][j] + xi * xj
        self._attention = [DECAY * v for v in self._attention]
        if attention_s is not None:
            self._attention[0] += pairs * attention_s
            self._attention[1] += float(pairs) * pairs
        self._fit = None

    def coefficients(self, prior: float) -> Coefficients:
        if self._fit is None or self._fit[0] != prior:
            timed = self._attention[1] > 0
            coef = self._solve(prior, self._attention[0] / self._attention[1] / self.pair_ratio if timed else None)
            vectors = _non_decreasing(coef[:-1], [self._xx[k][k] for k in range(self.vectors)])
            self._fit = (prior, Coefficients(tuple(vectors), coef[-1] * self.pair_ratio))
        return self._fit[1]

    def _solve(self, prior: float, unit: float | None) -> list[float]:
        """Least squares with two penalties: each coefficient pulled towards the prior in
        proportion to its own data (it only matters before there is some), and each vector past
        the first towards the one before it by `forget` (one never measured is priced as its
        neighbour). The pairs' coefficient is fixed at `unit` where it was timed apart. None below
        zero: the most negative is held at zero and the others refitted, until none is."""
        n, pair = self.vectors + 1, self.vectors
        coef = [0.0] * n
        if unit is not None:
            coef[pair] = unit
        free = [i for i in range(n) if unit is None or i != pair]
        while free:
            at = {i: f for f, i in enumerate(free)}
            a = [[self._xx[i][j] for j in free] for i in free]
            b = [self._xy[i] - (unit * self._xx[i][pair] if unit is not None else 0.0) for i in free]
            for f, i in enumerate(free):
                r = PRIOR_WEIGHT * max(self._xx[i][i], 1e-12)
                a[f][f] += r
                b[f] += r * prior
            for k in range(1, self.vectors):
                if k in at:                 # (a neighbour held at zero pulls towards zero)
                    a[at[k]][at[k]] += self.forget
                    if k - 1 in at:
                        a[at[k - 1]][at[k - 1]] += self.forget
                        a[at[k]][at[k - 1]] -= self.forget
                        a[at[k - 1]][at[k]] -= self.forget
            fit = _linear_solve(a, b) or [prior] * len(free)
            worst = min(range(len(free)), key=fit.__getitem__)
            if fit[worst] >= 0:
                for i, c in zip(free, fit):
                    coef[i] = c
                break
            free.pop(worst)
        return coef


def _non_decreasing(prices: list[float], weights: list[float]) -> list[float]:
    """The closest prices (weighted least squares) where no vector costs less than the one before
    (pool adjacent violators): a row's arithmetic does not get cheaper as a step gets wider, while
    a fit whose slices mostly split alike cannot tell their vectors apart and may price one at
    next to nothing. On a 2-core AMD EPYC (AVX2, 2026-11-28) a fit priced a step's first four
    vectors at 2.78, 0.0, 2.83 and 1.16 ms a token and planned 48 rows with them; in other runs
    (budget 3.5) steps of 48, 56 and 64 rows planned at 127, 121 and 107 ms took 149, 176 and 170,
    each its run's worst gap (4.0-5.3x the stream's TPOT). In one engine (budget 3), six rounds
    each way, the widest steps took up to 1.94x their plan with the prices free and 1.19x with
    them ordered (eight more rounds: 1.16 and 1.26, no stray prices). A pooled run of vectors
    keeps the total its data measured; one never measured (weight ~0) takes its neighbour's
    price."""
    pools: list[tuple[float, float, int]] = []          # (price, weight, vectors)
    for price, weight in zip(prices, weights):
        pool = (price, weight + 1e-30, 1)
        while pools and pools[-1][0] > pool[0]:
            p, w, n = pools.pop()
            pool = ((p * w + pool[0] * pool[1]) / (w + pool[1]), w + pool[1], n + pool[2])
        pools.append(pool)
    return [p for p, _, n in pools for _ in range(n)]


def _linear_solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve a c = b; None when singular. (By LAPACK: the elimination in Python it replaced took
    0.9 ms of each slice step's planning, 2-core AMD EPYC, 2026-11-28.)"""
    try:
        c = np.linalg.solve(np.array(a, dtype=np.float64), np.array(b, dtype=np.float64))
    except np.linalg.LinAlgError:
        return None
    return c.tolist() if np.isfinite(c).all() else None
