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


def test_batching_ratio_is_the_median_of_each_rounds_own(monkeypatch):
    """A round's 1 and 16 streams run seconds apart; its ratio is theirs. A ratio of the medians
    would pair one round's single stream with another's sixteen (here 80 / 10 = 8x, where the
    rounds read 6x, 4x and 9x)."""
    from types import SimpleNamespace

    from pdchat.bench import toggles

    rates = {1: iter([10.0, 20.0, 10.0]), 16: iter([60.0, 80.0, 90.0])}
    monkeypatch.setattr(toggles, "batch_point", lambda engine, count: (next(rates[count]), 10.0 * count))
    monkeypatch.setattr(toggles, "_warm_up", lambda engine: None)
    engine = SimpleNamespace(config=SimpleNamespace(quant="none"))
    engine.update = lambda quant: None            # only fp32 here: int8 and int4 are "not on this device"
    out = toggles.batching(engine, 16, rounds=3)
    (row,) = out["rows"]
    assert (row["decode_tok_s_1"], row["decode_tok_s_16"], row["ratio"]) == (10.0, 80.0, 6.0)
    assert (row["tpot_ms_1"], row["tpot_ms_16"], out["rounds"], out["met"]) == (10.0, 160.0, 3, True)
