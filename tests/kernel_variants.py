"""Which CPU kernel variants this run built and tested, said in one summary at the end.

A pytest plugin that tests/conftest.py loads: with test workers (`make test` runs two) the kernel
tests run in the workers, each records what its tests did and hands it to the controlling
process at its end, and that process writes the one summary.
"""
from __future__ import annotations

import pytest

_outcome: dict[str, str] = {}
_KEY = "pdchat_kernel_variants"


def record_variant(name: str, outcome: str, first_only: bool = False) -> None:
    """Say how a kernel variant fared here (`first_only`: unless something was said already)."""
    if first_only:
        _outcome.setdefault(name, outcome)
    else:
        _outcome[name] = outcome


def variants() -> list[str]:
    from pdchat.kernels.cpu import INT8_PATHS
    return [p.name for p in INT8_PATHS]


def pytest_sessionfinish(session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)    # set in a test worker only
    if workeroutput is not None:
        workeroutput[_KEY] = dict(_outcome)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """A worker finished: take what it says of each variant (a variant one worker tested counts as
    tested, whatever another could not do)."""
    for name, outcome in getattr(node, "workeroutput", {}).get(_KEY, {}).items():
        if not _outcome.get(name, "").startswith("built"):
            _outcome[name] = outcome


def pytest_terminal_summary(terminalreporter) -> None:
    if not _outcome:
        return
    from pdchat.engine.telemetry import cpu_model_name
    from pdchat.kernels.cpu import cpu_flags
    model = cpu_model_name() or "unknown CPU"
    simd = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "asimd", "neon", "sve")))) or "none"
    terminalreporter.write_line(f"CPU kernel variants on {model} (SIMD flags: {simd}):")
    for name in variants():
        terminalreporter.write_line(f"  {name:12s} {_outcome.get(name, 'not run: no test used it')}")
