"""Renders a `pdchat bench lab` result for people: verdicts with their numbers, then the curves
drawn in the terminal in the theme's role colours, then where the files are."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pdchat.themes.palette import DEFAULT_ROLES

from pdchat.chatapp.reporting.lab_plot import chart

VERDICT_STYLE = {"confirmed": "bold green", "not confirmed": "bold red", "not available": "dim"}


def number(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def numbers_line(numbers: dict[str, Any]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {number(v)}" for k, v in numbers.items())


def verdict_table(claims: list[dict[str, Any]]) -> Table:
    table = Table(title="claims", title_justify="left", expand=True)
    table.add_column("claim", ratio=2)
    table.add_column("verdict", no_wrap=True)
    table.add_column("numbers (rule)", ratio=3)
    for c in claims:
        table.add_row(c["claim"], Text(c["verdict"], style=VERDICT_STYLE.get(c["verdict"], "")),
                      Text(numbers_line(c["numbers"])).append(f"  ({c['rule']})", style="dim"))
    return table


def curve_text(curve: dict[str, Any], width: int, height: int = 6, colours: dict[str, str] | None = None) -> Text:
    colour = (colours or DEFAULT_ROLES).get(curve.get("role", ""), "")
    lines = chart(curve, width=width, height=height)
    text = Text(lines[0] + "\n", style="bold")
    for line in lines[1:-1]:
        axis, _, dots = line.partition("┤")
        text.append(axis + "┤", style="dim").append(dots + "\n", style=colour)
    text.append(lines[-1], style="dim")
    return text


def render_lab(result: dict[str, Any], console: Console) -> None:
    m = result.get("machine", {})
    console.print(f"[bold]pdchat bench lab[/] · {result.get('model')} on {result.get('device')} "
                  f"({result.get('dtype')}) · {m.get('cpu') or ''} {m.get('gpu') or ''} · {m.get('date')}")
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
