"""Switching models: the new backend loads beside the old one, which keeps serving; it replaces
the old one only once ready, and the old one is then closed (after the replies it streams)."""
from __future__ import annotations

import threading

import pytest

from tests.doubles.fake_backend import FakeBackend
from pdchat.chatapp.tui.widgets.messages import MessageView

from .helpers import idle, ready, send, wait_for

pytestmark = pytest.mark.anyio

SIZE = (120, 40)


class Backend(FakeBackend):
    """Records close(); a closed one refuses to stream. `gate` holds load() until set."""

    def __init__(self, *, gate: threading.Event | None = None, **kw):
        super().__init__(**kw)
        self.gate = gate
        self.closed = False

    def load(self, progress) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        super().load(progress)

    def close(self) -> None:
        self.closed = True
        self.loaded = False


def status(app) -> str:
    return str(app.chat.query_one("#status").render())


def errors(app) -> list[str]:
    return [n.message for n in app._notifications if n.severity == "error"]


async def chat_once(pilot, text: str) -> str:
    await send(pilot, text)
    await idle(pilot)
    return [v.content for v in pilot.app.chat.query(MessageView)][-1]


@pytest.mark.parametrize("failure", ["factory raises", "load fails"])
async def test_failed_switch_keeps_the_old_model(make_app, failure):
    old = Backend(model="good-model", replies=["from the old model"])
    made: list[Backend] = []

    def factory(model: str) -> Backend:
        if failure == "factory raises":
            raise ValueError(f"no such backend for {model}")
        made.append(Backend(model=model, load_error=f"no such model: {model}"))
        return made[-1]

    app = make_app(old, backend_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.switch_model("good-modle")
        await wait_for(pilot, lambda: errors(app))
        await pilot.pause(0.05)
        assert "good-modle" in errors(app)[0]
        assert app.backend is old and not old.closed and app.ready and app.incoming is None
        assert app.sub_title == "good-model" and status(app) == "good-model ready"
        assert app.store.get_setting("model") is None
        assert all(b.closed for b in made)            # the failed one gives back what it took
        assert await chat_once(pilot, "still there?") == "from the old model"


async def test_switch_replaces_and_closes_the_old_model_once_the_new_one_is_ready(make_app):
    old = Backend(model="first", replies=["from first"])
    gate = threading.Event()
    new = Backend(model="second", replies=["from second"], gate=gate)
    app = make_app(old, backend_factory=lambda model: new)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.switch_model("second")
        await pilot.pause(0.1)
        assert status(app) == "loading second…"
        # while the new model loads, the old one keeps answering
        assert await chat_once(pilot, "who answers?") == "from first"
        assert app.backend is old and not old.closed
        gate.set()
        await wait_for(pilot, lambda: app.backend is new)
        assert old.closed and app.ready and app.sub_title == "second"
        assert app.store.get_setting("model") == "second" and status(app) == "second ready"
        assert await chat_once(pilot, "and now?") == "from second"


async def test_old_model_closes_only_after_its_running_reply(make_app):
    old = Backend(model="first", hold="decode:2", replies=["one two three"])
    new = Backend(model="second")
    app = make_app(old, backend_factory=lambda model: new)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "count")
        await wait_for(pilot, old.held.is_set)
        app.switch_model("second")
        await wait_for(pilot, lambda: app.backend is new)
        assert not old.closed                          # it is still streaming
        old.release()
        await idle(pilot)
        await wait_for(pilot, lambda: old.closed)      # the app hears of the reply's end by a message
        reply = app.store.messages(app.chat.conv_id)[-1]
        assert (reply.content, reply.status) == ("one two three", "done")


def test_a_switched_model_gets_the_toggles_as_they_are_now(monkeypatch):
    """run_app's factory builds the next backend from the toggles the user has now, not those of
    the start, and keeps the command line's other engine flags."""
    from pdchat.chatapp.tui import app as app_module
    from pdchat.chatapp.backends.base import Toggles
    made = {}

    class RecordingApp:
        def __init__(self, backend, store, *, toggles, backend_factory, **kw):
            self.backend, self.toggles, self.factory, self.return_code = backend, toggles, backend_factory, 0

        def run(self):
            self.toggles = Toggles.from_dict({**self.toggles.to_dict(), "kv_cache": False, "chunk_size": 64,
                                              "spec": "ngram"})
            made["next"] = self.factory("random:tiny-qwen2")

    monkeypatch.setattr(app_module, "PdchatApp", RecordingApp)
    assert app_module.run_app({"model": "random:tiny", "threads": 1}, {}) == 0
    nxt = made["next"]
    assert nxt.model == "random:tiny-qwen2"
    assert {k: nxt.engine_options[k] for k in ("kv_cache", "chunk_size", "spec", "threads")} == \
        {"kv_cache": False, "chunk_size": 64, "spec": "ngram", "threads": 1}


async def test_a_reply_that_ends_during_the_exit_still_closes_the_replaced_backend(make_app):
    # The screen posts ReplyFinished; the app may read it after the chat screen is gone (a reply
    # ending as the user quits). It must neither need the screen nor leave a backend open.
    from pdchat.chatapp.tui.screens.replies import ReplyFinished
    old = Backend(model="first")
    app = make_app(old)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
    app.retired.append(old)
    assert app.closing
    await app.on_reply_finished(ReplyFinished(1))
    assert old.closed and app.retired == []
