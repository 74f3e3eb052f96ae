"""Shared fixtures: a tmp data dir, a store, a FakeBackend and an app factory."""
from __future__ import annotations

import contextlib

import pytest

from pdchat.chatapp.tui.app import PdchatApp
from tests.doubles.fake_backend import FakeBackend
from tests.doubles.fake_collector import FakeCollector
from pdchat.chatapp.tui.store import Store

from .loopback import MODEL


@pytest.fixture(autouse=True)
def _dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PDCHAT_CONFIG_DIR", str(tmp_path / "config"))


@pytest.fixture(scope="module")
def engine():
    """A real engine on a tiny random model, one per test module (the HTTP tests serve it)."""
    from pdchat.engine import Engine
    eng = Engine(model=MODEL, device="cpu", telemetry=False, kv_cache_mb=16)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine):
    """`pdchat serve`'s app over the module's engine on loopback: (base URL, the Server)."""
    from pdchat.chatapp.serve.app import create_app

    from .loopback import running
    app = create_app(engine)
    with running(app) as url:
        yield url, app.state.server


@pytest.fixture(scope="module")
def http(server):
    import httpx
    with httpx.Client(base_url=server[0], timeout=30) as client:
        yield client


@pytest.fixture
def make_app(tmp_path):
    made = []

    def make(backend: FakeBackend | None = None, store: Store | None = None, **kw) -> PdchatApp:
        backend = backend or FakeBackend()
        store = store or Store(tmp_path / "data" / "pdchat.db")
        # The UI thread's CPU time reads as none: streamed text is drawn at every tick of the pump,
        # however busy the test machine (test_draw_pace gives it its own clocks).
        kw.setdefault("cpu_clock", lambda: 0.0)
        # Garbage collections go to a recorder: the real collector stays as it is for the test run.
        kw.setdefault("collector", FakeCollector())
        app = PdchatApp(backend, store, export_dir=tmp_path / "exports", **kw)
        app.clipboard_calls = []
        app.copy_to_clipboard = app.clipboard_calls.append
        made.append(store)
        return app

    yield make
    for store in made:
        with contextlib.suppress(Exception):      # a test may have closed it already
            store.close()


