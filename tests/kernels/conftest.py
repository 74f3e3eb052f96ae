"""Kernel tests run Triton's interpreter on CPU when there is no GPU (toy sizes, see the tests).

The switch must be set before any kernel module is imported: @triton.jit reads it at decoration.

The C kernels are tested in every variant this CPU can run; the summary at the end of the run
says which variants were built and tested here and why the others were not.
"""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# name -> (build as portable?, the CPU flag it needs or None, does the build really use it?)
CPU_VARIANTS = {
    "avx512-vnni": (False, "avx512_vnni", lambda lib: lib.pd_has_vnni() == 1),
    "portable": (True, None, lambda lib: lib.pd_has_vnni() == 0),
}
_outcome: dict[str, str] = {}


def _cpu() -> tuple[str, set[str]]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU", set()
    model = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), "unknown CPU")
    flags = next((set(l.split(":", 1)[1].split()) for l in lines if l.startswith(("flags", "Features"))), set())
    return model, flags


@pytest.fixture(scope="module", params=list(CPU_VARIANTS))
def ops(request, tmp_path_factory):
    """The C kernels in one variant; a variant this CPU or compiler cannot run is skipped, visibly."""
    from pdchat.kernels import cpu
    name = request.param
    portable, flag, really = CPU_VARIANTS[name]
    if flag is not None and flag not in _cpu()[1]:
        _outcome[name] = f"not run: this CPU has no {flag}"
        pytest.skip(f"{name} kernels: this CPU has no {flag}, so they are neither compiled nor run here")
    lib = cpu.library(tmp_path_factory.mktemp("kernels"), portable=portable)
    if not really(lib):
        _outcome[name] = "not run: the compiler did not build its code path"
        pytest.skip(f"{name} kernels: the compiler did not build this code path")
    _outcome[name] = "built and tested"
    return cpu.CpuKernels(lib)


def pytest_terminal_summary(terminalreporter):
    if not _outcome:
        return
    model, flags = _cpu()
    simd = " ".join(sorted(f for f in flags if f.startswith(("avx", "fma", "asimd", "neon", "sve")))) or "none"
    terminalreporter.write_line(f"CPU kernel variants on {model} (SIMD flags: {simd}):")
    for name in CPU_VARIANTS:
        terminalreporter.write_line(f"  {name:12s} {_outcome.get(name, 'not run: no test used it')}")
