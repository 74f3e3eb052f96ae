"""Snapshot tests (pytest-textual-snapshot) with the scripted FakeBackend and its fake clock.

Update after an intended visual change: .venv/bin/pytest tests/chatapp/test_snapshots.py --snapshot-update
"""
from __future__ import annotations

import pytest

from pdchat.chatapp.tui.widgets import conversations
from tests.doubles.fake_backend import FakeBackend

from .helpers import idle, ready, send, wait_for

LONG_PROMPT = " ".join(f"word{i}" for i in range(120))   # 492 prompt tokens: held halfway through the layers


@pytest.fixture(autouse=True)
def _fixed_wall_clock(monkeypatch):
    # The conversation list shows when each chat's last message came (wall-clock time): fixed
    # here, or every snapshot would change from one minute to the next.
    monkeypatch.setattr(conversations, "when", lambda updated, now=None: "12:00")


def start(**kw):
    async def run_before(pilot):
        await ready(pilot)
        await pilot.pause(0.3)
    return run_before


def sending(text: str, held: bool = True, finish: bool = False):
    async def run_before(pilot):
        await ready(pilot)
        await send(pilot, text)
        backend = pilot.app.backend
        if held:
            await wait_for(pilot, backend.held.is_set)
        if finish:
            await idle(pilot)
        await pilot.pause(0.4)          # a few panel refreshes
    return run_before


def test_empty_start(snap_compare, make_app):
    assert snap_compare(make_app(FakeBackend()), terminal_size=(160, 48), run_before=start())


def test_prefill_in_progress(snap_compare, make_app):
    app = make_app(FakeBackend(hold="prefill"))
    assert snap_compare(app, terminal_size=(160, 48), run_before=sending(LONG_PROMPT))


def test_decoding(snap_compare, make_app):
    app = make_app(FakeBackend(hold="decode:9"))
    assert snap_compare(app, terminal_size=(160, 48), run_before=sending("Show me some Python"))


def test_finished_reply_with_summary_cpu_panel(snap_compare, make_app):
    app = make_app(FakeBackend())
    assert snap_compare(app, terminal_size=(160, 48),
                        run_before=sending("Show me some Python", held=False, finish=True))


def test_finished_reply_gpu_panel(snap_compare, make_app):
    app = make_app(FakeBackend(gpu=True))
    assert snap_compare(app, terminal_size=(160, 48),
                        run_before=sending("Show me some Python", held=False, finish=True))


def test_toggles_open(snap_compare, make_app):
    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("ctrl+t")
        await pilot.pause(0.3)
    app = make_app(FakeBackend(capabilities={"spec": False, "quant": False}))
    assert snap_compare(app, terminal_size=(160, 48), run_before=run_before)


def test_narrow_80x24_decoding(snap_compare, make_app):
    app = make_app(FakeBackend(hold="decode:5"))
    assert snap_compare(app, terminal_size=(80, 24), run_before=sending("Short question"))
