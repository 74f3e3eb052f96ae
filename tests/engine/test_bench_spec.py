"""`pdchat bench spec` (bench/spec.py), quick, on a tiny random model: a row per method greedy,
and the self-draft again sampled at the chat's default temperature, each with its rates."""
from __future__ import annotations

from pdchat.bench import run_suite
from pdchat.engine.config import EngineConfig, SamplingParams


def test_bench_spec_measures_each_method_greedy_and_the_self_draft_sampled():
    out = run_suite("spec", EngineConfig(model="random:tiny", device="cpu", kv_cache_mb=16), quick=True)
    rows = out["speculative_decoding"]["rows"]
    sampled = f"temperature {SamplingParams().temperature:g}"
    assert [(r["workload"], r["sampling"], r["method"]) for r in rows] == [
        ("grounded", "greedy", "ngram"), ("grounded", "greedy", "self-draft (int8)"),
        ("open-ended", "greedy", "ngram"), ("open-ended", "greedy", "self-draft (int8)"),
        ("grounded", sampled, "self-draft (int8)"), ("open-ended", sampled, "self-draft (int8)")]
    for r in rows:
        assert r["tok_s_off"] > 0 and r["tok_s_on"] > 0
        assert abs(r["speedup"] - r["tok_s_on"] / r["tok_s_off"]) < 1e-6
    drafted = [r for r in rows if r["method"] == "self-draft (int8)"]
    assert all(r["acceptance"] is not None and 0 <= r["acceptance"] <= 1 for r in drafted)
