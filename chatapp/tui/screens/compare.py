"""Compare: re-run the last prompt with one toggle changed (the chooser), then read the two
replies side by side (the A/B table). The choices come from the settings declaration, so a new
toggle is comparable without a change here."""
from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList, Static

from pdchat.chatapp import format as fmt
from pdchat.engine.settings import ENGINE, TOGGLES


def compare_choices(toggles: dict[str, Any], caps: dict[str, bool]) -> list[tuple[str, dict[str, Any]]]:
    """(label, change) for every other value of every engine toggle this backend has: on/off
    flips, each other choice, a number that can be off goes off (or back to its default)."""
    out = []
    for s in TOGGLES:
        if s.scope != ENGINE or not caps.get(s.name):
            continue
        now = toggles[s.name]
        if s.kind is bool:
            targets = [not now]
        elif s.choices:
            targets = [c for c in s.choices if c != now]
        elif s.nullable:
            targets = [None if now is not None else s.default]
        else:
            continue
        out += [(f"{s.title}: {fmt.setting_value(now)} → {fmt.setting_value(v)}", {s.name: v}) for v in targets]
    return out


class CompareChooser(ModalScreen[dict[str, Any] | None]):
    """Which toggle the compared reply runs with; the toggles go back when it ends."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, choices: list[tuple[str, dict[str, Any]]]):
        super().__init__()
        self.choices = choices

    def compose(self) -> ComposeResult:
        with Vertical(classes="modal-box prompt-box"):
            yield Label("Compare: answer the last prompt again with one change", classes="modal-title")
            yield OptionList(*(label for label, _ in self.choices), id="compare-list")
            yield Label("Both replies keep their summaries; F6 then shows them side by side.", classes="hint")

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.choices[event.option_index][1])

    def action_cancel(self) -> None:
        self.dismiss(None)


# (row title, metrics key, formatter, True when a higher value is better)
AB_ROWS = (
    ("TTFT", "ttft_ms", fmt.ms, False),
    ("prefill", "prefill_tok_s", fmt.rate, True),
    ("decode", "decode_tok_s", fmt.rate, True),
    ("TPOT", "tpot_ms", fmt.ms, False),
    ("prompt tokens", "prompt_tokens", fmt.count, None),
    ("cached tokens", "cached_prompt_tokens", fmt.count, None),
    ("output tokens", "output_tokens", fmt.count, None),
    ("acceptance", "spec_acceptance", lambda v: fmt.pct(None if v is None else 100 * v), True),
)


def ab_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(measure, A, B, B vs A) for two replies' metrics; the ratio says which way is better."""
    rows = [("made with", fmt.made_with(a.get("made_with") or {}), fmt.made_with(b.get("made_with") or {}), "")]
    for title, key, show, higher_better in AB_ROWS:
        va, vb = a.get(key), b.get(key)
        ratio = ""
        if higher_better is not None and va and vb:
            r = vb / va
            better = (r > 1) == higher_better
            ratio = f"{r:.2f}×" + ("" if abs(r - 1) < 0.05 else " better" if better else " worse")
        rows.append((title, show(va), show(vb), ratio))
    return rows


class ABTable(ModalScreen[None]):
    """The last two replies of a conversation side by side: what made each, and their numbers."""

    BINDINGS = [Binding("escape", "close", "Close"), Binding("f6", "close", "Close")]

    def __init__(self, a: dict[str, Any], b: dict[str, Any]):
        super().__init__()
        self.a, self.b = a, b

    def compose(self) -> ComposeResult:
        table = Table(expand=True, show_edge=False)
        table.add_column("")
        table.add_column("A (earlier)", overflow="fold")
        table.add_column("B (later)", overflow="fold")
        table.add_column("B vs A")
        for row in ab_rows(self.a, self.b):
            table.add_row(*row)
        with Vertical(classes="modal-box ab-box"):
            yield Label("A/B: the last two replies", classes="modal-title")
            yield Static(table, id="ab-table")
            yield Label(Text("Esc closes. Timings vary run to run by a few percent.", style="dim"))

    def action_close(self) -> None:
        self.dismiss(None)
