"""`pdchat bench toggles` on a tiny random model: every section measured, the chunked-prefill rows
per step budget and per chunk size, batching per precision, and the goals judged from the rows."""
from __future__ import annotations

from pdchat.bench import run_suite
from pdchat.engine import EngineConfig


def test_quick_toggles_measure_budgets_chunks_and_precisions():
    out = run_suite("toggles", EngineConfig(model="random:tiny", device="cpu", kv_cache_mb=16), quick=True)
    chunked = out["chunked_prefill"]
    default_budget = EngineConfig().step_budget                  # the quick run's one budget: the default
    assert [(r["chunk_size"], r["step_budget"]) for r in chunked["rows"]] == [("auto", default_budget), (16, None),
                                                                               (None, None)]
    assert all(r["newcomer_ttft_ms"] > 0 and r["worst_gap_over_tpot"] > 0 for r in chunked["rows"])
    default, whole = chunked["rows"][0], chunked["rows"][-1]
    assert chunked["default_ttft_over_unchunked"] == default["newcomer_ttft_ms"] / whole["newcomer_ttft_ms"]
    assert chunked["met"] == (default["worst_gap_over_tpot"] <= 4 and chunked["default_ttft_over_unchunked"] <= 1.3)
    batching = out["batching"]
    assert [r["quant"] for r in batching["rows"]] == ["none", "int8", "int4"]
    assert all(r["ratio"] > 0 for r in batching["rows"])
    assert batching["met"] == (batching["rows"][0]["ratio"] >= 6)
