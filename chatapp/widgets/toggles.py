"""Optimization toggles: KV cache, prefix cache, chunked prefill (+size), spec, quant, neighbours."""
from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Input, Label, Select, Switch

from ..backend import DEFAULT_CHUNK, Toggles


class TogglesBox(Vertical):
    class Changed(Message):
        def __init__(self, changes: dict[str, Any]):
            super().__init__()
            self.changes = changes

    def __init__(self, toggles: Toggles, caps: dict[str, bool], **kwargs):
        super().__init__(**kwargs)
        self.toggles = toggles
        self.caps = caps
        self._quiet = True           # no Changed events for the initial values

    def on_mount(self) -> None:
        self.call_after_refresh(self._unquiet)

    def _label(self, text: str, cap: str) -> Label:
        return Label(text if self.caps.get(cap) else f"{text} (unavailable)", classes="tg-label")

    def compose(self) -> ComposeResult:
        t = self.toggles
        with Horizontal(classes="tg-row"):
            yield Switch(t.kv_cache, id="tg-kv_cache", disabled=not self.caps.get("kv_cache"))
            yield self._label("KV cache", "kv_cache")
        with Horizontal(classes="tg-row"):
            yield Switch(t.prefix_cache, id="tg-prefix_cache", disabled=not self.caps.get("prefix_cache"))
            yield self._label("prefix cache", "prefix_cache")
        with Horizontal(classes="tg-row"):
            yield Switch(t.chunk_size is not None, id="tg-chunked", disabled=not self.caps.get("chunked_prefill"))
            yield self._label("chunked prefill", "chunked_prefill")
            yield Input(str(t.chunk_size or DEFAULT_CHUNK), id="tg-chunk_size", type="integer", max_length=6,
                        disabled=not self.caps.get("chunked_prefill"))
        with Horizontal(classes="tg-row"):
            yield self._label("spec", "spec")
            yield Select([(v, v) for v in ("off", "ngram", "draft")], value=t.spec, allow_blank=False,
                         id="tg-spec", disabled=not self.caps.get("spec"))
        with Horizontal(classes="tg-row"):
            yield self._label("quant", "quant")
            yield Select([(v, v) for v in ("none", "int8")], value=t.quant, allow_blank=False,
                         id="tg-quant", disabled=not self.caps.get("quant"))
        with Horizontal(classes="tg-row"):
            yield self._label("neighbours", "neighbours")
            yield Input(str(t.neighbours), id="tg-neighbours", type="integer", max_length=2,
                        disabled=not self.caps.get("neighbours"))

    def set_caps(self, caps: dict[str, bool], toggles: Toggles) -> None:
        """New backend: rebuild the controls for its capabilities."""
        if caps == self.caps and toggles == self.toggles:
            return
        self.caps, self.toggles = caps, toggles
        self._quiet = True
        self.refresh(recompose=True)
        self.call_after_refresh(self._unquiet)

    def set_values(self, toggles: Toggles) -> None:
        """Reflect toggles changed elsewhere (command palette) without re-sending them."""
        self.toggles = toggles
        self._quiet = True
        try:
            self.query_one("#tg-kv_cache", Switch).value = toggles.kv_cache
            self.query_one("#tg-prefix_cache", Switch).value = toggles.prefix_cache
            self.query_one("#tg-chunked", Switch).value = toggles.chunk_size is not None
            if toggles.chunk_size:
                self.query_one("#tg-chunk_size", Input).value = str(toggles.chunk_size)
            self.query_one("#tg-spec", Select).value = toggles.spec
            self.query_one("#tg-quant", Select).value = toggles.quant
            self.query_one("#tg-neighbours", Input).value = str(toggles.neighbours)
        finally:
            self.call_after_refresh(self._unquiet)

    def _unquiet(self) -> None:
        self._quiet = False

    def _send(self, **changes: Any) -> None:
        if not self._quiet:
            self.post_message(self.Changed(changes))

    def _chunk_size(self) -> int:
        try:
            return max(1, int(self.query_one("#tg-chunk_size", Input).value))
        except ValueError:
            return 256

    def on_switch_changed(self, event: Switch.Changed) -> None:
        event.stop()
        name = event.switch.id.removeprefix("tg-")
        if name == "chunked":
            self._send(chunk_size=self._chunk_size() if event.value else None)
        else:
            self._send(**{name: event.value})

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        self._send(**{event.select.id.removeprefix("tg-"): event.value})

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.input.id == "tg-chunk_size":
            if self.query_one("#tg-chunked", Switch).value:
                self._send(chunk_size=self._chunk_size())
        elif event.input.id == "tg-neighbours":
            try:
                n = max(0, min(16, int(event.value or 0)))
            except ValueError:
                n = 0
            self._send(neighbours=n)
