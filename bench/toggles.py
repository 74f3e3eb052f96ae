"""`pdchat bench toggles`: what each optimization buys, measured on the same engine in one run.

- prefix cache: TTFT of a follow-up turn on a long conversation, on vs off;
- chunked prefill: worst inter-token gap of a running stream while a long prompt arrives, per
  step budget (slices sized by time) and per fixed chunk size, against the stream's own median
  TPOT, and what the newcomer pays in TTFT against no chunking;
- batching: aggregate decode tok/s with N concurrent requests vs 1, per weight precision;
- naive mode: decode ms/token at a long position without vs with the KV cache.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any, Callable

from pdchat.engine.config import EngineConfig, SamplingParams
from pdchat.engine.engine import Engine
from pdchat.engine.metrics import RequestMetrics
from pdchat.engine.stream import FinishEvent, TokenEvent
from pdchat.bench import Progress, filler_text, median, paired_ratio, ratio

# The long prompt that arrives mid-stream (here and in `bench disagg`): at full size 1,728 tokens of
# the default model, its chat template included.
NEWCOMER_WORDS, QUICK_NEWCOMER_WORDS = 1500, 150


def run(config: EngineConfig, *, quick: bool, progress: Progress) -> dict[str, Any]:
    sizes = dict(conversation_words=120, long_prompt_words=QUICK_NEWCOMER_WORDS, batch=4, naive_position=100,
                 repeats=1, budgets=[config.step_budget], chunks=[16, None], rounds=1) if quick else \
        dict(conversation_words=1500, long_prompt_words=NEWCOMER_WORDS, batch=16, naive_position=500, repeats=3,
             budgets=[2.0, 2.5, 3.0, 3.5, 4.0, 6.0], chunks=[16, 32, 64, 128, 256, None], rounds=3)
    engine = Engine(replace(config, telemetry=False), say=lambda m: None)
    try:
        out: dict[str, Any] = {"model": config.model, "device": str(engine.device), "inputs": sizes}
        progress("prefix cache", 0.0)
        out["prefix_cache"] = prefix_cache(engine, sizes["conversation_words"], sizes["repeats"])
        progress("chunked prefill", 0.25)
        out["chunked_prefill"] = chunked_prefill(engine, sizes["long_prompt_words"], sizes["chunks"],
                                                 sizes["budgets"], sizes["rounds"])
        progress("batching", 0.55)
        out["batching"] = batching(engine, sizes["batch"], sizes["rounds"])
        progress("naive vs KV cache", 0.8)
        out["naive"] = naive(engine, sizes["naive_position"])
        progress("done", 1.0)
        return out
    finally:
        engine.close()


def _restore(engine: Engine, config: EngineConfig) -> None:
    engine.update(prefix_cache=config.prefix_cache, chunk_size=config.chunk_size, step_budget=config.step_budget,
                  kv_cache=config.kv_cache)


def prefix_cache(engine: Engine, words: int, repeats: int) -> dict[str, Any]:
    base = engine.config
    turn1 = [{"role": "user", "content": "Here are my notes:\n" + filler_text(words) + "\nWhat is the main topic?"}]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    ttft: dict[bool, list[float]] = {True: [], False: []}
    info: dict[str, int] = {}
    for _ in range(repeats):
        for on in (True, False):
            engine.update(prefix_cache=False)        # empties the prefix table
            engine.update(prefix_cache=on)
            first = engine.submit(turn1, greedy).result()
            turn2 = turn1 + [{"role": "assistant", "content": first.text},
                             {"role": "user", "content": "Say that in one word."}]
            c = engine.submit(turn2, SamplingParams(max_tokens=1, temperature=0)).result()
            ttft[on].append(c.metrics.ttft_ms)
            if on:
                info = {"prompt_tokens": c.metrics.prompt_tokens, "cached_prompt_tokens": c.metrics.cached_prompt_tokens}
    _restore(engine, base)
    on, off = median(ttft[True]), median(ttft[False])
    return {**info, "ttft_on_ms": on, "ttft_off_ms": off, "ratio_on_off": ratio(on, off), "goal": "<= 0.15",
            "met": ratio(on, off) <= 0.15}


def chunked_prefill(engine: Engine, words: int, chunks: list[int | None],
                    budgets: list[float] = (), rounds: int = 1) -> dict[str, Any]:
    """One row per step budget (chunk "auto": slices sized by time), then per fixed chunk size:
    each the median of `rounds` interleaved rounds (interleaved_runs). The goal's TTFT ratio is
    the median of each round's own (paired_ratio): the default and the unchunked run first in each
    round, one after the other, so that a round's ratio compares runs seconds apart, where the
    VM's speed can drift by a quarter between rounds."""
    base = engine.config
    long_prompt = newcomer_prompt(words)
    settings = [dict(chunk_size="auto", step_budget=b) for b in budgets] + \
        [dict(chunk_size=c, step_budget=None) for c in chunks]
    default = next((i for i, s in enumerate(settings) if s["chunk_size"] == base.chunk_size
                    and s["step_budget"] in (None, base.step_budget)), None)
    whole = next((i for i, s in enumerate(settings) if s["chunk_size"] is None), None)
    first = [i for i in (default, whole) if i is not None]
    order = first + [i for i in range(len(settings)) if i not in first]

    def measure(setting: dict[str, Any]) -> dict[str, Any]:
        engine.update(chunk_size=setting["chunk_size"], step_budget=setting["step_budget"] or base.step_budget,
                      prefix_cache=False)   # the newcomer must really prefill
        return stutter(engine, long_prompt)[0]

    measured = dict(zip(order, interleaved_runs([settings[i] for i in order], measure, rounds)))
    _restore(engine, base)
    runs = [measured[i] for i in range(len(settings))]
    rows = [over_rounds(setting, seen) for setting, seen in zip(settings, runs)]
    out: dict[str, Any] = {"rows": rows, "default_chunk_size": base.chunk_size, "default_step_budget": base.step_budget,
                           "goal": "at the default: worst gap <= 4x median TPOT and newcomer TTFT <= 1.3x unchunked"}
    if default is not None and whole is not None:
        out["default_ttft_over_unchunked"] = paired_ratio([r["newcomer_ttft_ms"] for r in runs[default]],
                                                          [r["newcomer_ttft_ms"] for r in runs[whole]])
        out["met"] = rows[default]["worst_gap_over_tpot"] <= 4 and out["default_ttft_over_unchunked"] <= 1.3
    return out


def interleaved_runs(settings: list[dict[str, Any]], measure: Callable[[dict[str, Any]], dict[str, Any]],
                     rounds: int) -> list[list[dict[str, Any]]]:
    """`measure` each setting `rounds` times, the settings interleaved within a round (machine noise
    hits them alike); per setting, what each round measured."""
    runs: list[list[dict[str, Any]]] = [[] for _ in settings]
    for _ in range(rounds):
        for setting, seen in zip(settings, runs):
            seen.append(measure(setting))
    return runs


def interleaved_medians(settings: list[dict[str, Any]], measure: Callable[[dict[str, Any]], dict[str, Any]],
                        rounds: int) -> list[dict[str, Any]]:
    """interleaved_runs, one row per setting (over_rounds)."""
    return [over_rounds(setting, seen) for setting, seen in zip(settings, interleaved_runs(settings, measure, rounds))]


def over_rounds(setting: dict[str, Any], seen: list[dict[str, Any]]) -> dict[str, Any]:
    """The setting and the median of each measured value over the rounds, because a worst gap is
    one step, and one hiccup of the machine makes it."""
    return setting | {key: _over_rounds([r[key] for r in seen]) for key in seen[0]}


def _over_rounds(values: list[Any]) -> Any:
    if any(v is None for v in values):          # not measured in some round (e.g. no hand-off)
        return None
    if all(isinstance(v, bool) for v in values):
        return all(values)                      # a check holds only if it held in every round
    if all(isinstance(v, (int, float)) for v in values):
        return median(values)
    return " / ".join(dict.fromkeys(map(str, values)))     # text (the cores a row ran on): each one seen


def newcomer_prompt(words: int) -> str:
    return "Read this:\n" + filler_text(words, seed=1) + "\nSummarize it."


def stutter(engine: Engine, long_prompt: str) -> tuple[dict[str, Any], RequestMetrics]:
    """A stream decodes; at its 12th token `long_prompt` arrives. The stream's worst gap (and p95)
    from then on against its median TPOT before, the newcomer's TTFT; and the newcomer's own metrics."""
    stream = engine.submit("Tell me a very long story about a lighthouse keeper.",
                           SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
    times: list[float] = []
    arrival = newcomer = done_at = None
    for event in stream:
        if isinstance(event, TokenEvent):
            times.append(event.t)
            if len(times) == 12 and newcomer is None:
                arrival = time.perf_counter()
                newcomer = engine.submit(long_prompt, SamplingParams(max_tokens=1, temperature=0))
            if newcomer is not None and done_at is None and newcomer.done:
                done_at = len(times)
            if done_at is not None and len(times) >= done_at + 4:
                stream.cancel()
        elif isinstance(event, FinishEvent):
            break
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    before = gaps[:10]
    during = [(b - a) * 1000 for a, b in zip(times, times[1:]) if b > arrival]
    tpot = median(before)
    worst = max(during)
    metrics = newcomer.result().metrics
    return {"median_tpot_ms": tpot, "worst_gap_ms": worst, "worst_gap_over_tpot": worst / tpot,
            "p95_gap_over_tpot": statistics.quantiles(during, n=20, method="inclusive")[-1] / tpot if len(during) > 1 else worst / tpot,
            "newcomer_prompt_tokens": metrics.prompt_tokens, "newcomer_ttft_ms": metrics.ttft_ms}, metrics


def batch_point(engine: Engine, count: int, max_tokens: int = 64) -> tuple[float, float]:
    """`count` requests at once: (aggregate decode tok/s, median per-request TPOT ms)."""
    topics = ["a dragon", "the sea", "a robot", "a city", "a forest", "the moon", "a violin", "a train"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [f"Write a story about {topics[i % len(topics)]} (part {i})." for i in range(count)]
    results = engine.generate(prompts, params)
    start = min(r.metrics.ttft_ms for r in results)   # decode phase: from the first token...
    # ...to the last token of the slowest request, on one clock: ttft + decode time.
    end = max(r.metrics.ttft_ms + (r.metrics.decode_ms or 0) for r in results)
    tokens = sum(r.metrics.output_tokens - 1 for r in results)
    return tokens / ((end - start) / 1000), median([r.metrics.tpot_ms for r in results])


def _warm_up(engine: Engine) -> None:
    """The first decode after a weights change captures a GPU's graphs again (seconds): run it
    before measuring a rate."""
    engine.generate(["warm-up"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))


def batching(engine: Engine, n: int, rounds: int) -> dict[str, Any]:
    """One row per weight precision the engine can run (the goal is fp32's): medians of `rounds`
    rounds of 1 and then `n` requests, the ratio the median of each round's own. One stream is
    bound by memory and `n` by arithmetic, and a shared VM can speed up one and slow the other for
    seconds (README, "Two machines in one VM"): a single round read 5.3x where four rounds of the
    same code minutes later read 7.4-8.4x (2026-11-27)."""
    base = engine.config.quant
    rows = []
    for quant in ("none", "int8", "int4"):
        engine.update(quant=quant)
        if engine.config.quant != quant:           # not on this device: said in a notice
            continue
        _warm_up(engine)
        rates: dict[int, list[float]] = {1: [], n: []}
        tpots: dict[int, list[float]] = {1: [], n: []}
        for _ in range(rounds):
            for count in (1, n):
                rate, tpot = batch_point(engine, count)
                rates[count].append(rate)
                tpots[count].append(tpot)
        rows.append({"quant": quant, "decode_tok_s_1": median(rates[1]), f"decode_tok_s_{n}": median(rates[n]),
                     "ratio": paired_ratio(rates[n], rates[1]), "tpot_ms_1": median(tpots[1]),
                     f"tpot_ms_{n}": median(tpots[n])})
    engine.update(quant=base)
    fp32 = rows[0]
    return {"rows": rows, "requests": n, "rounds": rounds, "goal": f">= 6x ({n} requests vs 1, fp32)",
            "met": fp32["ratio"] >= 6}


def naive(engine: Engine, position: int) -> dict[str, Any]:
    base = engine.config
    ids = engine.encode(filler_text(position))[:position]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ms = {}
    for kv in (True, False):
        engine.update(kv_cache=kv, prefix_cache=False)
        _warm_up(engine)                 # batching() may have just switched the weights back
        ms[kv] = engine.submit(ids, params).result().metrics.tpot_ms
    _restore(engine, base)
    return {"position": len(ids), "tpot_kv_cache_ms": ms[True], "tpot_naive_ms": ms[False],
            "ratio_naive_over_kv": ms[False] / ms[True]}
