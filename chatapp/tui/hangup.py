"""Noticing that the terminal went away (window closed, SSH dropped, tmux session killed).

Textual's LinuxDriver does not: on a hung-up tty its input thread spins (select says readable,
read returns b""), and its writer thread dies on the first EIO, after which the output queue
fills and the UI blocks. The kernel's SIGHUP reaches only the session leader and, once that one
exits, the foreground group; a process behind `make`, which catches SIGHUP and waits for its
children, gets nothing. So HangupDriver watches three ways: SIGHUP, stdin reporting a hang-up
(poll, a few times a second) and a failed write. Whichever comes first posts one HangUp to the
app, which then exits the ordinary way (replies stopped and saved, backend closed). SIGTERM (a
plain `kill`, a session manager logging out) ends the app the same way.
"""
from __future__ import annotations

import asyncio
import select
import signal
import threading
from typing import IO, Callable

from textual.drivers.linux_driver import LinuxDriver
from textual.message import Message

POLL_MS = 250                 # how often stdin is checked for a hang-up
EXIT_CODE = 128 + signal.SIGHUP   # what a shell reports for a process ended by a hang-up


class HangUp(Message):
    """The terminal is gone, or the process was told to end; `reason` says how it was noticed and
    `exit_code` is what a shell reports for a process ended that way."""

    def __init__(self, reason: str, exit_code: int = EXIT_CODE):
        super().__init__()
        self.reason = reason
        self.exit_code = exit_code


class TerminalOutput:
    """The writer thread's file. A write or flush that fails means the terminal is gone: it is
    reported and dropped, so the thread lives on and keeps emptying its queue."""

    def __init__(self, file: IO[str], on_error: Callable[[str], None]) -> None:
        self._file = file
        self._on_error = on_error

    def write(self, text: str) -> None:
        try:
            self._file.write(text)
        except (OSError, ValueError) as e:      # ValueError: the stream was closed
            self._on_error(f"write failed: {e}")

    def flush(self) -> None:
        try:
            self._file.flush()
        except (OSError, ValueError) as e:
            self._on_error(f"write failed: {e}")

    def fileno(self) -> int:
        return self._file.fileno()


def watch(fd: int, watching: threading.Event, on_hang_up: Callable[[str], None]) -> None:
    """While `watching` is set, check fd (stdin); report once when it hangs up."""
    poller = select.poll()
    poller.register(fd, 0)                     # POLLHUP / POLLERR / POLLNVAL are always reported
    while watching.is_set():
        if poller.poll(POLL_MS):
            on_hang_up("the terminal hung up")
            return


class HangupDriver(LinuxDriver):
    """LinuxDriver that posts HangUp to the app when the terminal goes away."""

    def __init__(self, app, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self._file = TerminalOutput(self._file, self._terminal_gone)
        self._posted = threading.Event()
        self._watching = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start_application_mode(self) -> None:
        super().start_application_mode()
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGHUP, self._hang_up, "SIGHUP")
        self._loop.add_signal_handler(signal.SIGTERM, self._hang_up, "SIGTERM", 128 + signal.SIGTERM)
        self._watching.set()
        threading.Thread(target=watch, args=(self.fileno, self._watching, self._terminal_gone), daemon=True,
                         name="pdchat-hangup").start()

    def _sigcont_application(self, *args) -> None:
        # The kernel sends SIGCONT with SIGHUP, and LinuxDriver answers any SIGCONT by starting
        # application mode again from inside the signal handler: a second input thread, a second
        # writer, or a freeze on a lock the main thread held. Resume only after our own suspend.
        if self._must_signal_resume:
            super()._sigcont_application(*args)

    def stop_application_mode(self) -> None:
        self._watching.clear()
        super().stop_application_mode()

    def close(self) -> None:
        super().close()
        # kept until now so a SIGHUP during the shutdown still lets the replies be saved
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_signal_handler(signal.SIGHUP)
            self._loop.remove_signal_handler(signal.SIGTERM)

    def _terminal_gone(self, reason: str) -> None:
        # Stop the input thread now: on a hung-up tty it spins (select says readable, read returns
        # b""), taking a core and the GIL from the exit it is waiting for. (disable_input, at the
        # exit, then finds it stopped and touches the dead terminal no more.)
        self.exit_event.set()
        self._hang_up(reason)

    def _hang_up(self, reason: str, exit_code: int = EXIT_CODE) -> None:
        if not self._posted.is_set():
            self._posted.set()
            self._app.post_message(HangUp(reason, exit_code))
