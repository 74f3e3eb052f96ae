"""Kernel tests run Triton's interpreter on CPU when there is no GPU (toy sizes, see the tests;
tests/conftest.py sets the switch).

The C kernels are tested in every variant this CPU can run; the summary at the end of the run
says which variants were built and tested here and why the others were not.
"""
import pytest

_outcome: dict[str, str] = {}


def record_variant(name: str, outcome: str) -> None:
    """Say how a kernel variant fared here, for the summary at the end (test_arm_kernels runs
    the aarch64 build under qemu, outside the `ops` fixture)."""
    _outcome[name] = outcome


def _variants() -> list[str]:
    from pdchat.kernels.cpu import INT8_PATHS
    return [p.name for p in INT8_PATHS]


@pytest.fixture(scope="module", params=_variants())
def ops(request, tmp_path_factory):
    """The C kernels built with one int8 path; a path this CPU or compiler cannot run is skipped,
    visibly (the portable path runs everywhere)."""
    from pdchat.kernels import cpu
    path = next(p for p in cpu.INT8_PATHS if p.name == request.param)
    missing = cpu.missing_flags(path)
    if missing:
        _outcome.setdefault(path.name, f"not run: this CPU has no {' '.join(missing)}")
        pytest.skip(f"{path.name} kernels: this CPU has no {' '.join(missing)}, so they are neither compiled nor run here")
    try:
        lib = cpu.library(tmp_path_factory.mktemp("kernels"), int8=path.name)
    except cpu.KernelsUnavailable as e:
        _outcome[path.name] = f"not run: the compiler did not build it ({e})"
        pytest.skip(f"{path.name} kernels: {e}")
    assert cpu.int8_path(lib) == path           # the build runs the path it was asked for
    _outcome[path.name] = "built and tested"
    return cpu.CpuKernels(lib)


def pytest_terminal_summary(terminalreporter):
    if not _outcome:
        return
    from pdchat.engine.telemetry import cpu_model_name
    from pdchat.kernels.cpu import cpu_flags
    model = cpu_model_name() or "unknown CPU"
    simd = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "asimd", "neon", "sve")))) or "none"
    terminalreporter.write_line(f"CPU kernel variants on {model} (SIMD flags: {simd}):")
    for name in _variants():
        terminalreporter.write_line(f"  {name:12s} {_outcome.get(name, 'not run: no test used it')}")
