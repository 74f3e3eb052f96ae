"""Full garbage collections only at quiet moments (chatapp/tui/heap.py), with a recording collector."""
from __future__ import annotations

import threading

import pytest

from pdchat.chatapp.tui.heap import NEVER, HeapKeeper
from pdchat.chatapp.tui.screens.lab import LabScreen
from tests.doubles.fake_backend import FakeBackend
from tests.doubles.fake_collector import FakeCollector

from .helpers import idle, ready, send, wait_for

pytestmark = pytest.mark.anyio

SETTLE = ["unfreeze", "collect", "freeze"]


class Keeper(HeapKeeper):
    """A keeper whose `busy` a test sets."""

    def __init__(self):
        super().__init__(lambda: self.streaming, FakeCollector())
        self.streaming = False


def started() -> Keeper:
    keeper = Keeper()
    keeper.start()
    return keeper


def test_automatic_full_collections_are_off_until_stop_and_the_young_ones_keep_their_thresholds():
    keeper = started()
    assert keeper.gc.threshold == (700, 10, NEVER)
    keeper.stop()
    assert keeper.gc.threshold == (700, 10, 10) and keeper.gc.calls == ["unfreeze"]


def test_a_full_collection_runs_only_when_due_and_nothing_streams_or_measures():
    keeper = started()
    assert not keeper.tidy()                        # no middle-generation collection since the last full one
    keeper.gc.count[2] = 2
    keeper.streaming = True
    assert not keeper.tidy()
    keeper.streaming, keeper.measuring = False, 1
    assert not keeper.tidy()
    assert keeper.gc.calls == []
    keeper.measuring = 0
    assert keeper.tidy() and keeper.gc.calls == ["collect"]
    assert not keeper.tidy()                        # (the count starts again)


def test_a_model_change_refreezes_at_the_first_quiet_moment():
    keeper = started()
    keeper.streaming = True
    keeper.model_changed()
    assert keeper.gc.calls == []
    keeper.streaming = False
    assert keeper.tidy() and keeper.gc.calls == SETTLE
    assert not keeper.tidy()                        # once
    keeper.model_changed()
    assert keeper.gc.calls == SETTLE * 2


def test_nothing_is_collected_before_start():
    keeper = Keeper()
    keeper.gc.count[2] = 5
    keeper.model_changed()
    assert keeper.gc.calls == []


async def test_the_app_freezes_after_its_load_and_collects_only_between_replies(make_app):
    backend = FakeBackend(hold="decode:3")
    app = make_app(backend)
    collector = app.heap.gc
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        assert collector.calls == SETTLE and collector.threshold == (700, 10, NEVER)
        await send(pilot, "hello")
        await wait_for(pilot, backend.held.is_set)
        collector.count[2] = 3
        assert not app.heap.tidy()          # a reply streams
        assert collector.calls == SETTLE
        backend.release()
        await idle(pilot)
        app.heap.tidy()                     # (or the app's own timer did it first)
        assert collector.calls == SETTLE + ["collect"]
    assert collector.threshold == (700, 10, 10) and collector.calls[-1] == "unfreeze"


async def test_a_model_switched_during_a_reply_is_refrozen_after_the_old_one_closes(make_app):
    old = FakeBackend(model="first", hold="decode:2", replies=["one two three"])
    new = FakeBackend(model="second")
    app = make_app(old, backend_factory=lambda model: new)
    collector = app.heap.gc
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await send(pilot, "count")
        await wait_for(pilot, old.held.is_set)
        app.switch_model("second")
        await wait_for(pilot, lambda: app.backend is new)
        assert collector.calls == SETTLE                      # the first load's; none while the old one streams
        assert app.retired == [old]
        old.release()
        await idle(pilot)
        await wait_for(pilot, lambda: not app.retired)        # closed once its reply ended
        assert collector.calls == SETTLE * 2                  # the new model and the old one's cycles, once


async def test_no_full_collection_while_the_lab_runs(make_app):
    app = make_app()
    release = threading.Event()

    def runner(progress, quick=False):
        release.wait(5)
        return {"suite": "lab", "model": "scripted", "claims": [], "curves": []}

    async with app.run_test(size=(140, 44)) as pilot:
        await ready(pilot)
        await app.push_screen(LabScreen(runner, load_last=lambda: None))
        await pilot.press("r")
        await wait_for(pilot, lambda: app.heap.measuring == 1)
        app.heap.gc.count[2] = 1
        assert not app.heap.tidy()
        release.set()
        await wait_for(pilot, lambda: not app.screen.running)
        assert app.heap.measuring == 0 and app.heap.tidy()
