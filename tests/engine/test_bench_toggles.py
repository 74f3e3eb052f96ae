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


def test_slices_ttft_ratio_pairs_each_round_default_with_unchunked(monkeypatch):
    """Each round measures the default and the unchunked newcomer first, one after the other, and
    the goal's ratio is the median of the rounds' own: here 1.2, 1.25 and 1.5, where a ratio of
    the medians (4,000 / 3,000 ms) would read 1.33; the rows keep their display order."""
    from types import SimpleNamespace

    from pdchat.bench import toggles

    ttft = {("auto", 3.0): iter([3600.0, 5000.0, 4500.0]), (None, None): iter([3000.0, 4000.0, 3000.0]),
            ("auto", 2.0): iter([9000.0] * 3), (16, None): iter([8000.0] * 3)}
    measured = []

    def stutter(engine, prompt):
        key = (engine.setting["chunk_size"], engine.setting["step_budget"])
        measured.append(key)
        return {"newcomer_ttft_ms": next(ttft[key]), "worst_gap_over_tpot": 3.5}, None

    monkeypatch.setattr(toggles, "stutter", stutter)
    monkeypatch.setattr(toggles, "_restore", lambda engine, base: None)
    engine = SimpleNamespace(config=SimpleNamespace(chunk_size="auto", step_budget=3.0))
    engine.update = lambda chunk_size, step_budget, prefix_cache: setattr(
        engine, "setting", {"chunk_size": chunk_size, "step_budget": None if chunk_size != "auto" else step_budget})
    out = toggles.chunked_prefill(engine, 10, [16, None], [2.0, 3.0], rounds=3)
    assert measured[:4] == [("auto", 3.0), (None, None), ("auto", 2.0), (16, None)]
    assert measured[4:6] == [("auto", 3.0), (None, None)] and len(measured) == 12
    assert [(r["chunk_size"], r["step_budget"]) for r in out["rows"]] == [("auto", 2.0), ("auto", 3.0), (16, None),
                                                                        (None, None)]
    assert out["rows"][1]["newcomer_ttft_ms"] == 4500.0 and out["rows"][3]["newcomer_ttft_ms"] == 3000.0
    assert out["default_ttft_over_unchunked"] == 1.25 and out["met"] is True
