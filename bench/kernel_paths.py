"""The int8 product on every path this CPU runs (`pdchat bench baseline`'s `int8_paths` section).

The engine runs the best path its build has; this times the others beside it on the loaded
model's own weights: every product of one decode step (each linear layer once, one token), in
fp32 and in int8 on each path, in interleaved rounds. The products are most of a decode step on
a CPU, so their ratio says what each instruction set buys; the engine's end-to-end figure is the
`decode_int8` section.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from pdchat.engine import paths
from pdchat.engine.quant import QuantLinear
from pdchat.kernels import cpu
from pdchat.bench import median, ratio

CALLS_PER_SAMPLE = 20         # decode steps' worth of products per timing


def _step_ms(products: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS_PER_SAMPLE):
        products()
    return (time.perf_counter() - t0) * 1000 / CALLS_PER_SAMPLE


def section(engine: Any, rounds: int) -> dict[str, Any]:
    """Milliseconds for one decode step's products per path, or the reason there are none. Run it
    after the engine has run int8 once (its packed weights are what is timed)."""
    if engine.device.type != "cpu":
        return {"reason": "the C kernels run on CPU only"}
    layers = [m for m in engine.loaded.model.modules() if isinstance(m, QuantLinear)]
    if not layers or any(m.qweight is None or m.qweight.dtype != torch.uint8 for m in layers):
        return {"reason": "no int8 weights packed for the C kernels (int8 not run, or other kernels)"}
    runnable = cpu.runnable_int8_paths()
    builds = {}
    for p in runnable:
        try:
            builds[p.title] = cpu.CpuKernels(cpu.library(paths.cache_dir(), int8=p.name))
        except cpu.KernelsUnavailable as e:
            builds[p.title] = str(e)
    ready = {title: ops for title, ops in builds.items() if isinstance(ops, cpu.CpuKernels)}
    if not ready:
        return {"reason": "no int8 path could be built: " + "; ".join(map(str, builds.values()))}
    x = {m: torch.randn(1, m.weight.shape[1]) for m in layers}
    any_ops = next(iter(ready.values()))
    runs: dict[str, Callable[[], None]] = {
        "fp32": lambda: [any_ops.linear(x[m], m.weight) for m in layers]}
    for title, ops in ready.items():
        runs[title] = lambda ops=ops: [ops.linear_int8(x[m], m.qweight, m.scales) for m in layers]
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
