"""`pdchat bench disagg` on a tiny random model: every row measured on the cores it should have,
each hand-off's bytes against the KV formula worked out here, the goal judged from the rows, and
the engine as it was afterwards. Timings are not checked (a tiny model's are noise)."""
from __future__ import annotations

import pytest

from pdchat.bench import disagg, run_suite, toggles
from pdchat.engine import EngineConfig
from pdchat.engine.disaggregation.cores import available_cores, split_cores

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4       # random:tiny: 2 layers, 2 KV heads, head dim 16, fp32


def test_quick_suite_rows_hand_offs_and_goal():
    out = run_suite("disagg", EngineConfig(model="random:tiny", device="cpu", kv_cache_mb=16), quick=True)
    d = out["disaggregation"]
    rows = {r["setup"]: r for r in d["rows"]}
    assert list(rows) == ["colocated, chunked", "colocated, one step", "disaggregated, shm",
                          "disaggregated, slow link", "disaggregated, socket"]
    assert all(r.keys() == d["rows"][0].keys() for r in d["rows"])          # one table
    assert out["inputs"] == disagg.SIZES["quick"] and (d["layers"], d["kv_heads"], d["head_dim"], d["dtype_bytes"]) \
        == (2, 2, 16, 4)
    prefill, decode = split_cores(None)
    for name, r in rows.items():
        assert r["newcomer_ttft_ms"] > 0 and r["worst_gap_over_tpot"] > 0 and r["newcomer_prompt_tokens"] > 100
        if name.startswith("colocated"):
            assert r["cores"] == ",".join(map(str, available_cores()))
            assert r["kv_transfer_bytes"] is r["formula_bytes"] is r["bytes_equal_formula"] is None
        else:
            assert r["cores"] == f"{','.join(map(str, prefill))} | {','.join(map(str, decode))}"
            assert r["kv_transfer_bytes"] == r["formula_bytes"] == BYTES_PER_TOKEN * (r["newcomer_prompt_tokens"] - 1)
            assert r["bytes_equal_formula"] is True and r["kv_transfer_ms"] > 0
    slow = rows["disaggregated, slow link"]
    assert (d["slow_link_gbps"], d["slow_link_ms"]) == (1.0, 10.0)
    assert slow["kv_transfer_ms"] >= 10 + slow["kv_transfer_bytes"] / 1e9 * 1000      # latency + bytes / bandwidth
    shm = rows["disaggregated, shm"]
    assert d["bytes_equal_formula"] is True
    assert d["met"] == (shm["worst_gap_over_tpot"] <= 2)
    lead_ms = rows["colocated, chunked"]["newcomer_ttft_ms"] - (shm["newcomer_ttft_ms"] - shm["kv_transfer_ms"])
    assert d["break_even_gbps_vs_chunked"] == (pytest.approx(shm["kv_transfer_bytes"] / lead_ms * 1000 / 1e9)
                                               if lead_ms > 0 else None)


def test_measure_interleaves_rounds_and_leaves_the_engine_as_it_was(tiny_engine):
    before = tiny_engine.config
    seen = []
    d = disagg.measure(tiny_engine, 40, [disagg.CHUNKED, disagg.SHM], 2, lambda what, frac: seen.append(what))
    assert seen == ["colocated, chunked · round 1/2", "disaggregated, shm · round 1/2",
                    "colocated, chunked · round 2/2", "disaggregated, shm · round 2/2"]
    assert [r["setup"] for r in d["rows"]] == ["colocated, chunked", "disaggregated, shm"]
    # round 2's colocated row, after a worker had pinned the process, ran on every core again
    assert d["rows"][0]["cores"] == ",".join(map(str, available_cores()))
    assert "slow_link_gbps" not in d and d["bytes_equal_formula"] is True
    assert tiny_engine.config == before and tiny_engine.stats().prefill_worker == "off"


def test_interleaved_medians_over_rounds():
    values = iter([{"ms": 3.0, "ok": True, "cores": "0", "bytes": None},
                   {"ms": 10.0, "ok": True, "cores": "0", "bytes": 5},
                   {"ms": 1.0, "ok": False, "cores": "0,1", "bytes": 5},
                   {"ms": 20.0, "ok": True, "cores": "0", "bytes": 5}])
    order = []

    def measure(setting):
        order.append(setting["name"])
        return next(values)

    rows = toggles.interleaved_medians([{"name": "a"}, {"name": "b"}], measure, 2)
    assert order == ["a", "b", "a", "b"]
    # a check holds only if it held every round; a value missing in a round is missing; text: each one seen
    assert rows == [{"name": "a", "ms": 2.0, "ok": False, "cores": "0 / 0,1", "bytes": None},
                    {"name": "b", "ms": 15.0, "ok": True, "cores": "0", "bytes": 5}]
