"""The app ends when its terminal goes away, and keeps the reply it was streaming.

The real entry path (run_app, Textual's terminal driver) runs with a scripted backend in a
pseudo-terminal whose first process is the session leader, as in a terminal window or a tmux
pane. Closing the master side is what the kernel sees when the window is closed, the SSH
connection drops or the tmux session is killed.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import re
import select
import shutil
import signal
import sqlite3
import struct
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from textual.drivers._writer_thread import WriterThread

from pdchat.chatapp.tui.hangup import EXIT_CODE, HangupDriver, TerminalOutput, watch

EXIT_S = 10.0        # the app ends in about a second; the bug was never ending at all

CHILD = """
import os, sys, threading
from pdchat.chatapp.tui import app
from tests.doubles.fake_backend import FakeBackend
from pdchat.chatapp.tui.screens import replies

class Backend(FakeBackend):
    def load(self, progress):
        if self.model == "stuck":                  # a load that never ends (a stalled download)
            progress("downloading stuck")
            threading.Event().wait()
        super().load(progress)

def stuck_lab(progress, quick=False):                           # a lab run that never ends
    progress("measuring", 0.1)
    threading.Event().wait()

pid_file, model = sys.argv[1:]
with open(pid_file, "w") as f:
    f.write(str(os.getpid()))
replies.SAVE_S = float("inf")                       # no periodic saves: the text comes from the exit path
app.make_backend = lambda engine, backend=None: Backend(model=engine["model"], hold="decode:3",
                                                       replies=["one two three four five six"])
app.lab_runner = lambda backend: (stuck_lab, None)
sys.exit(app.run_app({"model": model}, {}))
"""

CSI = re.compile(rb"\x1b\[[0-9;?<>=$]*[A-Za-z~]")


class Terminal:
    """A pseudo-terminal running argv as its session leader."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.pid, self.master = pty.fork()
        if self.pid == 0:                          # the child: become argv, nothing else
            try:
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.screen = b""
        self.status: int | None = None             # the wait status, once reaped

    def read(self, timeout: float) -> None:
        """What the app drew within `timeout`; after the hang-up, only the wait (a test that spun
        here took a core from the app's exit)."""
        if self.master < 0:
            time.sleep(timeout)
        elif select.select([self.master], [], [], timeout)[0]:
            try:
                self.screen += os.read(self.master, 65536)
            except OSError:                        # EIO: everything on the other side is closed
                time.sleep(timeout)

    def wait_for(self, text: bytes, timeout: float = 60.0) -> None:
        """Read what the app draws until `text` shows (escape sequences left out)."""
        end = time.monotonic() + timeout
        while text not in CSI.sub(b"", self.screen):
            assert time.monotonic() < end, \
                f"{text!r} not drawn in {timeout} s; the screen ends with {CSI.sub(b'', self.screen)[-400:]!r}"
            self.read(0.1)

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def hang_up(self) -> None:
        os.close(self.master)
        self.master = -1

    def exit_code(self) -> int:
        """The session leader's exit code (it has ended)."""
        self.status = os.waitpid(self.pid, 0)[1]
        return os.waitstatus_to_exitcode(self.status)

    def kill(self) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.exit_code()


def running(pid: int) -> bool:
    """A zombie (ended, not yet reaped by its parent) does not count."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


def ends_within(term: Terminal, pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while running(pid) and time.monotonic() < end:
        term.read(0.05)                            # a live terminal must be drained for the app to finish
    return not running(pid)


def stored_replies(tmp_path: Path) -> list[tuple[str, str]]:
    """(content, status) of the assistant rows as written (the Store would read 'streaming' as
    'interrupted')."""
    db = sqlite3.connect(tmp_path / "data" / "pdchat.db")
    try:
        return db.execute("SELECT content, status FROM messages WHERE role = 'assistant'").fetchall()
    finally:
        db.close()


@pytest.fixture
def launch(tmp_path):
    """launch(via, model) starts the app in a terminal, behind `via`: 'direct', 'sh' (sh -c) or
    'make'; returns the terminal and the app's pid."""
    terminals: list[Terminal] = []
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    # The child imports the test double from tests/ (the repository root on its path).
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
           "PDCHAT_DATA_DIR": str(tmp_path / "data"),
           "PDCHAT_CONFIG_DIR": str(tmp_path / "config"), "TERM": "xterm-256color"}

    def start(via: str, model: str = "fake-model") -> tuple[Terminal, int]:
        pid_file = tmp_path / "pid"
        command = [sys.executable, str(script), str(pid_file), model]
        if via == "sh":                            # sh stays as the parent: not the last command
            argv = ["/bin/sh", "-c", " ".join(command) + "; echo ended"]
        elif via == "make":                        # make catches SIGHUP and waits for its child
            (tmp_path / "Makefile").write_text("run:\n\t" + " ".join(command) + "\n")
            make = shutil.which("make")
            assert make, "make is needed (the README's `make run` uses it)"
            argv = [make, "-f", str(tmp_path / "Makefile")]
        else:
            argv = command
        term = Terminal(argv, env)
        terminals.append(term)
        end = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < end, "the app did not start"
            term.read(0.05)
        return term, int(pid_file.read_text())

    yield start
    for term in terminals:                         # a failed test must not leave the app running
        term.kill()


@pytest.mark.parametrize("via", ["direct", "sh", "make"])
def test_closing_the_terminal_ends_the_app_and_keeps_the_reply(launch, tmp_path, via):
    term, pid = launch(via)
    term.wait_for(b"fake-model ready")
    term.type(b"count\r")
    term.wait_for(b"three")                        # then the reply holds, mid-stream
    term.hang_up()
    assert ends_within(term, pid, EXIT_S), f"still running {EXIT_S} s after the hang-up"
    assert stored_replies(tmp_path) == [("one two three", "interrupted")]
    if via == "direct":
        assert term.exit_code() == EXIT_CODE


@pytest.mark.parametrize("sig, code", [(signal.SIGHUP, EXIT_CODE), (signal.SIGTERM, 128 + signal.SIGTERM)],
                         ids=["SIGHUP with the terminal still there", "SIGTERM"])
def test_a_signal_to_end_ends_the_app_and_keeps_the_reply(launch, tmp_path, sig, code):
    term, pid = launch("direct")
    term.wait_for(b"fake-model ready")
    term.type(b"count\r")
    term.wait_for(b"three")
    os.kill(pid, sig)
    assert ends_within(term, pid, EXIT_S)
    assert term.exit_code() == code
    assert stored_replies(tmp_path) == [("one two three", "interrupted")]


def test_closing_the_terminal_during_a_stalled_model_load_ends_the_app(launch):
    term, pid = launch("make", model="stuck")
    term.wait_for(b"downloading stuck")
    term.hang_up()
    assert ends_within(term, pid, EXIT_S), "the app waited for the model load"


def test_closing_the_terminal_during_a_lab_run_ends_the_app(launch):
    term, pid = launch("make")
    term.wait_for(b"fake-model ready")
    term.type(b"\x1b[20~")                         # F9: the lab
    term.wait_for(b"press r")
    term.type(b"r")
    term.wait_for(b"running: measuring")
    term.hang_up()
    assert ends_within(term, pid, EXIT_S), "the app waited for the lab run"


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_sigcont_alone_does_not_start_the_terminal_again(launch):
    """The kernel sends SIGCONT with SIGHUP; Textual would answer it by starting its input and
    output threads a second time."""
    term, pid = launch("direct")
    term.wait_for(b"fake-model ready")
    before = threads(pid)
    os.kill(pid, signal.SIGCONT)
    term.read(0.5)
    assert threads(pid) == before
    term.type(b"\x11")                            # Ctrl+Q still quits
    assert ends_within(term, pid, EXIT_S)
    assert term.exit_code() == 0


def test_stdin_watch_reports_a_hang_up_and_nothing_else():
    master, slave = os.openpty()
    watching, heard = threading.Event(), []
    watching.set()
    watcher = threading.Thread(target=watch, args=(slave, watching, heard.append), daemon=True)
    watcher.start()
    try:
        time.sleep(0.6)
        assert heard == [] and watcher.is_alive()  # a live terminal is no hang-up
        os.close(master)
        watcher.join(EXIT_S)
        assert heard == ["the terminal hung up"] and not watcher.is_alive()
    finally:
        watching.clear()
        os.close(slave)


def test_the_writer_thread_outlives_a_dead_terminal():
    read_end, write_end = os.pipe()
    os.close(read_end)                             # every write now fails (EPIPE)
    heard: list[str] = []
    out = open(write_end, "w")
    writer = WriterThread(TerminalOutput(out, heard.append))
    writer.start()

    def draw_and_stop() -> None:                   # more writes than the queue holds (30)
        for _ in range(100):
            writer.write("frame")
        writer.stop()
    drawing = threading.Thread(target=draw_and_stop, daemon=True)
    drawing.start()
    drawing.join(EXIT_S)
    with contextlib.suppress(OSError):
        out.close()
    assert not drawing.is_alive(), "the writer thread died and the UI blocked on its full queue"
    assert heard and heard[0].startswith("write failed")


def test_a_hang_up_stops_the_input_thread_that_would_spin_on_the_dead_terminal():
    """On a hung-up tty Textual's input thread spins (select says readable, read returns b""),
    taking a core and the GIL from the exit; once the hang-up is noticed it stops."""
    master, slave = os.openpty()
    posted: list[object] = []

    class App:                                      # what the driver reaches of its app here
        def post_message(self, message) -> None:
            posted.append(message)

    async def driver_on(fd: int) -> HangupDriver:
        driver = HangupDriver(App())
        driver.fileno = fd
        return driver

    driver = asyncio.run(driver_on(slave))
    reader = threading.Thread(target=driver.run_input_thread, daemon=True)
    reader.start()
    watching = threading.Event()
    watching.set()
    try:
        os.close(master)
        watch(slave, watching, driver._terminal_gone)
        reader.join(EXIT_S)
        assert not reader.is_alive(), "the input thread still reads the dead terminal"
        assert [type(m).__name__ for m in posted] == ["HangUp"]
    finally:
        driver.exit_event.set()
        reader.join(EXIT_S)
        os.close(slave)
