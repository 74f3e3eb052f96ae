"""The prefill worker as a process, seen from the engine: started as a separate interpreter (`python
-m`, not multiprocessing's spawn, which would run the caller's main script again in the child),
talked to over its control pipe, its messages read on a thread of their own, and stopped.

What the thread reads it posts to the engine's step loop as it is, K/V hand-offs once the receiver
has them ("handoff"), and ("lost", why) when the pipe closes, each as `post("disagg", (this
worker, message))`: a worker stopped a moment ago still says "lost", and the engine must not take
that for its new worker's.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

from ..config import EngineConfig
from .link import KvReceiver
from .prefill_worker import log_file


class WorkerProcess:
    def __init__(self, receiver: KvReceiver, post: Callable[[str, Any], None]):
        self.receiver, self._post = receiver, post
        self.process: Any = None
        self.control: Any = None

    def start(self, cfg: EngineConfig, cores: list[int]) -> None:
        """Spawn the worker. Separate from __init__ so the engine holds this object before the
        worker can say anything (its messages are checked against the worker the engine holds)."""
        receiver = self.receiver
        ours, theirs = socket.socketpair()
        fds = [theirs.fileno()] + ([receiver.worker_fd] if receiver.worker_fd is not None else [])
        # The child finds pdchat where this process found it (an installed package or a checkout).
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        with open(log_file(), "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pdchat.engine.disaggregation.prefill_worker", *map(str, fds)],
                pass_fds=fds, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True)           # the terminal's Ctrl-C is the engine's to handle
        for fd in fds[1:]:
            os.close(fd)
        theirs.close()
        self.control = Connection(ours.detach())
        self.send((cfg, cores, receiver.spec))               # (a worker gone already is "lost")
        threading.Thread(target=self._read, daemon=True, name="pdchat-kv-receiver").start()

    def send(self, message: tuple) -> None:
        try:
            self.control.send(message)
        except (BrokenPipeError, OSError) as e:
            self._say(("lost", f"it cannot be reached: {e}"))

    def stop(self, wait_s: float = 10.0) -> None:
        """Ask the worker to stop (kill it after `wait_s`) and close both ends."""
        self.send(("stop",))
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.control.close()
        self.receiver.close()

    def _read(self) -> None:
        """Until the pipe closes: K/V arrive through the receiver (and its simulated link),
        everything else is posted as it is."""
        try:
            while True:
                message = self.control.recv()
                if message[0] == "kv":
                    self._say(("transfer", message[1], message[5]))
                    message = ("handoff", self.receiver.receive(message))
                self._say(message)
        except (EOFError, OSError) as e:
            self._say(("lost", f"its connection closed: {type(e).__name__}"))

    def _say(self, message: tuple) -> None:
        self._post("disagg", (self, message))
