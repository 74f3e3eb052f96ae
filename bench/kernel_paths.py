"""The quantized products on every path this CPU runs (`pdchat bench baseline`'s `kernel_paths`
section).

The engine runs the best path its build has; this times the others beside it on matrices of the
loaded model's shapes: every product of one decode step (each linear layer and the LM head once,
one token), in fp32, in fp32 held as exact Q4 blocks (the default model's layers' form: the same
numbers from 6 bits a weight) and in int8 and int4 on each path, in interleaved rounds. The matrices are
random (the engine holds its weights in one precision only, and the speed of a product does not
depend on the values); the products are most of a decode step on a CPU, so their ratios say what
each instruction set buys. The engine's end-to-end figures are the `decode` section's.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from pdchat.engine import paths, quant
from pdchat.kernels import cpu, reference
from pdchat.bench import median, ratio

CALLS_PER_SAMPLE = 20         # decode steps' worth of products per timing


def _step_ms(products: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS_PER_SAMPLE):
        products()
    return (time.perf_counter() - t0) * 1000 / CALLS_PER_SAMPLE


def step_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(out, in) of every matrix one decode step multiplies by."""
    names = {id(m): name for name, m in quant.quantized_layers(model).items()}
    return [model.param_shapes[names[id(m)] + ".weight"] for m in quant.step_linears(model)]


def section(engine: Any, rounds: int) -> dict[str, Any]:
    """Milliseconds for one decode step's products per path and format, or the reason there are none."""
    if engine.device.type != "cpu":
        return {"reason": "the C kernels run on CPU only"}
    runnable = cpu.runnable_int8_paths()
    builds = {}
    for p in runnable:
        try:
            builds[p.title] = cpu.CpuKernels(cpu.library(paths.cache_dir(), int8=p.name))
        except cpu.KernelsUnavailable as e:
            builds[p.title] = str(e)
    ready = {title: ops for title, ops in builds.items() if isinstance(ops, cpu.CpuKernels)}
    if not ready:
        return {"reason": "no C kernels could be built: " + "; ".join(map(str, builds.values()))}
    runs = _products(step_shapes(engine.loaded.model), ready, engine.loaded.quant.ops)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()                                       # warm-up: caches, page faults, pool threads
    for _ in range(rounds):
        for name, fn in runs.items():
            samples[name].append(_step_ms(fn))
    fp32 = median(samples["fp32"])
    rows = [{"path": name, "products_ms_per_step": median(s), "speed_vs_fp32": ratio(fp32, median(s))}
            for name, s in samples.items()]
    return {"rows": rows, "engine_uses": cpu.int8_path(cpu.library(paths.cache_dir())).title,
            "not_built": "; ".join(f"{t}: {e}" for t, e in builds.items() if t not in ready) or None,
            "not_on_this_cpu": ", ".join(p.title for p in cpu.INT8_PATHS if p not in runnable) or None}


def _products(shapes: list[tuple[int, int]], builds: dict[str, cpu.CpuKernels],
              engine_ops: Any) -> dict[str, Callable[[], None]]:
    """One decode step's products per (path, format): fp32 once, fp32 in exact Q4 blocks with the
    engine's build (the products are fp32 arithmetic: one path), int8 and int4 per path (int8 is
    packed by each path's build; the int4 form is the same for all)."""
    gen = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    x = [torch.randn(1, k, generator=gen) for _, k in shapes]
    int8 = [quant.quantize_int8(w) for w in fp32]
    int4 = [quant.quantize_int4(w) if quant.fits("int4", w) else None for w in fp32]
    any_ops = next(iter(builds.values()))
    runs: dict[str, Callable[[], None]] = {"fp32": lambda: [any_ops.linear(a, w) for a, w in zip(x, fp32)]}
    exact = [engine_ops.exact_q4_blocks(reference.q4_1_weights(w)) if w.shape[1] % reference.EXACT_BLOCK == 0
             else None for w in fp32]
    if all(e is not None for e in exact):           # the engine's backend holds the form (the C kernels)
        runs["fp32 in exact Q4 blocks"] = lambda: [engine_ops.linear_exact_q4(a, *e) for a, e in zip(x, exact)]
    for title, ops in builds.items():
        packed = [ops.pack_int8(q, s, torch.float32) for q, s in int8]
        runs[f"int8 {title}"] = lambda ops=ops, packed=packed: [
            ops.linear_int8(a, q, s) for a, (q, s) in zip(x, packed)]
        # A matrix too narrow for int4 runs int8, as in the engine.
        runs[f"int4 {title}"] = lambda ops=ops, packed=packed: [
            ops.linear_int4(a, *q4) if q4 is not None else ops.linear_int8(a, *q8)
            for a, q4, q8 in zip(x, int4, packed)]
    return runs
