"""Loading a backend off the UI thread; the app hears of it through messages.

A plain daemon thread, not a Textual thread worker: a load cannot be interrupted (a download, a
conversion), and Textual joins its worker threads on exit, so a hang-up or Ctrl+Q during a load
would wait for it to finish. The loader's phase lines ("fetching … (93 MB)", "converting …") come
up as they are said, then again every TICK_S with the time taken so far: the loader does not
report bytes, and a long phase must still show that it moves.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from textual.app import App
from textual.message import Message

from pdchat.chatapp.backends.base import Backend

TICK_S = 1.0


class LoadProgress(Message):
    def __init__(self, backend: Backend, line: str):
        super().__init__()
        self.backend = backend
        self.line = line


class BackendLoaded(Message):
    """The load ended; `error` is a readable line, or None when the backend is ready."""

    def __init__(self, backend: Backend, error: str | None):
        super().__init__()
        self.backend = backend
        self.error = error


def start_load(app: App, backend: Backend) -> None:
    threading.Thread(target=_load, args=(app, backend), daemon=True, name="pdchat-load").start()


def _post(app: App, message: Message) -> bool:
    """Post from this thread; False once the app has stopped (nobody will read it)."""
    try:
        return app.post_message(message)
    except RuntimeError:              # the event loop is already closed
        return False


class PhaseLines:
    """The load's progress callback: posts each phase line, and with tick() the current one again
    with the seconds the load has taken ("converting … 12 s")."""

    def __init__(self, app: App, backend: Backend, clock: Callable[[], float] = time.monotonic):
        self.app, self.backend, self.clock = app, backend, clock
        self.start = clock()
        self.line = ""
        self.lock = threading.Lock()      # a tick never posts an older line after a newer one
        self.done = threading.Event()

    def __call__(self, line: str) -> None:
        with self.lock:
            self.line = line
            _post(self.app, LoadProgress(self.backend, line))

    def tick(self) -> bool:
        """Post the current line with the time so far; False once nobody reads it."""
        with self.lock:
            if self.done.is_set():
                return False
            if not self.line:
                return True
            line = f"{self.line} {self.clock() - self.start:.0f} s"
            return _post(self.app, LoadProgress(self.backend, line))

    def tick_until_done(self) -> None:
        while not self.done.wait(TICK_S) and self.tick():
            pass


def _load(app: App, backend: Backend) -> None:
    error = None
    lines = PhaseLines(app, backend)
    threading.Thread(target=lines.tick_until_done, daemon=True, name="pdchat-load-tick").start()
    try:
        backend.load(lines)
    except Exception as e:                      # shown to the user, never fatal
        error = str(e) or type(e).__name__
    with lines.lock:                            # no tick after this: "ready" must stay the last word
        lines.done.set()
    if not _post(app, BackendLoaded(backend, error)):
        backend.close()               # loaded for an app that has ended: give its memory back
