"""Renders `pdchat bench` results for people: a progress bar while it runs, then tables."""
from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pdchat.chatapp.format import time_left


def progress_bar(console: Console, clock: Callable[[], float] = time.monotonic
                 ) -> tuple[Progress, Callable[[str, float], None]]:
    """A progress bar and its update(what, fraction done), which also says the time left at the
    pace so far."""
    bar = Progress(TextColumn("[bold]{task.description:<22}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                   TimeElapsedColumn(), TextColumn("{task.fields[left]}"), console=console, transient=True)
    task = bar.add_task("starting", total=1.0, left="")
    started = clock()

    def update(what: str, fraction: float) -> None:
        bar.update(task, description=what, completed=fraction, left=time_left(clock() - started, fraction))

    return bar, update


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return escape(str(value))                 # data, not markup: "pip install 'pdchat[peer]'" keeps its [peer]


TITLES = {"llamacpp": "llama.cpp (optional peer: same weights as Q4_0, same threads)"}


def render(result: dict[str, Any], console: Console) -> None:
    m = result.get("machine", {})
    console.print(f"[bold]pdchat bench {result['suite']}[/] · {result.get('model')} on {result.get('device')} · "
                  f"{m.get('cpu') or ''} {m.get('gpu') or ''} · {m.get('date')}")
    for section, data in result.items():
        if section in ("suite", "machine", "model", "device", "inputs") or not isinstance(data, dict):
            continue
        rows = data.get("rows")
        title = TITLES.get(section, section.replace("_", " "))
        table = Table(title=title, title_justify="left", show_header=bool(rows))
        if rows:
            for key in rows[0]:
                table.add_column(key.replace("_", " "))
            for row in rows:
                table.add_row(*(_fmt(v) for v in row.values()))
            console.print(table)
            if data.keys() == {"rows"}:
                continue
            table = Table(show_header=False)
        table.add_column("measure")
        table.add_column("value", justify="right", overflow="fold")     # long paths wrap, not cut
        skipped = bool(data.get("reason"))      # a skipped section shows why, not a column of n/a
        for key, value in data.items():
            if key == "rows" or (value is None and (key == "reason" or (skipped and key != "met"))):
                continue
            table.add_row(key.replace("_", " "), _fmt(value))
        console.print(table)
