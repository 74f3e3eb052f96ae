"""Kernels of one transformer forward over the paged KV cache, in three backends.

`reference` holds the pure-PyTorch versions: they define the semantics, run anywhere, and are the
oracle for the others. `triton_attention` replaces the attention ops on GPUs, `triton_layers`
the norms, rope and the MLP's activation, `triton_quant` the int8 weight-only product,
`triton_decode` a whole one-row decode step in few launches; `cpu` (C, built on
first use) replaces all of them for small batches on CPUs. Triton and the C build are optional, so
both are imported only when asked for.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

from . import reference
from .reference import paged_attention, store_kv

OPS = ("store_kv", "paged_attention", "rms_norm", "add_rms_norm", "rope", "silu_mul",
       "linear", "linear_int8", "pack_int8", "unpack_int8", "int8_supported", "linear_int4",
       "exact_int8_blocks", "linear_exact_int8", "exact_q4_blocks", "linear_exact_q4", "prepare_layers",
       "run_layers", "tile_seconds", "decode_forward", "greedy")
BACKENDS = ("torch", "triton", "cpu")


def choose(name: str, device_type: str, fp32: bool) -> str:
    """The backend for a request ("auto" or a name): auto is the Triton kernels on CUDA, the C
    kernels for fp32 on CPU, plain PyTorch otherwise. Raises ValueError for an impossible one."""
    if name == "auto":
        return "triton" if device_type == "cuda" else "cpu" if device_type == "cpu" and fp32 else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r} (auto, {', '.join(BACKENDS)})")
    if name == "cpu" and not (device_type == "cpu" and fp32):
        raise ValueError("the cpu kernels run fp32 on the CPU only")
    if name == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton kernels run on a CUDA GPU (TRITON_INTERPRET=1 interprets them on the "
                         "CPU, slowly, for tests)")
    return name


def load(name: str, cache_dir: Path | None = None) -> SimpleNamespace:
    """The ops of a backend: its own where it has them, the reference's elsewhere.

    Raises ImportError (no Triton) or cpu.KernelsUnavailable (no compiler, failed build)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r} ({', '.join(BACKENDS)})")
    own: list[object] = []
    if name == "triton":
        from . import triton_attention, triton_decode, triton_layers, triton_quant
        own = [triton_attention, triton_layers, triton_quant, triton_decode]
    elif name == "cpu":
        from . import cpu
        if cache_dir is None:
            raise ValueError("the cpu backend needs a cache folder for its build")
        own = [cpu.CpuKernels(cpu.library(cache_dir))]
    ops = {op: next((getattr(o, op) for o in own if hasattr(o, op)), getattr(reference, op)) for op in OPS}
    fast_rows = next((o.fast_rows for o in own if hasattr(o, "fast_rows")), None)
    return SimpleNamespace(name=name, fast_rows=fast_rows, **ops)


class FastRows(NamedTuple):
    """A backend's fast path for small forwards (a CPU's one-call forward), as the scheduler's time
    budget needs to know it: past `limit` rows a step costs more than its rows say, and within it
    the products' cost rises by whole vectors of `granule` rows (with 8, 17 rows cost what 24
    do; the step cost model charges them so, engine/step_cost.py)."""
    limit: int
    granule: int


__all__ = ["BACKENDS", "FastRows", "OPS", "choose", "load", "paged_attention", "store_kv"]
