"""Compare: re-run the last prompt with one toggle changed (the chooser), then read the two
replies side by side (the A/B table), and the chat screen's keys for both. The choices come from
the settings declaration, so a new toggle is comparable without a change here."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList, Static

from pdchat.chatapp import format as fmt
from pdchat.engine.settings import ENGINE, TOGGLES

if TYPE_CHECKING:
    from pdchat.chatapp.tui.screens.chat import ChatScreen


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
    ("KV transfer", "kv_transfer_ms", fmt.ms, False),
)
# Measures only a disaggregated reply has: their row is left out when neither reply has one.
ONLY_WHEN_MEASURED = ("kv_transfer_ms",)


def ab_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(measure, A, B, B vs A) for two replies' metrics; the ratio says which way is better."""
    rows = [("made with", fmt.made_with(a.get("made_with") or {}), fmt.made_with(b.get("made_with") or {}), "")]
    for title, key, show, higher_better in AB_ROWS:
        va, vb = a.get(key), b.get(key)
        if key in ONLY_WHEN_MEASURED and va is None and vb is None:
            continue
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
            yield Label(Text("One run each: timings vary between runs (the first long prompt after a start "
                             "runs slower), so repeat a surprising result. Esc closes.", style="dim"))

    def action_close(self) -> None:
        self.dismiss(None)


class CompareRequested(Message):
    """Re-run the last prompt of `conv_id` with `changes` to the toggles (the app owns them)."""

    def __init__(self, conv_id: int, changes: dict):
        super().__init__()
        self.conv_id = conv_id
        self.changes = changes


class CompareActions:
    """The chat screen's Compare (Ctrl+G) and A/B table (F6) keys; `self` is the ChatScreen."""

    def action_compare(self: "ChatScreen") -> None:
        """Re-run the last prompt with one toggle changed (chosen in a list); both replies keep
        their summaries and F6 shows them side by side."""
        if not self._can_generate():
            return
        msgs = self.store.messages(self.conv_id)
        if not msgs or msgs[-1].role != "assistant":
            self.notify("Compare needs a finished reply to compare with.", severity="warning")
            return
        choices = compare_choices(self.app.toggles.to_dict(), self.backend.capabilities)
        if not choices:
            self.notify("This backend has no toggle to compare.", severity="warning")
            return
        conv_id = self.conv_id

        def chosen(changes: dict | None) -> None:
            if changes:
                self.post_message(CompareRequested(conv_id, changes))
        self.app.push_screen(CompareChooser(choices), chosen)

    def action_ab_table(self: "ChatScreen") -> None:
        """The last two replies of this conversation side by side."""
        replies = [m for m in self.store.messages(self.conv_id) if m.role == "assistant" and m.metrics] \
            if self.conv_id is not None else []
        if len(replies) < 2:
            self.notify("The A/B table needs two finished replies here (Ctrl+G makes the second).",
                        severity="warning")
            return
        self.app.push_screen(ABTable(replies[-2].metrics, replies[-1].metrics))

    async def start_compare(self: "ChatScreen", conv_id: int, label: str) -> bool:
        """The compared reply answers the same prompt: the previous reply is left out of its history."""
        self._compare_skip = self.store.messages(conv_id)[-1].id
        return await self.start_reply(conv_id, label=label)
