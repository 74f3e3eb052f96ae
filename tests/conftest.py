"""Shared fixtures. Engines on random: models are cheap; the default model is loaded once."""
from __future__ import annotations

import os

# Two test workers on two cores (make test), each with as many OpenMP threads as cores: a thread
# that spins while it waits, OpenMP's default, holds a core the other worker needs, and each small
# parallel op then waits out a time slice (a sampling test took 39 s beside a busy core instead of
# 9; with passive waiting 11: 2-core AMD EPYC, 2026-11-28). Read when OpenMP loads: before torch.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest_plugins = ["tests.kernel_variants"]     # the summary of the CPU kernel variants tested

# Without a GPU the Triton kernels run in Triton's interpreter (kernel tests at toy sizes, and the
# decode-graph tests). It must be set before any kernel module is imported: @triton.jit reads it
# at decoration.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_engine():
    """The real default model (fetched and converted on first use), fp32 on CPU."""
    from pdchat.engine import Engine
    engine = Engine(model="smollm2-135m", device="cpu", telemetry=False)
    yield engine
    engine.close()


@pytest.fixture
def tiny_engine():
    from pdchat.engine import Engine
    engine = Engine(model="random:tiny", device="cpu", telemetry=False, kv_cache_mb=16)
    yield engine
    engine.close()


POISON_TEMPERATURE = 0.777    # requests at this temperature get NaN logits under `poisoned_sampling`


@pytest.fixture
def poisoned_sampling(monkeypatch) -> float:
    """An engine fault for one kind of request: rows sampled at POISON_TEMPERATURE get NaN logits
    (what a numerically broken request would give). Returns that temperature."""
    from pdchat.engine import engine as engine_module
    from pdchat.engine.sampler import sample

    def poisoned(logits, params, generators, argmax=None, **kernels_greedy):
        rows = [row for row, p in enumerate(params) if p.temperature == POISON_TEMPERATURE]
        if not rows:
            return sample(logits, params, generators, argmax, **kernels_greedy)
        logits = logits.clone()
        logits[rows] = float("nan")
        return sample(logits, params, generators)       # (a graph's argmax is of the logits before)

    monkeypatch.setattr(engine_module, "sample", poisoned)
    return POISON_TEMPERATURE
