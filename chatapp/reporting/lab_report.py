"""Renders a `pdchat bench lab` result for people: verdicts with their numbers, then the curves
drawn in the terminal in the theme's role colours, then where the files are."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from pdchat.themes.palette import DEFAULT_ROLES

from pdchat.chatapp.reporting.lab_plot import chart
from pdchat.chatapp.reporting.lab_words import in_words

VERDICT_STYLE = {"confirmed": "bold green", "not confirmed": "bold red", "not available": "dim"}


def verdict_table(claims: list[dict[str, Any]]) -> Table:
    table = Table(title="claims", title_justify="left", expand=True)
    table.add_column("claim", ratio=2)
    table.add_column("verdict", no_wrap=True)
    table.add_column("what we measured (rule)", ratio=3)
    for c in claims:
        words = Text(in_words(c))
        if c.get("noisy"):
            words.append(f"  {c['noisy']}", style="bold yellow")
        table.add_row(c["claim"], Text(c["verdict"], style=VERDICT_STYLE.get(c["verdict"], "")),
                      words.append(f"  (confirmed when {c['rule']})", style="dim"))
    return table


def run_line(result: dict[str, Any]) -> str:
    """Model, device, machine and date of a run, and whether it was the quick one."""
    m = result.get("machine", {})
    quick = " · quick run: fewer points, noisier" if result.get("mode") == "quick" else ""
    return (f"{result.get('model')} on {result.get('device')} ({result.get('dtype')}) · "
            f"{m.get('cpu') or ''} {m.get('gpu') or ''} · {m.get('date', '')}{quick}")


def curve_text(curve: dict[str, Any], width: int, height: int = 6, colours: dict[str, str] | None = None) -> Text:
    colour = (colours or DEFAULT_ROLES).get(curve.get("role", ""), "")
    lines = chart(curve, width=width, height=height)
    text = Text(lines[0] + "\n", style="bold")
    for line in lines[1:-1]:
        axis, mark, dots = line.partition("┤")          # (a bar chart's name lines have no axis)
        text.append(axis + mark, style="dim").append(dots + "\n", style=colour)
    text.append(lines[-1], style="dim")
    for x, y, label in zip(curve["x"], curve["y"], curve.get("labels") or []):   # scatter points named
        text.append(f"\n  {label}: {curve['x_label']} {x:.2f}, {curve['y_label']} {y:.2f}", style="dim")
    return text


def render_lab(result: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]pdchat bench lab[/] · {escape(run_line(result))}")
    console.print(verdict_table(result["claims"]))
    width = max(20, min(60, console.width // 2 - 10))
    curves = [curve_text(c, width) for c in result["curves"]]
    grid = Table.grid(padding=(1, 4))
    grid.add_column()
    grid.add_column()
    for pair in (curves[i:i + 2] for i in range(0, len(curves), 2)):
        grid.add_row(*pair)
    console.print(grid)
    for name, hint in result.get("see_also", {}).items():
        console.print(f"[dim]see also {name}: {hint}[/]")
    files = result.get("files", {})
    if files:
        console.print(f"[bold]results: {files.get('dir')}[/]\n  {files.get('svg')}  (plot)\n  {files.get('csv')}"
                      f"\n  {files.get('json')}", soft_wrap=True, highlight=False)
