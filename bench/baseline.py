"""`pdchat bench baseline`: pdchat vs Hugging Face `generate()` on the same weights, device, dtype
and prompts, interleaved in one run (so machine noise hits both alike). With llama-cpp-python
installed, llama.cpp on the same GGUF joins the same rounds (see llamacpp_peer)."""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch

from pdchat.engine import quant
from pdchat.engine.config import EngineConfig, SamplingParams
from pdchat.engine.engine import Engine
from pdchat.engine.hf_reference import hf_generate, hf_model_for
from pdchat.bench import Progress, filler_text, kernel_paths, llamacpp_peer, median, ratio


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(config: EngineConfig, *, quick: bool, progress: Progress) -> dict[str, Any]:
    decode_tokens, prefill_len, repeats = (16, 128, 1) if quick else (128, 1024, 3)
    # No prefix cache: every repeat must really prefill.
    engine = Engine(replace(config, telemetry=False, prefix_cache=False), say=lambda m: None)
    peer = None
    try:
        progress("loading transformers", 0.0)
        hf = hf_model_for(engine, dtype=engine.dtype, device=engine.device)
        short = engine.encode("Tell me a long story about a lighthouse keeper.")
        long = engine.encode(filler_text(prefill_len))[:prefill_len]
        engine.submit(short, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)).result()   # warm-up
        hf_generate(hf, short, 4)
        peer, peer_reason = _open_peer(engine, config, short, prefill_len, progress)
        samples: dict[str, list[float]] = defaultdict(list)
        for r in range(repeats):
            progress(f"round {r + 1}/{repeats}", r / repeats)
            _round(engine, hf, peer, short, long, decode_tokens, samples)
        progress("int8 paths", 0.99)
        paths = kernel_paths.section(engine, rounds=max(3, repeats * 2))
        progress("done", 1.0)
        inputs = {"dtype": str(engine.dtype).removeprefix("torch."), "decode_tokens": decode_tokens,
                  "short_prompt_tokens": len(short), "prefill_tokens": len(long), "repeats": repeats, "batch": 1}
        return {**_report(engine, config, inputs, samples, peer, peer_reason), "int8_paths": paths}
    finally:
        if peer:
            peer.close()
        engine.close()


def _open_peer(engine: Engine, config: EngineConfig, short: list[int], prefill_len: int,
               progress: Progress) -> tuple[Any, str | None]:
    """llama.cpp on the same GGUF, warmed up, or (None, why not)."""
    if engine.device.type != "cpu":
        return None, "the llama.cpp peer is measured on CPU only"
    progress("loading llama.cpp", 0.0)
    peer, reason = llamacpp_peer.open_peer(config.model, threads=torch.get_num_threads(),
                                           n_ctx=max(2048, prefill_len + 64))
    if peer:
        peer.greedy(short, 4)                                                          # warm-up
    return peer, reason


def _round(engine: Engine, hf: Any, peer: Any, short: list[int], long: list[int], decode_tokens: int,
           samples: dict[str, list[float]]) -> None:
    """One interleaved round: pdchat (fp32, int8), HF and llama.cpp, decode then prefill."""
    greedy = SamplingParams(max_tokens=decode_tokens + 1, temperature=0, ignore_eos=True)
    samples["ours_decode"].append(engine.submit(short, greedy).result().metrics.decode_tok_s)
    if engine.ops.int8_supported(engine.device):
        engine.update(quant="int8")
        samples["ours_int8"].append(engine.submit(short, greedy).result().metrics.decode_tok_s)
        engine.update(quant="none")
    t1 = _timed(hf_generate, hf, short, 1)
    tn = _timed(hf_generate, hf, short, decode_tokens + 1)
    samples["hf_decode"].append(decode_tokens / (tn - t1))
    m = engine.submit(long, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)).result().metrics
    samples["ours_ttft"].append(m.ttft_ms)
    samples["ours_prefill"].append(len(long) / (m.ttft_ms / 1000))
    t = _timed(hf_generate, hf, long, 1)
    samples["hf_ttft"].append(t * 1000)
    samples["hf_prefill"].append(len(long) / t)
    if peer:
        samples["peer_decode"].append(peer.decode(short, decode_tokens))
        samples["peer_prefill"].append(peer.prefill(long))


def _report(engine: Engine, config: EngineConfig, inputs: dict[str, Any], samples: dict[str, list[float]],
            peer: Any, peer_reason: str | None) -> dict[str, Any]:
    od, hd = median(samples["ours_decode"]), median(samples["hf_decode"])
    op, hp = median(samples["ours_prefill"]), median(samples["hf_prefill"])
    o8 = median(samples["ours_int8"]) if samples["ours_int8"] else None
    weight_bytes = quant.decode_read_bytes(engine.loaded.model, engine.loaded.quant)
    with quant.int8_mode(engine.loaded.quant):
        int8_bytes = quant.decode_read_bytes(engine.loaded.model, engine.loaded.quant)
    return {
        "model": config.model, "device": str(engine.device), "inputs": inputs,
        "decode": {"pdchat_tok_s": od, "hf_tok_s": hd, "ratio": ratio(od, hd),
                   "pdchat_tpot_ms": 1000 / od, "hf_tpot_ms": 1000 / hd,
                   # every decode step reads all weights once: bytes x steps/s
                   "pdchat_weight_gb_s": weight_bytes * od / 1e9, "goal": ">= 1.25x (fp32)",
                   "met": ratio(od, hd) >= 1.25},
        "decode_int8": {"pdchat_int8_tok_s": o8, "hf_fp32_tok_s": hd, "ratio": ratio(o8, hd),
                        "pdchat_weight_gb_s": int8_bytes * o8 / 1e9 if o8 else None,
                        "goal": ">= 3.5x HF fp32", "met": bool(o8 and o8 / hd >= 3.5)},
        "prefill": {"pdchat_tok_s": op, "hf_tok_s": hp, "ratio": ratio(op, hp),
                    "pdchat_ttft_ms": median(samples["ours_ttft"]), "hf_ttft_ms": median(samples["hf_ttft"]),
                    "goal": ">= 1.0x", "met": ratio(op, hp) >= 1.0},
        "llamacpp": llamacpp_peer.section(peer, peer_reason, samples["peer_decode"], samples["peer_prefill"],
                                          int8_tok_s=o8, fp32_tok_s=od, prefill_tok_s=op),
    }
