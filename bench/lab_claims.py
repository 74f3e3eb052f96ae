"""Verdicts for the inference lab: pure arithmetic on measured numbers (fits, ratios, thresholds).

Every check returns a Verdict dict — the claim in words, "confirmed" / "not confirmed" /
"not available", the numbers behind it and the rule applied — so a reader can redo the
arithmetic, and tests can feed synthetic numbers without running a model.
"""
from __future__ import annotations

import math
from statistics import median
from typing import Any

CONFIRMED, NOT_CONFIRMED, UNAVAILABLE = "confirmed", "not confirmed", "not available"

Verdict = dict[str, Any]


def verdict(claim_id: str, claim: str, ok: bool | None, rule: str, **numbers: Any) -> Verdict:
    status = UNAVAILABLE if ok is None else CONFIRMED if ok else NOT_CONFIRMED
    return {"id": claim_id, "claim": claim, "verdict": status, "rule": rule, "numbers": numbers}


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = slope * x + intercept; returns (slope, intercept, R²)."""
    n = len(xs)
    if n < 2 or n != len(ys):
        raise ValueError("a fit needs at least two (x, y) pairs")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs at least two distinct x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    r2 = 1.0 - ss_res / ss_tot if ss_tot else 1.0
    return slope, intercept, r2


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """y at x on the measured polyline (xs ascending); the end segments extend beyond the range."""
    i = next((k for k in range(1, len(xs) - 1) if xs[k] >= x), len(xs) - 1)
    (x0, y0), (x1, y1) = (xs[i - 1], ys[i - 1]), (xs[i], ys[i])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):                       # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def pearson(xs: list[float], ys: list[float]) -> float | None:
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    if not sx or not sy:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sx * sy)


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Rank correlation: +1 when y rises with x all the way, -1 when it always falls."""
    return pearson(_ranks(xs), _ranks(ys))


# ---- the claims ------------------------------------------------------------------------------
R2_LINEAR = 0.95


def prefill_linear(lengths: list[int], prefill_ms: list[float]) -> Verdict:
    slope, intercept, r2 = linear_fit([float(x) for x in lengths], prefill_ms)
    return verdict("prefill_linear", "Prefill time grows about linearly with prompt length",
                   r2 >= R2_LINEAR and slope > 0,
                   f"a straight line explains at least {R2_LINEAR:.0%} of the spread and time rises with length",
                   ms_per_token=slope, intercept_ms=intercept, r2=r2, points=len(lengths),
                   tokens_per_s=1000 / slope if slope > 0 else None)


# "Slowly": at most +50% over the range; a fall beyond 10% would mean noise swamped the curve.
DECODE_GROWTH_RANGE = (-0.1, 0.5)


def decode_slow_growth(positions: list[int], tpot_ms: list[float]) -> Verdict:
    """Per-token decode time over a long generation: rises with position, but slowly."""
    slope, intercept, r2 = linear_fit([float(p) for p in positions], tpot_ms)
    start, end = min(positions), max(positions)
    at_start, at_end = slope * start + intercept, slope * end + intercept
    growth = (at_end - at_start) / at_start if at_start > 0 else None
    lo, hi = DECODE_GROWTH_RANGE
    ok = growth is not None and lo <= growth <= hi
    return verdict("decode_slow_growth", "Decode time per token grows slowly with position", ok,
                   f"the fitted line changes by {lo:+.0%} to {hi:+.0%} from the first position to the last",
                   ms_per_1000_positions=slope * 1000, tpot_at_start_ms=at_start, tpot_at_end_ms=at_end,
                   growth=growth, first_position=start, last_position=end, r2=r2)


PREFILL_DECODE_RANGE = (5.0, 10.0)


def prefill_vs_decode(prefill_1000_ms: float, tpot_ms: float) -> Verdict:
    """How many decode tokens a 1,000-token prefill costs; the explainers say 5-10."""
    tokens = prefill_1000_ms / tpot_ms
    lo, hi = PREFILL_DECODE_RANGE
    return verdict("prefill_vs_decode", "A 1,000-token prompt prefills in the time of 5-10 decode tokens",
                   lo <= tokens <= hi, f"a 1,000-token prefill takes as long as {lo:g} to {hi:g} decode tokens",
                   prefill_1000_ms=prefill_1000_ms, tpot_ms=tpot_ms, decode_tokens_equivalent=tokens)


INT8_EDGE = 1.25


def int8_memory_bound(decode_speedup: float | None, prefill_speedup: float | None, reason: str = "") -> Verdict:
    """Memory-bound decode gains from 4x fewer weight bytes; compute-bound prefill barely does."""
    claim = "Decode is memory-bound: int8 weights speed decode much more than prefill"
    rule = f"int8 makes decode faster, and decode gains at least {INT8_EDGE:g}× as much as prefill"
    if decode_speedup is None or prefill_speedup is None:
        return verdict("int8_memory_bound", claim, None, rule, reason=reason or "int8 unavailable here")
    edge = decode_speedup / prefill_speedup
    return verdict("int8_memory_bound", claim, decode_speedup > 1 and edge >= INT8_EDGE, rule,
                   decode_speedup=decode_speedup, prefill_speedup=prefill_speedup, decode_edge=edge)


def kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, *, engine_bytes_per_token: int,
             tensor_bytes_per_slot: float, blocks_used: int, block_size: int, bytes_used: int,
             tokens_held: int) -> Verdict:
    """2 x layers x kv_heads x head_dim x bytes, against the engine's figure, the cache tensors'
    real size per slot, and the pool's usage while a request holds `tokens_held` tokens."""
    formula = 2 * layers * kv_heads * head_dim * dtype_bytes
    blocks_needed = -(-tokens_held // block_size)
    ok = (engine_bytes_per_token == formula and tensor_bytes_per_slot == formula
          and bytes_used == blocks_used * block_size * formula
          and blocks_needed <= blocks_used <= blocks_needed + 1)   # +1: the slot for the next token
    return verdict("kv_bytes", "KV bytes per token = 2 x layers x kv_heads x head_dim x bytes", ok,
                   "the formula, the engine's figure and the cache tensors' bytes per slot agree; the pool "
                   "uses just the blocks the tokens fill (+1 for the next token), at that many bytes a slot",
                   layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
                   formula_bytes_per_token=formula, engine_bytes_per_token=engine_bytes_per_token,
                   tensor_bytes_per_slot=tensor_bytes_per_slot, tokens_held=tokens_held,
                   blocks_used=blocks_used, blocks_needed=blocks_needed, block_size=block_size,
                   bytes_used=bytes_used)


PREFIX_MAX_RATIO = 0.25


def prefix_cache(ttft_on_ms: float, ttft_off_ms: float, prompt_tokens: int, cached_prompt_tokens: int) -> Verdict:
    r = ttft_on_ms / ttft_off_ms
    return verdict("prefix_cache", "Prefix caching removes the prefill of a repeated prefix",
                   r <= PREFIX_MAX_RATIO and cached_prompt_tokens > 0,
                   f"the TTFT with the cache is at most {PREFIX_MAX_RATIO:g}× the TTFT without",
                   ttft_on_ms=ttft_on_ms, ttft_off_ms=ttft_off_ms, ttft_ratio=r, prompt_tokens=prompt_tokens,
                   cached_prompt_tokens=cached_prompt_tokens, cached_fraction=cached_prompt_tokens / prompt_tokens)


BATCH_MIN_GAIN = 2.0


def batching(sizes: list[int], tok_s: list[float], tpot_ms: list[float]) -> Verdict:
    """Aggregate throughput rises with the batch while each user's TPOT rises too."""
    gain = tok_s[-1] / tok_s[0]
    tpot_rise = tpot_ms[-1] / tpot_ms[0]
    trend = spearman([float(s) for s in sizes], tok_s)
    return verdict("batching", "Batching raises aggregate throughput while per-user TPOT rises",
                   gain >= BATCH_MIN_GAIN and tpot_rise > 1 and (trend or 0) > 0,
                   f"the largest batch gets at least {BATCH_MIN_GAIN:g}× the tokens a second of batch "
                   f"{sizes[0]}, throughput rises with the batch, and each user's TPOT is higher at the largest",
                   largest_batch=sizes[-1], throughput_gain=gain, tpot_rise=tpot_rise, throughput_trend=trend)


def chunked_prefill(chunks: list[int], newcomer_ttft_ms: list[float], stall_over_tpot: list[float]) -> Verdict:
    """Smaller chunks: the newcomer waits longer, the running stream stalls less.

    `chunks` gives "off" as the newcomer's prompt length (one step holds the whole prompt)."""
    ttft_trend = spearman([float(c) for c in chunks], newcomer_ttft_ms)
    stall_trend = spearman([float(c) for c in chunks], stall_over_tpot)
    ok = ttft_trend is not None and stall_trend is not None and ttft_trend < 0 and stall_trend > 0
    return verdict("chunked_prefill", "Chunked prefill trades the newcomer's TTFT for smoother TPOT of others", ok,
                   "as chunks grow, the newcomer's TTFT falls and the others' worst stall (in TPOTs) rises",
                   ttft_trend=ttft_trend, stall_trend=stall_trend,
                   smallest_chunk_stall=stall_over_tpot[0], largest_chunk_stall=stall_over_tpot[-1],
                   smallest_chunk_ttft_ms=newcomer_ttft_ms[0], largest_chunk_ttft_ms=newcomer_ttft_ms[-1])


DISAGG_GAP_MAX = 2.0       # a stream's worst gap, in its TPOTs, with no prefill in its way
DISAGG_TTFT_SHARE = 0.5    # of a slower link's extra hand-off time that must show in the TTFT


def break_even_gbps(transfer_bytes: int | None, ttft_ms: float | None, transfer_ms: float | None,
                    colocated_ttft_ms: float | None) -> float | None:
    """The link speed (GB/s) at which the K/V hand-off alone would use up a disaggregated
    newcomer's TTFT lead over colocated serving; slower links make it wait longer than colocated.
    None where there is no lead to use up (or nothing was measured)."""
    if None in (transfer_bytes, ttft_ms, transfer_ms, colocated_ttft_ms):
        return None
    lead_ms = colocated_ttft_ms - (ttft_ms - transfer_ms)       # against the TTFT without the hand-off
    return transfer_bytes / (lead_ms / 1000) / 1e9 if lead_ms > 0 else None


def disaggregation(*, colocated_gap: float | None, disaggregated_gap: float | None, colocated_ttft_ms: float | None,
                   disaggregated_ttft_ms: float | None, transfer_ms: float | None, transfer_bytes: int | None,
                   slow_ttft_ms: float | None, slow_transfer_ms: float | None, slow_link_gbps: float | None,
                   slow_link_ms: float | None, reason: str = "") -> Verdict:
    """A prefill in its own process no longer stalls a decoding stream (its worst gap, in TPOTs,
    against colocated chunked prefill), and the newcomer's TTFT pays the K/V hand-off instead:
    over a slower link its TTFT rises with the hand-off's time. Without hand-offs (no prefill
    worker: `reason`) there is no verdict."""
    claim = "Disaggregation removes prefill interference from decode at the cost of KV transfer in TTFT"
    rule = (f"disaggregated, the stream's worst gap is at most {DISAGG_GAP_MAX:g}× its TPOT and below the "
            f"colocated one's (chunked prefill), and over a slower link the newcomer's TTFT rises by at least "
            f"{DISAGG_TTFT_SHARE:.0%} of the extra hand-off time")
    if transfer_ms is None or slow_transfer_ms is None:
        return verdict("disaggregation", claim, None, rule, reason=reason or "no K/V hand-off was measured")
    ttft_rise, transfer_rise = slow_ttft_ms - disaggregated_ttft_ms, slow_transfer_ms - transfer_ms
    ok = (disaggregated_gap <= DISAGG_GAP_MAX and disaggregated_gap < colocated_gap and transfer_rise > 0
          and ttft_rise >= DISAGG_TTFT_SHARE * transfer_rise)
    return verdict("disaggregation", claim, ok, rule,
                   colocated_gap_over_tpot=colocated_gap, disaggregated_gap_over_tpot=disaggregated_gap,
                   colocated_ttft_ms=colocated_ttft_ms, disaggregated_ttft_ms=disaggregated_ttft_ms,
                   transfer_ms=transfer_ms, transfer_bytes=transfer_bytes, slow_link_gbps=slow_link_gbps,
                   slow_link_ms=slow_link_ms, slow_transfer_ms=slow_transfer_ms, ttft_rise_ms=ttft_rise,
                   transfer_rise_ms=transfer_rise,
                   break_even_gbps=break_even_gbps(transfer_bytes, disaggregated_ttft_ms, transfer_ms,
                                                   colocated_ttft_ms))


def spec_vs_acceptance(acceptance: list[float], speedup: list[float]) -> Verdict:
    """Speculative decoding pays in proportion to how many drafted tokens the target accepts."""
    claim = "Speculative decoding's speed-up grows with the acceptance rate"
    rule = "over the measured points the speed-up rises with acceptance, and the best is above 1×"
    if len(acceptance) < 2:
        return verdict("spec", claim, None, rule, reason="fewer than two measured points")
    trend = spearman(acceptance, speedup)
    best = max(speedup)
    return verdict("spec", claim, (trend or 0) > 0 and best > 1, rule,
                   trend=trend, best_speedup=best, points=len(acceptance))


# ---- how far repeated rounds agree ------------------------------------------------------------
SPREAD_MAX = 0.25      # rounds further apart than this, relative to their median, make a verdict noisy


def rounds_spread(rounds: list[list[float]]) -> float | None:
    """How much repeated rounds of the same measurement disagree: (max - min) / median per point,
    the median of that over the points (one jittery point is not a noisy curve); None for one round."""
    spreads = [(max(r) - min(r)) / median(r) for r in rounds if len(r) > 1 and median(r) > 0]
    return median(spreads) if spreads else None


def mark_disagreeing(claims: list[Verdict], spread: dict[str, float | None]) -> list[Verdict]:
    """Each verdict whose repeated rounds (spread, by claim id) disagree beyond SPREAD_MAX says so,
    after any other noise note."""
    for claim in claims:
        s = spread.get(claim["id"])
        if s is not None and s > SPREAD_MAX:
            note = f"repeated rounds disagree by {s:.0%}"
            claim["noisy"] = f"{claim['noisy']}; {note}" if claim.get("noisy") else f"noisy: {note}"
    return claims
