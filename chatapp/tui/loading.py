"""Loading a backend off the UI thread; the app hears of it through messages.

A plain daemon thread, not a Textual thread worker: a load cannot be interrupted (a download, a
conversion), and Textual joins its worker threads on exit, so a hang-up or Ctrl+Q during a load
would wait for it to finish.
"""
from __future__ import annotations

import threading

from textual.app import App
from textual.message import Message

from pdchat.chatapp.backends.base import Backend


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


def _load(app: App, backend: Backend) -> None:
    error = None
    try:
        backend.load(lambda line: _post(app, LoadProgress(backend, line)))
    except Exception as e:                      # shown to the user, never fatal
        error = str(e) or type(e).__name__
    if not _post(app, BackendLoaded(backend, error)):
        backend.close()               # loaded for an app that has ended: give its memory back
