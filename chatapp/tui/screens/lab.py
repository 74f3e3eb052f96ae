"""The Lab screen: runs `pdchat bench lab` in a worker with a progress bar and shows the verdicts
and the curves; it opens on the last saved run (data_dir()/lab/)."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, ProgressBar, Static

from pdchat.themes.textual_themes import roles

from pdchat.chatapp import format as fmt
from pdchat.chatapp.backends.base import Backend
from pdchat.chatapp.reporting.lab_report import curve_text, run_line, verdict_table

Progress = Callable[[str, float], None]
Runner = Callable[..., dict[str, Any]]      # runner(progress, quick=False) -> the lab's result


def lab_runner(backend: Backend) -> tuple[Runner | None, str | None]:
    """(a function running the lab on the backend's model, None) or (None, why not)."""
    if not backend.capabilities.get("lab"):
        return None, (f"The lab measures the local engine; it is not available with this backend "
                      f"({backend.model}). Run it where the model runs: `pdchat bench lab`.")
    return backend.run_lab, None


class LabScreen(Screen):
    BINDINGS = [Binding("escape", "back", "Back"), Binding("r", "run", "Run the lab"),
                Binding("q", "run(True)", "Quick run (under a minute, noisier)")]

    def __init__(self, runner: Runner | None, unavailable: str | None = None,
                 load_last: Callable[[], dict[str, Any] | None] = lambda: None):
        super().__init__()
        self.runner, self.unavailable, self.load_last = runner, unavailable, load_last
        self.running = self.quick = False
        self.started = 0.0
        self.result: dict[str, Any] | None = None

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield Static(id="lab-status")
        # the lab's progress text carries the time left (its pace so far): no second estimate here
        yield ProgressBar(id="lab-progress", total=1.0, show_eta=False)
        with VerticalScroll(id="lab-body"):
            yield Static(id="lab-verdicts")
            yield Static(id="lab-curves")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#lab-progress").display = False
        self.show(self.load_last())

    def on_resize(self) -> None:
        if self.result is not None:
            self.show(self.result)

    def show(self, result: dict[str, Any] | None) -> None:
        self.result = result
        status = self.query_one("#lab-status", Static)
        if result is None:
            status.update(self.unavailable or "No lab run yet: press r to measure the claims on this machine "
                                               "(a few minutes), or q for a quick run (under a minute).")
            return
        where = (result.get("files") or {}).get("dir", "")
        status.update(Text(f"{run_line(result)} · {where}" + (f"\n{self.unavailable}" if self.unavailable else "")))
        self.query_one("#lab-verdicts", Static).update(verdict_table(result.get("claims", [])))
        width = max(20, (self.size.width or 100) // 2 - 12)
        colours = roles(self.app)
        grid = Table.grid(padding=(1, 4))
        grid.add_column()
        grid.add_column()
        charts = [curve_text(c, width, colours=colours) for c in result.get("curves", [])]
        for pair in (charts[i:i + 2] for i in range(0, len(charts), 2)):
            grid.add_row(*pair)
        self.query_one("#lab-curves", Static).update(grid)

    def action_back(self) -> None:
        if self.running:
            self.notify("The lab keeps running in the background; its results will be saved.")
        self.app.pop_screen()

    def action_run(self, quick: bool = False) -> None:
        if self.runner is None:
            self.notify(self.unavailable or "The lab is not available here.", severity="warning")
            return
        if self.running:
            return
        self.running, self.quick, self.started = True, quick, time.monotonic()
        self.app.heap.measuring += 1        # no full garbage collection stalls the lab's timings
        self.query_one("#lab-progress").display = True
        # a daemon thread, not a Textual worker: those are joined on exit, and a lab run takes minutes
        threading.Thread(target=self._run, daemon=True, name="pdchat-lab").start()

    def _progress(self, what: str, fraction: float) -> None:
        mode = "quick run" if self.quick else "running"
        left = fmt.time_left(time.monotonic() - self.started, fraction)

        def update() -> None:
            self.query_one("#lab-status", Static).update(Text(f"{mode}: {what} · {left}"))
            self.query_one("#lab-progress", ProgressBar).update(progress=fraction)
        self.app.call_from_thread(update)

    def _run(self) -> None:
        try:
            result, error = self.runner(self._progress, quick=self.quick), None
        except Exception as e:                     # shown, never fatal
            result, error = None, f"{type(e).__name__}: {e}"
        with contextlib.suppress(RuntimeError):    # the app ended during the run: nobody to tell
            self.app.call_from_thread(self._finished, result, error)

    def _finished(self, result: dict[str, Any] | None, error: str | None) -> None:
        self.running = False
        self.app.heap.measuring -= 1
        self.query_one("#lab-progress").display = False
        if error:
            self.query_one("#lab-status", Static).update(f"[b]lab failed[/b]: {error}")
            self.notify(f"The lab failed: {error}", severity="error", timeout=15)
            return
        self.show(result)
        self.notify(f"Lab results saved in {(result.get('files') or {}).get('dir')}")
