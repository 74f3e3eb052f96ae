"""`pdchat bench lab`: the explainers' claims about inference, measured on this machine.

Curves: prefill time vs prompt length (a sweep, several repeats, medians) and decode time per
token vs position (one long generation, medians per position bin); then one experiment per claim
(int8, KV bytes, prefix cache, batching, chunked prefill, disaggregation, speculative decoding),
reusing the `toggles`, `disagg` and `spec` suites' measurements. Verdicts come from the pure checks
in lab_claims; the result, a CSV of the curves and an SVG are written under
data_dir()/lab/<timestamp>/.
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

from pdchat.engine.config import EngineConfig, SamplingParams
from pdchat.engine.engine import Engine
from pdchat.engine.stream import TokenEvent
from pdchat.bench import Progress, filler_text, machine, median, ratio
from pdchat.bench import disagg as bench_disagg, lab_claims, lab_files, lab_noise, spec as bench_spec, \
    toggles as bench_toggles

SIZES: dict[str, dict[str, Any]] = {
    # ~4 minutes for smollm2-135m on a 2-core CPU.
    "full": dict(lengths=[16, 32, 64, 128, 256, 512, 1024, 2048, 4096], repeats=3, decode_tokens=512,
                 decode_bin=32, quant_prompt=512, quant_tokens=32, quant_repeats=2, kv_prompt=100,
                 prefix_words=600, prefix_repeats=2, batch_sizes=[1, 2, 4, 8, 16, 32], batch_tokens=32,
                 chunk_words=400, chunks=[16, 32, 64, 128, 256, None], spec_tokens=64),
    # Under a minute for smollm2-135m on a 2-core CPU (seconds on random:tiny, which the tests use):
    # fewer points and one repeat, so noisier verdicts than the full run.
    "quick": dict(lengths=[32, 128, 512, 1024], repeats=1, decode_tokens=96, decode_bin=16, quant_prompt=256,
                  quant_tokens=12, quant_repeats=1, kv_prompt=60, prefix_words=300, prefix_repeats=1,
                  batch_sizes=[1, 4, 16], batch_tokens=32, chunk_words=200, chunks=[16, 64, None], spec_tokens=24),
}
STEPS = ["prefill sweep", "decode vs position", "int8 weights", "KV bytes", "prefix cache", "batching",
         "chunked prefill", "disaggregation", "speculative decoding"]
# Share of the run each step takes at each size (smollm2-135m on a 2-core CPU, measured 2026-11-26:
# full 125 s, quick 36 s), so that the fraction done, and the time left a reader draws from it,
# move at an even pace.
SHARES = {"full": [0.33, 0.13, 0.05, 0.01, 0.06, 0.13, 0.08, 0.12, 0.09],
          "quick": [0.06, 0.07, 0.05, 0.03, 0.07, 0.16, 0.09, 0.30, 0.17]}
# The disaggregation experiment's slow link (160 Mbit/s): its hand-off of the chunked-prefill
# experiment's newcomer (23 MB on the default model) takes about a second, so that the TTFT's rise
# stands out of a one-core prefill's run-to-run spread, which a 0.1 GB/s link's +0.2 s did not
# (one run, 2026-11-26: TTFT -20 ms for a transfer +209 ms).
SLOW_LINK_GBPS = 0.02


def run(config: EngineConfig, *, quick: bool, progress: Progress) -> dict[str, Any]:
    mode = "quick" if quick else "full"
    sizes = SIZES[mode]
    # Prefix cache, speculation and disaggregation off: every measurement really computes what it
    # times, in one process; each experiment turns on only the toggle it studies.
    engine = Engine(replace(config, telemetry=False, prefix_cache=False, spec="off", quant="none", disaggregate=False),
                    say=lambda m: None)
    try:
        out: dict[str, Any] = {"suite": "lab", "model": config.model, "device": str(engine.device),
                               "dtype": str(engine.dtype).removeprefix("torch."), "inputs": dict(sizes),
                               "mode": mode}
        engine.submit("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)).result()  # warm-up
        exp: dict[str, Any] = {}
        busy: dict[str, float | None] = {}
        others = lab_noise.OthersLoad()
        done = 0.0

        def step(i: int) -> Progress:
            start, share = done, SHARES[mode][i]

            def report(what: str, frac: float) -> None:
                at = start + share * min(frac, 1.0)
                progress(f"{what} · {i + 1}/{len(STEPS)}", at)

            report(STEPS[i], 0.0)
            return lambda what, frac: report(f"{STEPS[i]}: {what}", frac)

        for i, (key, fn) in enumerate([("prefill", _prefill_sweep), ("decode", _decode_positions),
                                       ("int8", _int8), ("kv", _kv_bytes), ("prefix_cache", _prefix),
                                       ("batching", _batching), ("chunked_prefill", _chunked),
                                       ("disaggregation", _disaggregation), ("spec", _spec)]):
            exp[key] = fn(engine, sizes, step(i))
            busy[key] = others.since_last()
            done += SHARES[mode][i]
        out["experiments"] = exp
        out["busy"] = busy
        out["claims"] = lab_claims.mark_disagreeing(lab_noise.mark_noisy(claims(exp), busy), spreads(exp))
        out["curves"] = curves(exp)
        out["see_also"] = _see_also()
        out["machine"] = machine()
        progress("writing files", 1.0)
        out["files"] = lab_files.save(out)
        return out
    finally:
        engine.close()


# ---- experiments (each returns plain numbers) -----------------------------------------------------
def _prompt_ids(engine: Engine, n: int, seed: int = 0) -> list[int]:
    ids = engine.encode(filler_text(n, seed=seed))
    while len(ids) < n:                     # short tokenizers (random models): repeat the text
        ids += ids
    return ids[:n]


def _prefill_sweep(engine: Engine, sizes: dict[str, Any], progress: Progress) -> dict[str, Any]:
    base_chunk = engine.config.chunk_size
    engine.update(chunk_size=None)          # one prompt, one forward: time the prefill itself
    limit = min(engine.max_model_len - 2, engine.blocks.num_blocks * engine.blocks.block_size - 2)
    lengths = [n for n in sizes["lengths"] if n <= limit]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    raw: dict[int, list[float]] = {n: [] for n in lengths}
    if engine.device.type == "cuda":
        # A GPU's first prefill of a shape loads kernels (cuBLAS's lazily loaded modules): one
        # such 512-token prefill took 522 ms on an H200 where the 1,024-token one after it took
        # 18. There a warm-up pass costs milliseconds; on a CPU it would double the sweep.
        for n in lengths:
            engine.submit(_prompt_ids(engine, n, seed=-1), one).result()
    total = sizes["repeats"] * len(lengths)
    for r in range(sizes["repeats"]):
        for i, n in enumerate(lengths):     # interleaved: machine noise hits every length alike
            progress(f"{n} tokens", (r * len(lengths) + i) / total)
            raw[n].append(engine.submit(_prompt_ids(engine, n, seed=r), one).result().metrics.prefill_ms)
    engine.update(chunk_size=base_chunk)
    return {"lengths": lengths, "prefill_ms": [median(raw[n]) for n in lengths], "raw_ms": [raw[n] for n in lengths]}


def _decode_positions(engine: Engine, sizes: dict[str, Any], progress: Progress) -> dict[str, Any]:
    progress("generating", 0.0)
    prompt = engine.encode("Tell me a very long story about a lighthouse keeper.")
    n = min(sizes["decode_tokens"], engine.max_model_len - len(prompt) - 1)
    m = engine.submit(prompt, SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True)).result().metrics
    # itl_ms[i] is the step that computed the token at position len(prompt) + i.
    positions, tpot, b = [], [], sizes["decode_bin"]
    for start in range(0, len(m.itl_ms) - b + 1, b):
        positions.append(len(prompt) + start + b // 2)
        tpot.append(median(m.itl_ms[start:start + b]))
    return {"prompt_tokens": len(prompt), "generated": m.output_tokens, "bin": b, "positions": positions,
            "tpot_ms": tpot, "median_tpot_ms": median(m.itl_ms), "itl_ms": m.itl_ms}


def _int8(engine: Engine, sizes: dict[str, Any], progress: Progress) -> dict[str, Any]:
    if not engine.ops.int8_supported(engine.device):
        return {"available": False, "reason": f"this torch build has no int8 weight kernel on {engine.device}"}
    long = _prompt_ids(engine, sizes["quant_prompt"], seed=7)
    short = engine.encode("Write a story about a dragon.")
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    gen = SamplingParams(max_tokens=sizes["quant_tokens"] + 1, temperature=0, ignore_eos=True)
    prefill: dict[str, list[float]] = {"none": [], "int8": []}
    tpot: dict[str, list[float]] = {"none": [], "int8": []}
    for r in range(sizes["quant_repeats"]):
        for mode in ("none", "int8"):
            progress(f"{mode} round {r + 1}", (2 * r + (mode == "int8")) / (2 * sizes["quant_repeats"]))
            engine.update(quant=mode)
            prefill[mode].append(engine.submit(long, one).result().metrics.prefill_ms)
            tpot[mode].append(engine.submit(short, gen).result().metrics.tpot_ms)
    engine.update(quant="none")
    p = {k: median(v) for k, v in prefill.items()}
    d = {k: median(v) for k, v in tpot.items()}
    return {"available": True, "prompt_tokens": len(long), "decode_tokens": sizes["quant_tokens"],
            "rounds_ms": {"prefill_fp": prefill["none"], "prefill_int8": prefill["int8"], "tpot_fp": tpot["none"],
                          "tpot_int8": tpot["int8"]},
            "prefill_ms_fp": p["none"], "prefill_ms_int8": p["int8"], "tpot_ms_fp": d["none"],
            "tpot_ms_int8": d["int8"], "prefill_speedup": ratio(p["none"], p["int8"]),
            "decode_speedup": ratio(d["none"], d["int8"])}


def _kv_bytes(engine: Engine, sizes: dict[str, Any], progress: Progress) -> dict[str, Any]:
    progress("filling the pool", 0.0)
    mc, runner = engine.model_config, engine.runner
    ids = _prompt_ids(engine, sizes["kv_prompt"], seed=3)
    # As long as the context allows, so it is still running when we look (tiny models are fast);
    # it is cancelled as soon as it has been observed.
    stream = engine.submit(ids, SamplingParams(max_tokens=engine.max_model_len - len(ids) - 1, temperature=0,
                                               ignore_eos=True))
    snap: dict[str, Any] = {}
    for event in stream:
        if isinstance(event, TokenEvent):
            # Under the engine's step lock the pool and the sequence agree (no step half done).
            with engine.loop.lock:
                st = engine.stats()
                seq = next((s for s in engine.scheduler.running if s.request_id == stream.request_id), None)
                if seq is None:         # between two steps of its life (e.g. preempted): next token
                    continue
                snap = {"tokens_held": seq.num_computed_tokens, "blocks_used": st.kv_blocks_used,
                        "bytes_used": st.kv_bytes_used, "engine_bytes_per_token": st.kv_bytes_per_token,
                        "block_size": st.kv_block_size}
            stream.cancel()
            break
    stream.result()
    if not snap:
        raise RuntimeError("the KV probe request finished before it could be observed in the pool")
    slots = runner.k_cache.shape[1] * runner.k_cache.shape[2]       # blocks x block size
    return {"layers": mc.num_layers, "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
            "dtype_bytes": engine.dtype.itemsize, "tensor_bytes_per_slot": runner.kv_bytes_total / slots, **snap}


def _prefix(engine: Engine, sizes: dict[str, Any], progress: Progress) -> dict[str, Any]:
    progress("two turns, cache on and off", 0.0)
    return bench_toggles.prefix_cache(engine, sizes["prefix_words"], sizes["prefix_repeats"])


def _batching(engine: Engine, sizes: dict[str, Any], progress: Progress) -> dict[str, Any]:
    rows = []
    for i, n in enumerate(sizes["batch_sizes"]):
        progress(f"{n} at once", i / len(sizes["batch_sizes"]))
        tok_s, tpot = bench_toggles.batch_point(engine, n, sizes["batch_tokens"])
        rows.append({"batch": n, "decode_tok_s": tok_s, "tpot_ms": tpot})
    return {"new_tokens": sizes["batch_tokens"], "rows": rows}


def _chunked(engine: Engine, sizes: dict[str, Any], progress: Progress) -> dict[str, Any]:
    progress("a newcomer arrives mid-stream", 0.0)
    return bench_toggles.chunked_prefill(engine, sizes["chunk_words"], sizes["chunks"])


def _disaggregation(engine: Engine, sizes: dict[str, Any], progress: Progress) -> dict[str, Any]:
    # The chunked-prefill experiment's newcomer, one round; no socket row: the claim needs no second engine.
    slow = replace(bench_disagg.SLOW, link_gbps=SLOW_LINK_GBPS)
    setups = [bench_disagg.CHUNKED, bench_disagg.ONE_STEP, bench_disagg.SHM, slow]
    try:
        return bench_disagg.measure(engine, sizes["chunk_words"], setups, 1, progress)
    except bench_disagg.WorkerUnavailable as e:        # the other claims stand: this one says why not
        return {"available": False, "reason": str(e)}


def _spec(engine: Engine, sizes: dict[str, Any], progress: Progress) -> dict[str, Any]:
    workloads = {"grounded": bench_spec.GROUNDED[:1], "open-ended": bench_spec.OPEN_ENDED[:1]}
    return {"max_tokens": sizes["spec_tokens"], "k": engine.config.spec_tokens,
            "rows": bench_spec.measure(engine, workloads, sizes["spec_tokens"], progress)}


# ---- verdicts and curves --------------------------------------------------------------------------
def claims(exp: dict[str, Any]) -> list[lab_claims.Verdict]:
    """Every claim's verdict from the experiments' numbers (pure: no engine needed)."""
    pre, dec = exp["prefill"], exp["decode"]
    out = [lab_claims.prefill_linear(pre["lengths"], pre["prefill_ms"]),
           lab_claims.decode_slow_growth(dec["positions"], dec["tpot_ms"])]
    # Read off the measured curve, not the fit: on CPU attention makes long prompts superlinear.
    at_1000 = lab_claims.interpolate([float(n) for n in pre["lengths"]], pre["prefill_ms"], 1000.0)
    out.append(lab_claims.prefill_vs_decode(at_1000, dec["median_tpot_ms"]))
    q = exp["int8"]
    out.append(lab_claims.int8_memory_bound(q.get("decode_speedup"), q.get("prefill_speedup"), q.get("reason", "")))
    kv = exp["kv"]
    out.append(lab_claims.kv_bytes(kv["layers"], kv["kv_heads"], kv["head_dim"], kv["dtype_bytes"],
                                   engine_bytes_per_token=kv["engine_bytes_per_token"],
                                   tensor_bytes_per_slot=kv["tensor_bytes_per_slot"], blocks_used=kv["blocks_used"],
                                   block_size=kv["block_size"], bytes_used=kv["bytes_used"],
                                   tokens_held=kv["tokens_held"]))
    pc = exp["prefix_cache"]
    out.append(lab_claims.prefix_cache(pc["ttft_on_ms"], pc["ttft_off_ms"], pc["prompt_tokens"],
                                       pc["cached_prompt_tokens"]))
    rows = exp["batching"]["rows"]
    out.append(lab_claims.batching([r["batch"] for r in rows], [r["decode_tok_s"] for r in rows],
                                   [r["tpot_ms"] for r in rows]))
    crows = exp["chunked_prefill"]["rows"]
    out.append(lab_claims.chunked_prefill(_chunk_axis(crows), [r["newcomer_ttft_ms"] for r in crows],
                                          [r["worst_gap_over_tpot"] for r in crows]))
    out.append(_disaggregation_claim(exp["disaggregation"]))
    points = _spec_points(exp["spec"])
    out.append(lab_claims.spec_vs_acceptance([p[0] for p in points], [p[1] for p in points]))
    return out


def _disaggregation_claim(d: dict[str, Any]) -> lab_claims.Verdict:
    rows = {r["setup"]: r for r in d.get("rows", [])}       # none where the prefill worker did not start
    chunked, shm, slow = (rows.get(s.name, {}) for s in (bench_disagg.CHUNKED, bench_disagg.SHM, bench_disagg.SLOW))
    return lab_claims.disaggregation(
        colocated_gap=chunked.get("worst_gap_over_tpot"), disaggregated_gap=shm.get("worst_gap_over_tpot"),
        colocated_ttft_ms=chunked.get("newcomer_ttft_ms"), disaggregated_ttft_ms=shm.get("newcomer_ttft_ms"),
        transfer_ms=shm.get("kv_transfer_ms"), transfer_bytes=shm.get("kv_transfer_bytes"),
        slow_ttft_ms=slow.get("newcomer_ttft_ms"), slow_transfer_ms=slow.get("kv_transfer_ms"),
        slow_link_gbps=d.get("slow_link_gbps"), slow_link_ms=d.get("slow_link_ms"), reason=d.get("reason", ""))


def _chunk_axis(rows: list[dict[str, Any]]) -> list[int]:
    # "off" means the whole prompt in one step: its chunk is the prompt length.
    return [r["chunk_size"] or r["newcomer_prompt_tokens"] for r in rows]


def _spec_points(spec: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(acceptance, speed-up, "method k=K, workload") of every measured speculative point; K is the
    draft length each request starts from (then adapts)."""
    k = f" k={spec['k']}" if spec.get("k") else ""
    return sorted((r["acceptance"], r["speedup"], f"{r['method']}{k}, {r['workload']}") for r in spec["rows"]
                  if r.get("acceptance") is not None and r.get("speedup") is not None)


def spreads(exp: dict[str, Any]) -> dict[str, float | None]:
    """By claim id: how much the repeated rounds behind it disagree (None: measured once)."""
    prefill = lab_claims.rounds_spread(exp["prefill"]["raw_ms"])
    return {"prefill_linear": prefill, "prefill_vs_decode": prefill,
            "int8_memory_bound": lab_claims.rounds_spread(list(exp["int8"].get("rounds_ms", {}).values()))}


def curves(exp: dict[str, Any]) -> list[dict[str, Any]]:
    """The plots, each {id, title, x_label, y_label, x, y, role, kind, fit?}, for SVG and terminal."""
    pre, dec = exp["prefill"], exp["decode"]
    pfit = lab_claims.linear_fit([float(n) for n in pre["lengths"]], pre["prefill_ms"])
    dfit = lab_claims.linear_fit([float(p) for p in dec["positions"]], dec["tpot_ms"])
    b = exp["batching"]["rows"]
    c = exp["chunked_prefill"]["rows"]
    s = _spec_points(exp["spec"])
    out = [
        _curve("prefill", "Prefill time vs prompt length", "prompt tokens", "ms", pre["lengths"],
               pre["prefill_ms"], "prefill", fit=pfit[:2]),
        _curve("decode", "Decode time per token vs position", "position", "ms / token", dec["positions"],
               dec["tpot_ms"], "decode", fit=dfit[:2]),
        _curve("batch_throughput", "Batching: aggregate throughput", "batch size", "tok/s",
               [r["batch"] for r in b], [r["decode_tok_s"] for r in b], "gpu"),
        _curve("batch_tpot", "Batching: per-user TPOT", "batch size", "ms / token",
               [r["batch"] for r in b], [r["tpot_ms"] for r in b], "decode"),
        _curve("chunk_ttft", "Chunked prefill: newcomer's TTFT", "chunk tokens", "ms",
               _chunk_axis(c), [r["newcomer_ttft_ms"] for r in c], "prefill"),
        _curve("chunk_stall", "Chunked prefill: others' worst stall", "chunk tokens", "x TPOT",
               _chunk_axis(c), [r["worst_gap_over_tpot"] for r in c], "decode"),
    ]
    if exp["disaggregation"].get("rows"):
        out.append(_disaggregation_curve(exp["disaggregation"]["rows"]))
    if s:
        spec = _curve("spec", "Speculative decoding", "acceptance", "speed-up", [p[0] for p in s],
                      [p[1] for p in s], "cached", kind="scatter")
        spec["labels"] = [p[2] for p in s]            # which method on which workload each point is
        out.append(spec)
    return out


def _disaggregation_curve(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One bar per setup: the newcomer's TTFT, its K/V hand-off as the bar's last stretch, and the
    running stream's worst stall as the bar's note."""
    curve = _curve("disagg", "Disaggregation: TTFT and stall", "setup", "newcomer's TTFT, ms",
                   [r["setup"] for r in rows], [r["newcomer_ttft_ms"] for r in rows], "prefill", kind="bars")
    curve["part"] = [r["kv_transfer_ms"] or 0.0 for r in rows]
    curve["part_label"], curve["part_role"] = "K/V hand-off", "kv"
    curve["notes"] = [f"stall {r['worst_gap_over_tpot']:.1f}× TPOT" for r in rows]
    return curve


def _curve(cid: str, title: str, x_label: str, y_label: str, x: list, y: list, role: str, *,
           kind: str = "line", fit: tuple[float, float] | None = None) -> dict[str, Any]:
    curve = {"id": cid, "title": title, "x_label": x_label, "y_label": y_label, "x": list(x), "y": list(y),
             "role": role, "kind": kind}
    if fit is not None:
        curve["fit"] = {"slope": fit[0], "intercept": fit[1]}
    return curve


def _see_also() -> dict[str, str]:
    peer = ("llama-cpp-python is installed: compare with llama.cpp on the same GGUF by hand"
            if importlib.util.find_spec("llama_cpp") else "llama-cpp-python is not installed (optional)")
    return {"baseline": "pdchat bench baseline: pdchat vs Hugging Face generate() on the same weights",
            "toggles": "pdchat bench toggles: each optimization on vs off at full size",
            "spec": "pdchat bench spec: speculative decoding on more prompts",
            "llama.cpp": peer}
