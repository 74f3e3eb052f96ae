"""The engine's background thread: it sleeps until there is work, takes what other threads posted
(new requests, cancels), and runs one step at a time under a lock.

Only this thread touches scheduler and block state while it runs; other threads post messages, or
take `lock` for a consistent view between two steps (a toggle change, a probe of the pool).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class StepLoop:
    def __init__(self, *, step: Callable[[], Any], has_work: Callable[[], bool],
                 handlers: dict[str, Callable[[Any], None]], on_step_error: Callable[[Exception], None],
                 on_stop: Callable[[], None]):
        self._step = step
        self._has_work = has_work
        self._handlers = handlers              # posted message kind -> what takes its argument
        self._on_step_error = on_step_error    # a step raised: the loop goes on
        self._on_stop = on_stop                # last call on the thread, after stop()
        self.lock = threading.RLock()          # one step, or one settings change, at a time
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pdchat-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def post(self, kind: str, arg: Any) -> None:
        """Hand a message to the loop thread (from any thread)."""
        self._inbox.put((kind, arg))
        self._wake.set()

    def stop(self, timeout: float = 30) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        while True:
            with self.lock:            # handlers change engine state, as Engine.update may from another thread
                self._drain()
            if self._stopping:
                self._on_stop()
                return
            if not self._has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            with self.lock:
                try:
                    self._step()
                except Exception as e:   # a failed step must not kill the engine
                    self._on_step_error(e)

    def _drain(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handlers[kind](arg)
