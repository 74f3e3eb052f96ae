"""Shared fixtures. Engines on random: models are cheap; the default model is loaded once."""
from __future__ import annotations

import pytest


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
