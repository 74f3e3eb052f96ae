"""The inference lab: the verdict arithmetic on synthetic numbers, and one tiny run of every
experiment on random:tiny that checks structure and consistency (never timings)."""
from __future__ import annotations

import csv
import json

import pytest

from pdchat.engine import EngineConfig
from pdchat.bench import lab as bench_lab, lab_claims as lc, lab_files
from pdchat.bench import median, run_suite
from pdchat.bench.svg_plot import nice_ticks, svg

CLAIM_IDS = ["prefill_linear", "decode_slow_growth", "prefill_vs_decode", "int8_memory_bound", "kv_bytes",
             "prefix_cache", "batching", "chunked_prefill", "disaggregation", "spec"]


@pytest.fixture(autouse=True)
def _data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCHAT_DATA_DIR", str(tmp_path / "data"))


# ---- fits and correlations ---------------------------------------------------------------------
def test_linear_fit_recovers_an_exact_line():
    slope, intercept, r2 = lc.linear_fit([1, 2, 3, 4], [5, 7, 9, 11])
    assert (slope, intercept, r2) == pytest.approx((2, 3, 1))


def test_linear_fit_r2_by_hand():
    # y = [1, 3, 2]: slope 0.5, intercept 1.5, residuals -0.5, 1, -0.5 -> ss_res 1.5, ss_tot 2
    slope, intercept, r2 = lc.linear_fit([0, 1, 2], [1, 3, 2])
    assert (slope, intercept, r2) == pytest.approx((0.5, 1.5, 0.25))


def test_linear_fit_needs_two_distinct_x():
    with pytest.raises(ValueError):
        lc.linear_fit([1, 1], [2, 3])


def test_interpolate_reads_the_polyline():
    xs, ys = [16.0, 512.0, 1024.0, 2048.0], [100.0, 1000.0, 2800.0, 6000.0]
    assert lc.interpolate(xs, ys, 1000.0) == pytest.approx(1000 + 1800 * 488 / 512)
    assert lc.interpolate(xs, ys, 512.0) == 1000.0
    assert lc.interpolate(xs, ys, 4096.0) == pytest.approx(6000 + 3200 * 2)      # extends the last segment
    assert lc.interpolate([1.0, 2.0], [1.0, 3.0], 0.0) == pytest.approx(-1.0)


def test_spearman_is_about_order_not_shape():
    assert lc.spearman([1, 2, 3, 4], [1, 10, 100, 1000]) == pytest.approx(1)
    assert lc.spearman([1, 2, 3], [9, 5, 1]) == pytest.approx(-1)
    assert lc.spearman([1, 2, 3], [4, 4, 4]) is None
    assert lc.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


# ---- the claims on synthetic numbers ---------------------------------------------------------------
def test_prefill_linear():
    v = lc.prefill_linear([100, 200, 400], [21, 41, 81])
    assert v["verdict"] == lc.CONFIRMED
    assert v["numbers"]["ms_per_token"] == pytest.approx(0.2)
    assert v["numbers"]["tokens_per_s"] == pytest.approx(5000)
    quadratic = lc.prefill_linear([1, 2, 3, 4, 5, 6], [1, 4, 9, 16, 25, 1000])
    assert quadratic["verdict"] == lc.NOT_CONFIRMED


def test_decode_slow_growth_thresholds():
    slow = lc.decode_slow_growth([100, 500], [10.0, 11.0])
    assert slow["verdict"] == lc.CONFIRMED and slow["numbers"]["growth"] == pytest.approx(0.1)
    assert slow["numbers"]["ms_per_1000_positions"] == pytest.approx(2.5)
    assert lc.decode_slow_growth([100, 500], [10.0, 16.0])["verdict"] == lc.NOT_CONFIRMED
    assert lc.decode_slow_growth([100, 500], [10.0, 8.0])["verdict"] == lc.NOT_CONFIRMED


def test_prefill_vs_decode_ratio():
    v = lc.prefill_vs_decode(700.0, 100.0)
    assert v["numbers"]["decode_tokens_equivalent"] == pytest.approx(7)
    assert v["verdict"] == lc.CONFIRMED
    assert lc.prefill_vs_decode(2000.0, 70.0)["verdict"] == lc.NOT_CONFIRMED


def test_int8_memory_bound():
    v = lc.int8_memory_bound(1.9, 1.1)
    assert v["verdict"] == lc.CONFIRMED and v["numbers"]["decode_edge"] == pytest.approx(1.9 / 1.1)
    assert lc.int8_memory_bound(1.3, 1.2)["verdict"] == lc.NOT_CONFIRMED
    assert lc.int8_memory_bound(None, None, "no kernel")["verdict"] == lc.UNAVAILABLE


def test_kv_bytes_formula_and_pool():
    ok = dict(engine_bytes_per_token=46080, tensor_bytes_per_slot=46080.0, blocks_used=7, block_size=16,
              bytes_used=7 * 16 * 46080, tokens_held=100)
    v = lc.kv_bytes(30, 3, 64, 4, **ok)
    assert v["numbers"]["formula_bytes_per_token"] == 46080 and v["numbers"]["blocks_needed"] == 7
    assert v["verdict"] == lc.CONFIRMED
    assert lc.kv_bytes(30, 3, 64, 2, **ok)["verdict"] == lc.NOT_CONFIRMED          # bf16 formula differs
    assert lc.kv_bytes(30, 3, 64, 4, **{**ok, "blocks_used": 9, "bytes_used": 9 * 16 * 46080})["verdict"] \
        == lc.NOT_CONFIRMED                                                          # more blocks than needed


def test_prefix_cache_ratio():
    v = lc.prefix_cache(100.0, 1000.0, 1000, 960)
    assert v["numbers"]["ttft_ratio"] == pytest.approx(0.1) and v["numbers"]["cached_fraction"] == 0.96
    assert v["verdict"] == lc.CONFIRMED
    assert lc.prefix_cache(500.0, 1000.0, 1000, 960)["verdict"] == lc.NOT_CONFIRMED
    assert lc.prefix_cache(100.0, 1000.0, 1000, 0)["verdict"] == lc.NOT_CONFIRMED


def test_batching_needs_more_throughput_and_higher_tpot():
    v = lc.batching([1, 4, 16], [10.0, 35.0, 90.0], [70.0, 80.0, 150.0])
    assert v["verdict"] == lc.CONFIRMED
    assert v["numbers"]["throughput_gain"] == pytest.approx(9) and v["numbers"]["tpot_rise"] == pytest.approx(150 / 70)
    assert lc.batching([1, 4, 16], [10.0, 12.0, 15.0], [70.0, 80.0, 150.0])["verdict"] == lc.NOT_CONFIRMED


def test_chunked_prefill_trade_off_directions():
    v = lc.chunked_prefill([32, 64, 128, 1700], [10000, 8000, 6000, 3000], [3.7, 6.0, 9.0, 50.0])
    assert v["verdict"] == lc.CONFIRMED
    assert v["numbers"]["ttft_trend"] == pytest.approx(-1) and v["numbers"]["stall_trend"] == pytest.approx(1)
    assert lc.chunked_prefill([32, 64, 128], [3000, 6000, 9000], [3.7, 6.0, 9.0])["verdict"] == lc.NOT_CONFIRMED


DISAGG = dict(colocated_gap=3.3, disaggregated_gap=1.2, colocated_ttft_ms=6500.0, disaggregated_ttft_ms=4500.0,
              transfer_ms=20.0, transfer_bytes=80_000_000, slow_ttft_ms=5300.0, slow_transfer_ms=810.0,
              slow_link_gbps=0.1, slow_link_ms=10.0)


def test_disaggregation_removes_the_stall_and_pays_the_hand_off_in_ttft():
    v = lc.disaggregation(**DISAGG)
    assert v["verdict"] == lc.CONFIRMED
    n = v["numbers"]
    assert (n["ttft_rise_ms"], n["transfer_rise_ms"]) == pytest.approx((800, 790))
    # the TTFT without the hand-off is 4,480 ms, 2,020 ms under colocated: 80 MB in 2.02 s
    assert n["break_even_gbps"] == pytest.approx(0.08 / 2.02)


@pytest.mark.parametrize("change", [
    dict(disaggregated_gap=2.1),                        # still stalls beyond 2 TPOTs
    dict(colocated_gap=1.1),                            # colocated stalled no more: nothing removed
    dict(slow_ttft_ms=4800.0),                          # 300 ms of 790 more hand-off reached the TTFT
    dict(slow_transfer_ms=20.0, slow_ttft_ms=4600.0),   # the slower link took no longer
])
def test_disaggregation_not_confirmed(change):
    assert lc.disaggregation(**{**DISAGG, **change})["verdict"] == lc.NOT_CONFIRMED


def test_disaggregation_without_a_hand_off_is_not_available():
    v = lc.disaggregation(**{**DISAGG, "transfer_ms": None, "transfer_bytes": None})
    assert v["verdict"] == lc.UNAVAILABLE and v["numbers"] == {"reason": "no K/V hand-off was measured"}


def test_no_prefill_worker_no_disaggregation_verdict():
    v = bench_lab._disaggregation_claim({"available": False, "reason": "the prefill worker did not start"})
    assert v["verdict"] == lc.UNAVAILABLE and v["numbers"] == {"reason": "the prefill worker did not start"}


def test_break_even_link_speed():
    assert lc.break_even_gbps(2_000_000_000, 1500.0, 500.0, 3000.0) == pytest.approx(1.0)    # 2 GB in 2 s
    assert lc.break_even_gbps(2_000_000_000, 3600.0, 500.0, 3000.0) is None     # slower even without it
    assert lc.break_even_gbps(None, 1500.0, 500.0, 3000.0) is None


def test_spec_speedup_follows_acceptance():
    assert lc.spec_vs_acceptance([0.16, 0.64, 0.83, 0.98], [1.5, 1.3, 1.1, 0.9])["verdict"] == lc.NOT_CONFIRMED
    v = lc.spec_vs_acceptance([0.1, 0.5, 0.9], [0.9, 1.4, 2.5])
    assert v["verdict"] == lc.CONFIRMED and v["numbers"]["best_speedup"] == 2.5
    assert lc.spec_vs_acceptance([0.5], [1.4])["verdict"] == lc.UNAVAILABLE


# ---- noise from repeated rounds, and the time left --------------------------------------------------
def test_rounds_spread_is_the_typical_disagreement_between_rounds():
    # per point (max - min) / median: 0.2, 0.5, 0.0 -> their median 0.2; single rounds do not count
    assert lc.rounds_spread([[90.0, 100.0, 110.0], [80.0, 100.0, 130.0], [50.0, 50.0], [7.0]]) == pytest.approx(0.2)
    assert lc.rounds_spread([[7.0], [9.0]]) is None and lc.rounds_spread([]) is None


def test_only_verdicts_whose_rounds_disagree_are_marked_noisy():
    busy = "noisy: the machine was busy (other processes used 45% of it)"
    claims = [{"id": "prefill_linear"}, {"id": "int8_memory_bound", "noisy": busy}, {"id": "kv_bytes"},
              {"id": "prefix_cache"}]
    spread = {"prefill_linear": 0.4, "int8_memory_bound": 0.3, "kv_bytes": lc.SPREAD_MAX, "prefix_cache": None}
    marked = {c["id"]: c.get("noisy") for c in lc.mark_disagreeing(claims, spread)}
    assert marked == {"prefill_linear": "noisy: repeated rounds disagree by 40%",
                      "int8_memory_bound": busy + "; repeated rounds disagree by 30%",
                      "kv_bytes": None, "prefix_cache": None}


def test_spreads_come_from_the_prefill_and_int8_rounds():
    exp = {"prefill": {"raw_ms": [[100.0, 150.0, 200.0], [400.0, 400.0, 400.0]]},
           "int8": {"rounds_ms": {"prefill_fp": [10.0, 11.0], "tpot_fp": [20.0, 20.0]}}}
    spread = bench_lab.spreads(exp)
    assert spread["prefill_linear"] == spread["prefill_vs_decode"] == pytest.approx(1 / 3)   # median of 2/3, 0
    assert spread["int8_memory_bound"] == pytest.approx((1 / 10.5) / 2)
    assert bench_lab.spreads({**exp, "int8": {"available": False}})["int8_memory_bound"] is None


# ---- plot and files ---------------------------------------------------------------------------------
def test_nice_ticks_cover_the_range_with_round_steps():
    ticks = nice_ticks(0, 4096)
    assert ticks == [0, 1000, 2000, 3000, 4000, 5000]
    assert nice_ticks(0, 0.37) == pytest.approx([0, 0.1, 0.2, 0.3, 0.4])


def _curve(cid: str, kind: str = "line") -> dict:
    return {"id": cid, "title": f"{cid} <t>", "x_label": "x", "y_label": "ms", "x": [1, 2, 4], "y": [2.0, 4.0, 8.0],
            "role": "prefill", "kind": kind, "fit": {"slope": 2.0, "intercept": 0.0}}


def test_svg_has_one_panel_per_curve_and_escapes_text():
    doc = svg([_curve("a"), _curve("b", "scatter")], title="lab", subtitle="m & d")
    assert doc.startswith("<svg") and doc.rstrip().endswith("</svg>")
    assert doc.count('class="card"') == 2 and doc.count("<polyline") == 1     # the scatter has no line
    assert "a &lt;t&gt;" in doc and "m &amp; d" in doc


BARS = {"id": "d", "title": "bars", "x_label": "setup", "y_label": "TTFT, ms", "x": ["a & b", "c"], "y": [400.0, 100.0],
        "role": "prefill", "kind": "bars", "part": [100.0, 0.0], "part_role": "kv", "part_label": "hand-off",
        "notes": ["stall 1.1×", "stall 9×"]}


def test_bars_are_drawn_to_scale_with_their_part_names_and_notes():
    doc = svg([BARS], title="lab")
    # ticks 0..400 over the panel's 272 px from x = 22: 0.68 px per ms; rows of 75 px from y = 82
    assert '<rect x="22" y="96.0" width="272.0" height="12.0" fill="#b45309"/>' in doc
    assert '<rect x="226.0" y="96.0" width="68.0" height="12.0" fill="#7e22ce"/>' in doc      # its last 100 ms
    assert '<rect x="22" y="171.0" width="68.0" height="12.0" fill="#b45309"/>' in doc
    assert doc.count('fill="#7e22ce"') == 2                                  # one part, and the legend
    assert ">a &amp; b</text>" in doc and ">stall 9×</text>" in doc and ">hand-off</text>" in doc
    assert "<polyline" not in doc and "<circle" not in doc


def test_bars_in_the_terminal():
    from pdchat.chatapp.reporting.lab_plot import chart
    from pdchat.chatapp.reporting.lab_report import curve_text
    lines = chart(BARS, width=22)
    # 22 columns less the note's 10 and 2: 10 for the longest bar, its last quarter the part
    assert lines == ["bars (TTFT, ms)", "a & b: 400", "┤████████▒▒ stall 1.1×", "c: 100",
                     "┤██ stall 9×", "0 … 400   ▒ hand-off"]
    assert "┤" not in curve_text(BARS, 22).plain.splitlines()[1]        # a name line gets no axis


def test_scatter_labels_stay_inside_their_panel():
    doc = svg([{**_curve("s", "scatter"), "labels": ["low & left", "mid", "high right"]}], title="lab")
    assert 'text-anchor="start">low &amp; left</text>' in doc and 'text-anchor="start">mid</text>' in doc
    assert 'text-anchor="end">high right</text>' in doc          # at the right edge: ends at its point


def test_save_and_last_run_round_trip():
    result = {"suite": "lab", "model": "m", "curves": [_curve("prefill")], "claims": [], "machine": {"date": "d"}}
    files = lab_files.save(result)
    with open(files["csv"], encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["curve", "x_label", "x", "y_label", "y"] and len(rows) == 4
    assert rows[3] == ["prefill", "x", "4", "ms", "8.0"]
    last = lab_files.last_run()
    assert last["model"] == "m" and last["files"] == files


# ---- one tiny run of every experiment -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    import os
    os.environ["PDCHAT_DATA_DIR"] = str(tmp_path_factory.mktemp("lab-data"))
    try:
        steps = []
        result = run_suite("lab", EngineConfig(model="random:tiny"), quick=True,
                           progress=lambda what, frac: steps.append((frac, what)))
    finally:
        del os.environ["PDCHAT_DATA_DIR"]
    return result, steps


def test_tiny_run_structure(tiny_run):
    result, progress = tiny_run
    steps = [frac for frac, _ in progress]
    assert result["suite"] == "lab" and result["inputs"] == bench_lab.SIZES["quick"]
    assert [c["id"] for c in result["claims"]] == CLAIM_IDS
    assert {c["verdict"] for c in result["claims"]} <= {lc.CONFIRMED, lc.NOT_CONFIRMED, lc.UNAVAILABLE}
    assert steps == sorted(steps) and steps[-1] == 1.0
    for c in result["curves"]:
        assert len(c["x"]) == len(c["y"]) > 0
    for path in ("json", "csv", "svg"):
        with open(result["files"][path], encoding="utf-8") as f:
            assert f.read()
    json.dumps(result)                         # machine-readable as it stands


def test_tiny_run_numbers_are_consistent(tiny_run):
    result, _ = tiny_run
    exp = result["experiments"]
    pre = exp["prefill"]
    assert pre["lengths"] == bench_lab.SIZES["quick"]["lengths"]
    assert pre["prefill_ms"] == [median(r) for r in pre["raw_ms"]]
    assert all(len(r) == bench_lab.SIZES["quick"]["repeats"] for r in pre["raw_ms"])
    claims = {c["id"]: c for c in result["claims"]}
    # The verdicts follow from the measured numbers, recomputed here with plain arithmetic (not
    # with the lab's own code): the prefix cache and prefill-vs-decode claims, and the batching gain.
    pc = claims["prefix_cache"]
    ratio = exp["prefix_cache"]["ttft_on_ms"] / exp["prefix_cache"]["ttft_off_ms"]
    assert pc["numbers"]["ttft_ratio"] == pytest.approx(ratio)
    assert pc["verdict"] == (lc.CONFIRMED if ratio <= lc.PREFIX_MAX_RATIO else lc.NOT_CONFIRMED)
    lengths, ms = pre["lengths"], pre["prefill_ms"]
    i = next(i for i in range(1, len(lengths)) if lengths[i] >= 1000 or i == len(lengths) - 1)
    at_1000 = ms[i - 1] + (ms[i] - ms[i - 1]) * (1000 - lengths[i - 1]) / (lengths[i] - lengths[i - 1])
    pvd = claims["prefill_vs_decode"]["numbers"]
    assert pvd["prefill_1000_ms"] == pytest.approx(at_1000)
    assert pvd["decode_tokens_equivalent"] == pytest.approx(at_1000 / exp["decode"]["median_tpot_ms"])
    rows = exp["batching"]["rows"]
    assert claims["batching"]["numbers"]["throughput_gain"] == pytest.approx(
        rows[-1]["decode_tok_s"] / rows[0]["decode_tok_s"])
    dec = exp["decode"]
    assert len(dec["itl_ms"]) == bench_lab.SIZES["quick"]["decode_tokens"]
    assert len(dec["positions"]) == len(dec["itl_ms"]) // dec["bin"]
    # The KV arithmetic is exact, whatever the machine.
    assert claims["kv_bytes"]["verdict"] == lc.CONFIRMED
    assert claims["kv_bytes"]["numbers"]["formula_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert [r["batch"] for r in exp["batching"]["rows"]] == bench_lab.SIZES["quick"]["batch_sizes"]
    assert [r["chunk_size"] for r in exp["chunked_prefill"]["rows"]] == bench_lab.SIZES["quick"]["chunks"]
    assert exp["prefix_cache"]["cached_prompt_tokens"] > 0


def test_tiny_run_disaggregation(tiny_run):
    result, _ = tiny_run
    d = result["experiments"]["disaggregation"]
    rows = {r["setup"]: r for r in d["rows"]}
    assert list(rows) == ["colocated, chunked", "colocated, one step", "disaggregated, shm", "disaggregated, slow link"]
    chunked, shm, slow = rows["colocated, chunked"], rows["disaggregated, shm"], rows["disaggregated, slow link"]
    for r in (shm, slow):        # 2 x 2 layers x 2 KV heads x 16 x 4 bytes, every prompt token but the last
        assert r["kv_transfer_bytes"] == 2 * 2 * 2 * 16 * 4 * (r["newcomer_prompt_tokens"] - 1)
        assert r["bytes_equal_formula"]
    assert (d["slow_link_gbps"], d["slow_link_ms"]) == (bench_lab.SLOW_LINK_GBPS, 10.0)
    assert slow["kv_transfer_ms"] >= 10 + slow["kv_transfer_bytes"] / (bench_lab.SLOW_LINK_GBPS * 1e9) * 1000
    # The verdict follows from the rows, recomputed here by hand.
    claim = {c["id"]: c for c in result["claims"]}["disaggregation"]
    ttft_rise = slow["newcomer_ttft_ms"] - shm["newcomer_ttft_ms"]
    transfer_rise = slow["kv_transfer_ms"] - shm["kv_transfer_ms"]
    assert claim["numbers"]["ttft_rise_ms"] == pytest.approx(ttft_rise)
    ok = (shm["worst_gap_over_tpot"] <= 2 and shm["worst_gap_over_tpot"] < chunked["worst_gap_over_tpot"]
          and transfer_rise > 0 and ttft_rise >= 0.5 * transfer_rise)
    assert claim["verdict"] == (lc.CONFIRMED if ok else lc.NOT_CONFIRMED)
    curve = next(c for c in result["curves"] if c["id"] == "disagg")
    assert curve["kind"] == "bars" and curve["x"] == list(rows)
    assert curve["y"] == [r["newcomer_ttft_ms"] for r in rows.values()]
    assert curve["part"] == [0.0, 0.0, shm["kv_transfer_ms"], slow["kv_transfer_ms"]]


def test_cli_json_prints_only_the_result(capsys, tmp_path):
    from pdchat.chatapp.cli.main import main
    code = main(["bench", "lab", "--quick", "--json", "--model", "random:tiny"])
    out, err = capsys.readouterr()
    assert code == 0
    result = json.loads(out)
    assert [c["id"] for c in result["claims"]] == CLAIM_IDS
    assert result["files"]["dir"] in err


def test_cli_refuses_a_remote_backend(capsys):
    from pdchat.chatapp.cli.main import main
    assert main(["bench", "lab", "--backend", "http://127.0.0.1:9"]) == 2
    assert "not available with a remote backend" in capsys.readouterr().out


def test_the_speculative_points_are_named(tiny_run):
    from pdchat.chatapp.reporting.lab_report import curve_text
    result, _ = tiny_run
    rows = [r for r in result["experiments"]["spec"]["rows"] if r.get("acceptance") is not None]
    spec = next(c for c in result["curves"] if c["id"] == "spec")
    k = EngineConfig().spec_tokens                    # the draft length each request starts from
    assert result["experiments"]["spec"]["k"] == k
    assert sorted(spec["labels"]) == sorted(f"{r['method']} k={k}, {r['workload']}" for r in rows) and rows
    with open(result["files"]["svg"], encoding="utf-8") as f:
        svg = f.read()
    assert all(label in svg for label in spec["labels"])
    text = curve_text(spec, 40).plain
    assert all(f"{label}: acceptance {x:.2f}, speed-up {y:.2f}" in text
               for label, x, y in zip(spec["labels"], spec["x"], spec["y"]))
    assert result["mode"] == "quick" and set(result["busy"]) == {
        "prefill", "decode", "int8", "kv", "prefix_cache", "batching", "chunked_prefill", "disaggregation", "spec"}


def test_the_progress_says_which_step(tiny_run):
    _, progress = tiny_run
    n = len(bench_lab.STEPS)
    assert progress[0][1] == f"prefill sweep · 1/{n}"
    for i, name in enumerate(bench_lab.STEPS):
        assert any(what.startswith(name) and what.endswith(f" · {i + 1}/{n}") for _, what in progress), name
    assert progress[-1] == (1.0, "writing files")
    assert sum(bench_lab.SHARES["quick"]) == pytest.approx(1) and sum(bench_lab.SHARES["full"]) == pytest.approx(1)
