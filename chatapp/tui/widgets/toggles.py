"""The toggles panel: one compact row per toggle of the settings declaration
(pdchat.engine.settings), so the telemetry below stays in view. The line under the rows explains
the toggle that has the focus (or the mouse: each row's tooltip), in the declaration's words, and
says why a typed value is refused. On/off settings are switches, choices are selects, numbers are
boxes checked by the declaration; a number that can be off ("prefill chunk: off") has both.
"""
from __future__ import annotations

from typing import Any

from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Input, Label, Select, Static, Switch

from pdchat.chatapp.backends.base import Toggles
from pdchat.engine.settings import TOGGLES, Setting


_REFUSED = object()
HINT = "Tab to a toggle (or point at it) to see what it does."


def _can_be_off(s: Setting) -> bool:
    return s.kind is int and any(v is None for _, v in s.words)


def _text(s: Setting, value: Any) -> str:
    """A number setting's value as its box shows it (a word where the value has one)."""
    word = next((w for w, v in s.words if v == value and type(v) is type(value) and v is not None), None)
    return word or str(value)


class TogglesBox(Vertical):
    class Changed(Message):
        def __init__(self, changes: dict[str, Any]):
            super().__init__()
            self.changes = changes

    def __init__(self, toggles: Toggles, caps: dict[str, bool], **kwargs):
        super().__init__(**kwargs)
        self.toggles = toggles       # what the app has: a control showing it again sends nothing
        self.caps = caps

    def shown(self) -> list[Setting]:
        """The toggles with a control: a GPU's own only where the backend can apply them."""
        return [s for s in TOGGLES if self.caps.get(s.name) or not s.gpu_only]

    def compose(self) -> ComposeResult:
        for s in self.shown():
            yield from self._control(s, getattr(self.toggles, s.name), not self.caps.get(s.name))
        yield Static(HINT, id="tg-help", classes="tg-help")

    def _control(self, s: Setting, value: Any, disabled: bool) -> ComposeResult:
        label = Label(s.title + (" (unavailable)" if disabled else ""), classes="tg-label")
        with Horizontal(classes="tg-row") as row:
            row.tooltip = s.help
            if s.kind is bool:
                yield Switch(value, id=f"tg-{s.name}", disabled=disabled)
                yield label
            elif s.choices:
                yield label
                yield Select([(c, c) for c in s.choices], value=value, allow_blank=False, id=f"tg-{s.name}",
                             disabled=disabled, compact=True)
            else:
                if _can_be_off(s):
                    yield Switch(value is not None, id=f"tg-{s.name}-on", disabled=disabled)
                yield label
                shown = s.default if value is None else value
                yield Input(_text(s, shown), id=f"tg-{s.name}", disabled=disabled, max_length=8, compact=True)

    def set_caps(self, caps: dict[str, bool], toggles: Toggles) -> None:
        """New backend: rebuild the controls for its capabilities."""
        if caps == self.caps and toggles == self.toggles:
            return
        self.caps, self.toggles = caps, toggles
        self.refresh(recompose=True)

    def set_values(self, toggles: Toggles) -> None:
        """Reflect toggles changed elsewhere (command palette) without re-sending them."""
        self.toggles = toggles
        for s in self.shown():
            value = getattr(toggles, s.name)
            if s.kind is bool or s.choices:
                self.query_one(f"#tg-{s.name}").value = value
                continue
            if _can_be_off(s):
                self.query_one(f"#tg-{s.name}-on", Switch).value = value is not None
            if value is not None:
                self.query_one(f"#tg-{s.name}", Input).value = _text(s, value)

    def _send(self, **changes: Any) -> None:
        """Tell the app what the user changed: a control's change events also come when it is set
        to show the app's values (at start, from the palette), and those change nothing."""
        changes = {k: v for k, v in changes.items() if getattr(self.toggles, k) != v}
        if changes:
            self.post_message(self.Changed(changes))

    def explain(self, s: Setting, error: str | None = None) -> None:
        """The help line: what `s` does, or why its box refused a value."""
        line = self.query_one("#tg-help", Static)
        line.update(f"{s.title}: {error}" if error else f"{s.title}: {s.help}")
        line.set_class(error is not None, "-error")

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        name = (event.widget.id or "").removeprefix("tg-").removesuffix("-on")
        s = next((t for t in TOGGLES if t.name == name), None)
        if s is not None:
            self.explain(s)

    def _read(self, s: Setting) -> Any:
        """The box's value; _REFUSED (and the box marked, the reason on the help line) when refused."""
        box = self.query_one(f"#tg-{s.name}", Input)
        try:
            value = s.read(box.value or _text(s, s.default))
        except ValueError as e:
            box.add_class("-invalid")
            self.explain(s, str(e))
            return _REFUSED
        box.remove_class("-invalid")
        self.explain(s)
        return value

    def on_switch_changed(self, event: Switch.Changed) -> None:
        event.stop()
        name = event.switch.id.removeprefix("tg-")
        if name.endswith("-on"):                          # a number that can be off
            s = next(t for t in TOGGLES if t.name == name.removesuffix("-on"))
            value = self._read(s) if event.value else None
            if value is not _REFUSED:
                self._send(**{s.name: value})
        else:
            self._send(**{name: event.value})

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        self._send(**{event.select.id.removeprefix("tg-"): event.value})

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        s = next(t for t in TOGGLES if t.name == event.input.id.removeprefix("tg-"))
        value = self._read(s)
        if value is _REFUSED:
            return
        if _can_be_off(s):
            switch = self.query_one(f"#tg-{s.name}-on", Switch)
            if value is None:                  # "off" typed: the switch's change sends it
                switch.value = False
                return
            if not switch.value:               # kept for when it is switched on
                return
        self._send(**{s.name: value})
