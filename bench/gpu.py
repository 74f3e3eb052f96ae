"""`pdchat bench gpu`: the engine on a CUDA GPU, measured side by side in one run.

- the device's memory bandwidth, measured (a device-to-device copy, bytes read + written);
- per model shape (random: weights of real shapes, no downloads): batch-1 decode tok/s with CUDA
  graphs on and off, Hugging Face `generate` on the same weights and dtype (the faster of its
  dynamic and static caches), and the fraction of the bandwidth roofline decoding reaches
  (weights + K/V read per token x tok/s / measured bandwidth);
- where a batch-1 decode step's GPU time goes: the kernels of its graph, under the profiler;
- the claim the lab makes about GPUs: a 1,000-token prefill costs about 5-10 decode steps;
- throughput: 256 requests of random 100-1,024 input and output tokens on the Qwen2.5-0.5B shape
  (nano-vllm's published benchmark shape: 1,434 tok/s on an RTX 4070 laptop, Qwen3-0.6B).
"""
from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Any, Iterable, Iterator

import torch

from pdchat.bench import Progress, filler_text, median, ratio
from pdchat.engine.config import EngineConfig, SamplingParams
from pdchat.engine.engine import Engine
from pdchat.engine.errors import InvalidRequest
from pdchat.engine.hf_reference import hf_generate, hf_model_for

SHAPES = ("random:smollm2-135m", "random:qwen2.5-0.5b", "random:llama-1b")
THROUGHPUT_SHAPE = "random:qwen2.5-0.5b"
NANO_VLLM = "nano-vllm (published): 1,434 tok/s, Qwen3-0.6B, RTX 4070 laptop, 256 requests"
GOALS = {"roofline_1b": 0.70, "hf_1b": 5.0, "decode_135m": 3000.0}


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:                              # two warm-ups
            times.append(start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * nbytes / median(times)


def _decode(engine: Engine, prompt: list[int], tokens: int, repeats: int) -> tuple[float, float]:
    """Batch-1 decode: (median tok/s, median TTFT ms) of `repeats` greedy runs."""
    rates, ttfts = [], []
    for _ in range(repeats):
        done = engine.submit(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)).result()
        rates.append(done.metrics.decode_tok_s)
        ttfts.append(done.metrics.ttft_ms)
    return median(rates), median(ttfts)


def _hf_decode(hf: Any, prompt: list[int], tokens: int, repeats: int) -> tuple[float, str]:
    """Hugging Face `generate`'s decode tok/s (the n-token run minus the 1-token run) with its
    default dynamic cache and with a static cache (uncompiled: compiling takes minutes per
    shape), the faster of the two, and which that was."""
    def timed(n: int, kw: dict[str, Any]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf_generate(hf, prompt, n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    best: tuple[float, str] = (0.0, "none worked")
    for name, kw in (("dynamic", {}), ("static", {"cache_implementation": "static", "disable_compile": True})):
        try:
            timed(4, kw)
        except Exception:                      # this transformers or model has no such cache
            continue
        rate = median([(tokens - 1) / (timed(tokens, kw) - timed(1, kw)) for _ in range(repeats)])
        best = max(best, (rate, name))
    return best


def replay_ms(engine: Engine, repeats: int = 200) -> float | None:
    """The device's time for one batch-1 decode step alone: the captured graph replayed on the
    last step's inputs (its K/V written again to the same slot), timed with CUDA events."""
    graphs = engine.runner.graphs
    if graphs is None or 1 not in graphs.sizes:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.replay(1)
    start.record()
    for _ in range(repeats):
        graphs.replay(1)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def step_kernels(engine: Engine, replays: int = 10, top: int = 8) -> list[dict[str, Any]]:
    """Where a batch-1 decode step's GPU time goes: its graph replayed under the profiler, the
    kernels that take the most of it, with launches and µs a step."""
    graphs = engine.runner.graphs
    if graphs is None or 1 not in graphs.sizes:
        return []
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.replay(1)
        torch.cuda.synchronize()
    return kernel_rows(prof.key_averages(), replays, top)


def kernel_rows(averages: Iterable[Any], replays: int, top: int) -> list[dict[str, Any]]:
    """The profiler's averages as rows, the most device time first (host-side calls, which take
    none, are left out)."""
    def device_us(a: Any) -> float:
        return getattr(a, "device_time_total", None) or getattr(a, "cuda_time_total", 0.0)

    rows = [{"kernel": a.key[:60], "per_step": a.count / replays, "us_per_step": device_us(a) / replays}
            for a in averages if device_us(a) > 0]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:top]


def _profiled(engine: Engine) -> list[dict[str, Any]]:
    try:
        return step_kernels(engine)
    except Exception as e:          # a profiler that fails must not cost the shape's figures
        return [{"kernel": f"not profiled: {type(e).__name__}: {e}"[:120]}]


def _op_by_op_extra_ms(engine: Engine) -> float | None:
    """What a step with prompt tokens costs beyond a replayed decode step, as measured at capture
    (the time budget's fixed cost: it sizes the prompt slices beside running streams)."""
    graphs = engine.runner.graphs
    return None if graphs is None else graphs.mixed_step_extra() * 1000


def shape_row(model: str, config: EngineConfig, bandwidth: float, quick: bool, progress: Progress,
              at: float) -> dict[str, Any]:
    """One model shape: decode with and without graphs, HF, roofline, the prefill/decode claim."""
    tokens, hf_tokens, repeats = (64, 16, 1) if quick else (128, 32, 3)
    engine = Engine(replace(config, model=model, telemetry=False, prefix_cache=False, kv_cache_mb=4096),
                    say=lambda m: None)
    try:
        prompt = engine.encode("Tell me a long story about a lighthouse keeper.")
        long = engine.encode(filler_text(1000))[:1000]
        _decode(engine, prompt, 8, 1)                              # warm-up: compiles, captures
        progress(f"{model}: decode, graphs on", at)
        graphs, _ = _decode(engine, prompt, tokens, repeats)
        gpu_ms, extra_ms = replay_ms(engine), _op_by_op_extra_ms(engine)
        _, ttft_1k = _decode(engine, long, 2, repeats)
        engine.update(cuda_graphs=False)
        _decode(engine, prompt, 8, 1)
        progress(f"{model}: decode, graphs off", at)
        eager, _ = _decode(engine, prompt, tokens, repeats)
        engine.update(cuda_graphs=True)
        context = len(prompt) + tokens / 2                         # the mean context read per token
        per_token = engine.precision.read_bytes + context * engine.kv_bytes_per_token
        state = engine.stats().graph_state
        quantized = {}
        for mode in ("int8", "int4"):                              # weight-only, where this device runs it
            why = engine.precision.supported(mode)
            if why is None:
                engine.update(quant=mode)
                _decode(engine, prompt, 8, 1)
                quantized[f"{mode}_tok_s"] = _decode(engine, prompt, tokens // 2, 1)[0]
            else:
                quantized[f"{mode}_tok_s"] = f"unsupported: {why}"
        engine.update(quant="none")
        progress(f"{model}: transformers", at)
        hf = hf_model_for(engine, dtype=engine.dtype, device=engine.device)
        hf_rate, hf_cache = _hf_decode(hf, prompt, hf_tokens, repeats)
        del hf
        _decode(engine, prompt, 8, 1)             # the full-precision graphs captured again
        kernels = _profiled(engine)               # last: the profiler stays loaded once used
        return {"model": model, "dtype": str(engine.dtype).removeprefix("torch."),
                "decode_tok_s": graphs, "eager_tok_s": eager, "graphs_speedup": ratio(graphs, eager),
                "hf_tok_s": hf_rate, "vs_hf": ratio(graphs, hf_rate), "hf_cache": hf_cache,
                "bytes_per_token": int(per_token), "roofline": per_token * graphs / bandwidth,
                # the step's device time alone, and what the engine's host work adds to it
                "gpu_ms": gpu_ms, "host_ms": None if gpu_ms is None else 1000 / graphs - gpu_ms,
                "gpu_roofline": None if not gpu_ms else per_token / (gpu_ms / 1000) / bandwidth,
                "ttft_1k_ms": ttft_1k, "prefill_in_decode_steps": ttft_1k / (1000 / graphs),
                "graphs": state, "op_by_op_extra_ms": extra_ms, **quantized, "step_kernels": kernels}
    finally:
        engine.close()
        torch.cuda.empty_cache()


def throughput(config: EngineConfig, requests: int, seed: int = 0) -> dict[str, Any]:
    """nano-vllm's benchmark shape: random 100-1,024 prompt and output tokens, all submitted at
    once, ignore_eos; output tokens over the wall time from first submit to last token."""
    rng = random.Random(seed)
    engine = Engine(replace(config, model=THROUGHPUT_SHAPE, telemetry=False, max_num_seqs=256,
                            max_model_len=4096), say=lambda m: None)
    try:
        vocab = engine.model_config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 1024))] for _ in range(requests)]
        params = [SamplingParams(max_tokens=rng.randint(100, 1024), temperature=0.6, ignore_eos=True)
                  for _ in range(requests)]
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))          # warm-up
        t0 = time.perf_counter()
        done = engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        out = sum(len(c.token_ids) for c in done)
        return {"model": THROUGHPUT_SHAPE, "requests": requests, "prompt_tokens": sum(map(len, prompts)),
                "output_tokens": out, "seconds": seconds, "output_tok_s": out / seconds,
                "op_by_op_extra_ms": _op_by_op_extra_ms(engine),
                "errors": sum(c.finish_reason == "error" for c in done), "reference": NANO_VLLM}
    finally:
        engine.close()
        torch.cuda.empty_cache()


def parts(config: EngineConfig, quick: bool, progress: Progress) -> Iterator[tuple[str, Any]]:
    """The suite's sections as they are measured (a caller may keep each before the next):
    bandwidth, the decode rows and each shape's kernels a step (again after each shape),
    throughput, then the goals."""
    if not torch.cuda.is_available() or config.device == "cpu":
        raise InvalidRequest("pdchat bench gpu measures a CUDA GPU, and torch sees none here")
    config = replace(config, device="cuda" if config.device == "auto" else config.device)
    device = torch.device(config.device)
    yield "model", ", ".join(SHAPES)
    yield "device", torch.cuda.get_device_name(device)
    progress("bandwidth", 0.0)
    bandwidth = copy_bandwidth(device)
    yield "bandwidth", {"copy_gb_s": bandwidth / 1e9, "method": "device-to-device copy of 1 GiB, read + written"}
    rows: list[dict[str, Any]] = []
    kernels: list[dict[str, Any]] = []
    for i, model in enumerate(SHAPES):
        row = shape_row(model, config, bandwidth, quick, progress, (i + 0.1) / (len(SHAPES) + 1))
        kernels += [{"model": model, **k} for k in row.pop("step_kernels")]
        rows.append(row)
        yield "decode", {"rows": list(rows)}
        yield "step_kernels", {"rows": list(kernels)}
    progress("throughput", len(SHAPES) / (len(SHAPES) + 1))
    yield "throughput", throughput(config, 32 if quick else 256)
    progress("done", 1.0)
    yield "goals", goals({r["model"]: r for r in rows})


def goals(by: dict[str, dict[str, Any]]) -> dict[str, Any]:
    one_b, small = by["random:llama-1b"], by["random:smollm2-135m"]
    return {
        "1b_roofline": one_b["roofline"], "1b_roofline_goal": GOALS["roofline_1b"],
        "1b_roofline_met": one_b["roofline"] >= GOALS["roofline_1b"],
        "1b_vs_hf": one_b["vs_hf"], "1b_vs_hf_goal": GOALS["hf_1b"],
        "1b_vs_hf_met": (one_b["vs_hf"] or 0) >= GOALS["hf_1b"],
        "135m_tok_s": small["decode_tok_s"], "135m_goal": GOALS["decode_135m"],
        "135m_met": small["decode_tok_s"] >= GOALS["decode_135m"],
    }


def run(config: EngineConfig, *, quick: bool, progress: Progress) -> dict[str, Any]:
    return dict(parts(config, quick, progress))
