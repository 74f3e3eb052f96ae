"""`pdchat bench baseline`: pdchat in each weight precision (the load dtype, int8, int4) vs Hugging
Face `generate()` on the same weights, device, dtype and prompts, interleaved in one run (so
machine noise hits all alike). With llama-cpp-python installed, llama.cpp on the same weights,
quantized to Q4_0 by its own quantizer, joins the same rounds (llamacpp_peer, gguf_export).
`--model random:llama-1b` (and other presets) measures real shapes without downloads."""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch

from pdchat.engine.config import EngineConfig, SamplingParams
from pdchat.engine.engine import Engine
from pdchat.engine.hf_reference import hf_generate, hf_model_for
from pdchat.bench import Progress, filler_text, gguf_export, kernel_paths, llamacpp_peer, median, paired_ratio

PRECISIONS = ("none", "int8", "int4")     # "none": the load dtype (float32 on CPU)
# Chat-sized prompts besides the 1,024-token prefill: quantized weights run other kernels there
# (up to 48 rows the integer ones), and "no TTFT penalty" is about every length.
SHORT_PREFILLS = (32, 128, 512)


def short_prefills(prefill_len: int) -> list[int]:
    return [n for n in SHORT_PREFILLS if n < prefill_len]


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(config: EngineConfig, *, quick: bool, progress: Progress) -> dict[str, Any]:
    # 5 rounds: on a shared VM a slow patch can take 2 of 3 rounds of one run (a prefill ratio of
    # 0.74 where 7 rounds gave 1.00)
    decode_tokens, prefill_len, repeats = (16, 128, 1) if quick else (128, 1024, 5)
    # No prefix cache: every repeat must really prefill. Each round runs every weight precision.
    engine = Engine(replace(config, telemetry=False, prefix_cache=False, quant="none"), say=lambda m: None)
    modes = [m for m in PRECISIONS if engine.precision.supported(m) is None]
    peer = None
    try:
        progress("loading transformers", 0.0)
        hf = hf_model_for(engine, dtype=engine.dtype, device=engine.device)
        short = engine.encode("Tell me a long story about a lighthouse keeper.")
        long = engine.encode(filler_text(prefill_len))[:prefill_len]
        engine.submit(short, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)).result()   # warm-up
        hf_generate(hf, short, 4)
        peer, peer_reason = _open_peer(engine, short, prefill_len, progress)
        samples: dict[str, list[float]] = defaultdict(list)
        sizes: dict[str, dict[str, float]] = {}
        for r in range(repeats):
            progress(f"round {r + 1}/{repeats}", r / repeats)
            _round(engine, modes if r % 2 == 0 else modes[::-1], hf, peer, short, long, decode_tokens, samples, sizes)
        del hf                                  # the kernel paths' matrices need the memory
        progress("kernel paths", 0.99)
        paths = kernel_paths.section(engine, rounds=max(3, repeats * 2))
        progress("done", 1.0)
        inputs = {"dtype": engine.precision.label("none"), "decode_tokens": decode_tokens,
                  "short_prompt_tokens": len(short), "prefill_tokens": len(long), "repeats": repeats, "batch": 1,
                  "ratios": "each ratio is the median of the rounds' ratios (runs seconds apart in one round)"}
        return {**_report(engine, config, inputs, modes, samples, sizes, peer, peer_reason), "kernel_paths": paths}
    finally:
        if peer:
            peer.close()
        engine.close()


def _open_peer(engine: Engine, short: list[int], prefill_len: int, progress: Progress) -> tuple[Any, str | None]:
    """llama.cpp on the same weights quantized to Q4_0 by its own quantizer, warmed up, or (None, why not)."""
    if engine.device.type != "cpu":
        return None, "the llama.cpp peer is measured on CPU only"
    reason = llamacpp_peer.missing()
    if reason is not None:
        return None, reason
    threads = torch.get_num_threads()
    progress("preparing llama.cpp's file", 0.0)
    try:
        gguf = gguf_export.peer_gguf(engine.loaded, threads, lambda what: progress(what[:40], 0.0))
    except gguf_export.ExportUnavailable as e:
        return None, str(e)
    progress("loading llama.cpp", 0.0)
    peer, reason = llamacpp_peer.open_peer(gguf, threads=threads, n_ctx=max(2048, prefill_len + 64))
    if peer:
        peer.greedy(short, 4)                                                          # warm-up
    return peer, reason


def _round(engine: Engine, modes: list[str], hf: Any, peer: Any, short: list[int], long: list[int],
           decode_tokens: int, samples: dict[str, list[float]], sizes: dict[str, dict[str, float]]) -> None:
    """One interleaved round: pdchat in each weight precision (decode, then prefill), llama.cpp
    next to int4 (after it when int4 comes last, before it when the round runs the precisions in
    reverse: rounds alternate, so drift between runs does not favour one side), then HF."""
    greedy = SamplingParams(max_tokens=decode_tokens + 1, temperature=0, ignore_eos=True)
    once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def run_peer() -> None:
        if peer:
            samples["peer_decode"].append(peer.decode(short, decode_tokens))
            samples["peer_prefill"].append(peer.prefill(long))

    int4_first = modes[0] == "int4"
    if int4_first:
        run_peer()
    for mode in modes:
        engine.update(quant=mode)
        sizes[mode] = {"model_mb": engine.precision.resident_bytes / 1e6,
                       "read_mb_per_token": engine.precision.read_bytes / 1e6}
        samples[f"{mode}_decode"].append(engine.submit(short, greedy).result().metrics.decode_tok_s)
        m = engine.submit(long, once).result().metrics
        samples[f"{mode}_ttft"].append(m.ttft_ms)
        samples[f"{mode}_prefill"].append(len(long) / (m.ttft_ms / 1000))
        for n in short_prefills(len(long)):
            samples[f"{mode}_prefill_{n}"].append(engine.submit(long[:n], once).result().metrics.ttft_ms)
    if not int4_first:
        run_peer()
    t1 = _timed(hf_generate, hf, short, 1)
    tn = _timed(hf_generate, hf, short, decode_tokens + 1)
    samples["hf_decode"].append(decode_tokens / (tn - t1))
    t = _timed(hf_generate, hf, long, 1)
    samples["hf_ttft"].append(t * 1000)
    samples["hf_prefill"].append(len(long) / t)


def _report(engine: Engine, config: EngineConfig, inputs: dict[str, Any], modes: list[str],
            samples: dict[str, list[float]], sizes: dict[str, dict[str, float]], peer: Any,
            peer_reason: str | None) -> dict[str, Any]:
    decode = {m: median(samples[f"{m}_decode"]) for m in modes}
    prefill = {m: median(samples[f"{m}_prefill"]) for m in modes}
    hd, hp = median(samples["hf_decode"]), median(samples["hf_prefill"])
    od, op = decode["none"], prefill["none"]

    def vs(a: str, b: str) -> float | None:      # round by round (bench.paired_ratio)
        return paired_ratio(samples[a], samples[b])

    rows = [{"weights": engine.precision.label(m), "decode_tok_s": decode[m], "tpot_ms": 1000 / decode[m],
             "decode_vs_first": vs(f"{m}_decode", "none_decode"), "prefill_tok_s": prefill[m],
             "prefill_vs_first": vs(f"{m}_prefill", "none_prefill"), "ttft_ms": median(samples[f"{m}_ttft"]),
             # every decode step reads all weights once: bytes x steps/s
             "weight_gb_s": sizes[m]["read_mb_per_token"] * decode[m] / 1e3, **sizes[m]} for m in modes]
    long_len = inputs["prefill_tokens"]
    q8 = vs("int8_decode", "none_decode") if "int8" in modes else None
    q4 = vs("int4_decode", "none_decode") if "int4" in modes else None
    by_length = [{"prompt_tokens": n, "fp32_ttft_ms": median(samples[f"none_prefill_{n}"]),
                  **{f"{m}_vs_fp32": vs(f"none_prefill_{n}", f"{m}_prefill_{n}") for m in modes if m != "none"}}
                 for n in short_prefills(long_len)]       # (TTFT ratios: fp32's over theirs)
    speeds = [(vs(f"{m}_prefill", "none_prefill"), long_len, m) for m in modes if m != "none"]
    speeds += [(row[f"{m}_vs_fp32"], row["prompt_tokens"], m) for row in by_length for m in modes if m != "none"]
    slowest = min(speeds, default=None)
    od_hd, op_hp = vs("none_decode", "hf_decode"), vs("none_prefill", "hf_prefill")
    return {
        "model": config.model, "device": str(engine.device), "inputs": inputs,
        "precisions": {"rows": rows},
        "decode": {"pdchat_tok_s": od, "hf_tok_s": hd, "ratio": od_hd,
                   "pdchat_tpot_ms": 1000 / od, "hf_tpot_ms": 1000 / hd, "goal": ">= 1.25x (fp32)",
                   "met": od_hd >= 1.25},
        "decode_quantized": {"int8_vs_fp32": q8, "int4_vs_fp32": q4,
                             "int8_vs_hf_fp32": vs("int8_decode", "hf_decode") if "int8" in modes else None,
                             "goal": "int8 >= 2x our fp32", "met": None if q8 is None else q8 >= 2.0},
        "prefill": {"pdchat_tok_s": op, "hf_tok_s": hp, "ratio": op_hp,
                    "pdchat_ttft_ms": median(samples["none_ttft"]), "hf_ttft_ms": median(samples["hf_ttft"]),
                    "goal": ">= 1.0x", "met": op_hp >= 1.0},
        "prefill_by_length": {"rows": by_length},
        "prefill_quantized": {"slowest_vs_fp32": slowest[0] if slowest else None,
                              "slowest_at_tokens": slowest[1] if slowest else None,
                              "slowest_weights": slowest[2] if slowest else None,
                              "goal": f">= 0.95x fp32 (int8 and int4, at "
                                      f"{', '.join(map(str, [*short_prefills(long_len), long_len]))} tokens)",
                              "met": None if slowest is None else slowest[0] >= 0.95},
        "llamacpp": llamacpp_peer.section(peer, peer_reason, samples["peer_decode"], samples["peer_prefill"],
                                          ours_decode={engine.precision.label(m): samples[f"{m}_decode"]
                                                       for m in modes},
                                          ours_prefill=samples["none_prefill"]),
    }
