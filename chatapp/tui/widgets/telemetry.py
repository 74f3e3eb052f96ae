"""The telemetry panel: one bordered section each for phase, latency, timeline, KV cache, batch,
workers (only while prefill and decode are disaggregated), speculative decoding and device (their
text: panel_sections.py).

The screen calls update_data() from an interval timer a few times a second, never per token; a
section is redrawn only when its text changed.
"""
from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from pdchat.themes.textual_themes import roles

from pdchat.chatapp.tui.live import LiveSnapshot
from pdchat.chatapp.tui.widgets import panel_sections as sections
from pdchat.chatapp.tui.widgets.panel_sections import WIDTH, DeviceSection


def _same_lines(a: Text, b: Text, width: int) -> bool:
    """True when b takes as many lines as a: as many lines, and none wider than `width` (so none wraps)."""
    lines_a, lines_b = a.plain.split("\n"), b.plain.split("\n")
    return len(lines_a) == len(lines_b) and all(cell_len(line) <= width for line in lines_a + lines_b)


class TelemetryPanel(VerticalScroll):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.width_cells = WIDTH
        self.device = DeviceSection()

    def compose(self):
        for name in ("phase", "latency", "timeline", "kv", "batch", "workers", "spec", "device"):
            yield Static(id=f"tm-{name}", classes="tm-section")

    def on_mount(self) -> None:
        titles = {"phase": "Reply", "latency": "Latency", "timeline": "Timeline (last reply)",
                  "kv": "KV cache", "batch": "Batch", "workers": "Workers (disaggregated)",
                  "spec": "Speculative decoding", "device": "Device"}
        for name, title in titles.items():
            self.query_one(f"#tm-{name}").border_title = title
        self._show("workers", False)           # until the engine says it is disaggregated

    def _put(self, name: str, text: Text) -> None:
        text.rstrip()
        static = self.query_one(f"#tm-{name}", Static)
        old = static.content
        if old == text:
            return                 # unchanged: no repaint (most sections, most of the time)
        # A new layout (the costly part of a refresh) only when the section's height may change.
        static.update(text, layout=not (isinstance(old, Text) and _same_lines(old, text, static.size.width)))

    def _show(self, name: str, shown: bool) -> None:
        static = self.query_one(f"#tm-{name}", Static)
        if static.display != shown:
            static.display = shown

    def update_data(self, stats: dict[str, Any], live: LiveSnapshot | None, last: dict | None,
                    caps: dict[str, bool], toggles: dict[str, Any], conv_tokens: int = 0,
                    now: float | None = None) -> None:
        c = roles(self.app)
        # The sections' width: inside the scrollbar (when the panel scrolls), their border and padding.
        inner = self.scrollable_content_region.width
        w = max(10, inner - 4) if inner else WIDTH
        self.width_cells = w
        self._put("phase", sections.phase_text(live, last, c, w))
        self._put("latency", sections.latency_text(live, last, c, w))
        self._put("timeline", sections.timeline_text(live, last, c, w))
        self._put("kv", sections.kv_text(stats, c, w, conv_tokens))
        self._put("batch", sections.batch_text(stats))
        disaggregated = sections.workers_shown(stats)
        self._show("workers", disaggregated)
        if disaggregated:
            self._put("workers", sections.workers_text(stats, c, w))
        self._put("spec", sections.spec_text(last, caps, toggles))
        self._put("device", self.device.text(stats, c, w, now, self.app.theme_variables.get("warning", "yellow")))
