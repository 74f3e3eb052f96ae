"""Kernel tests run Triton's interpreter on CPU when there is no GPU (toy sizes, see the tests;
tests/conftest.py sets the switch).

The C kernels are tested in every variant this CPU can run; the summary at the end of the run
(tests/kernel_variants.py) says which variants were built and tested here and why the others were not.
"""
import pytest

from tests.kernel_variants import record_variant, variants


@pytest.fixture(scope="module", params=variants())
def ops(request, tmp_path_factory):
    """The C kernels built with one int8 path; a path this CPU or compiler cannot run is skipped,
    visibly (the portable path runs everywhere)."""
    from pdchat.kernels import cpu
    path = next(p for p in cpu.INT8_PATHS if p.name == request.param)
    missing = cpu.missing_flags(path)
    if missing:
        record_variant(path.name, f"not run: this CPU has no {' '.join(missing)}", first_only=True)
        pytest.skip(f"{path.name} kernels: this CPU has no {' '.join(missing)}, so they are neither compiled nor run here")
    try:
        lib = cpu.library(tmp_path_factory.mktemp("kernels"), int8=path.name)
    except cpu.KernelsUnavailable as e:
        record_variant(path.name, f"not run: the compiler did not build it ({e})")
        pytest.skip(f"{path.name} kernels: {e}")
    assert cpu.int8_path(lib) == path           # the build runs the path it was asked for
    record_variant(path.name, "built and tested")
    return cpu.CpuKernels(lib)
