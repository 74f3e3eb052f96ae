"""The state of a reply in flight, fed from the worker thread and read by UI timers.

The UI never reacts per token: timers read `take_text()` and `snapshot()` a few times a second.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from pdchat.chatapp.backends.base import Done, Event, Phase, Token


@dataclass
class LiveSnapshot:
    phase: str                      # queued | prefill | transfer | decode | done | cancelled | error
    computed: int
    total: int
    cached: int
    phase_ms: float                 # time spent in the current phase so far
    ttft_ms: float | None
    output_tokens: int
    decode_tok_s: float | None
    itl_ms: list[float] = field(default_factory=list)
    metrics: dict[str, Any] | None = None
    prefill_done: float = 0.0              # prompt tokens done, a forward under way counted by its layers
    layers_done: int = 0                   # that forward's way through the layers (0: none reported)
    layers: int = 0
    prefill_tok_s: float | None = None     # prompt tokens per second so far (this prefill)
    prefill_left_ms: float | None = None   # the rest of the prompt at that rate
    # a prompt prefilled by another process (disaggregated): its K/V's hand-off so far (or its
    # whole time once decoding began), and the wait before it; None when prefilled here
    transfer_ms: float | None = None
    pause_ms: float | None = None


class LiveReply:
    def __init__(self, conversation_id: int, message_id: int, now: Callable[[], float]):
        self.conversation_id = conversation_id
        self.message_id = message_id
        self.now = now
        self._lock = threading.Lock()
        self.phase = "queued"
        self.computed = self.total = self.cached = 0
        self.layers_done = self.layers = self.step_tokens = 0
        self.step_s = 0.0
        self.t_submit = self.t_phase = self.t_progress = now()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.t_transfer: float | None = None          # the K/V hand-off's start and end
        self.t_transfer_end: float | None = None
        self.text = ""
        self._taken = 0
        self.tokens = 0
        self.itl: list[float] = []
        self.done: Done | None = None
        self.generation = None

    def feed(self, ev: Event) -> None:
        with self._lock:
            if isinstance(ev, Phase):
                if ev.phase == "queued":
                    self.t_submit = ev.t
                if ev.phase == "prefill" and (ev.computed, ev.layers_done) != (self.computed, self.layers_done):
                    self.t_progress = ev.t
                self._enter(ev.phase, ev.t)
                self.computed, self.total, self.cached = ev.computed, ev.total, ev.cached
                self.layers_done, self.layers, self.step_tokens = ev.layers_done, ev.layers, ev.step_tokens
                self.step_s = ev.step_s
            elif isinstance(ev, Token):
                if self.t_first is None:
                    self.t_first = ev.t
                    if self.phase != "decode":
                        self._enter("decode", ev.t)
                        self.computed = self.total
                elif self.t_last is not None and ev.t > self.t_last:
                    self.itl.append((ev.t - self.t_last) * 1000)
                self.tokens = max(self.tokens, ev.index + 1)
                self.t_last = ev.t
                self.text += ev.text
            elif isinstance(ev, Done):
                self.done = ev
                self.text = ev.text if ev.text or not self.text else self.text
                self.phase = {"cancelled": "cancelled", "error": "error"}.get(ev.finish_reason, "done")

    def _enter(self, phase: str, t: float) -> None:
        """A phase starts at `t` (the same phase again changes nothing); a hand-off's start and end
        are kept for the timeline."""
        if phase == self.phase:
            return
        if phase == "transfer":
            self.t_transfer = t
        elif self.phase == "transfer":
            self.t_transfer_end = t
        self.phase, self.t_phase = phase, t

    def take_text(self) -> str:
        """Text not yet handed to the UI (for MarkdownStream)."""
        with self._lock:
            out = self.text[self._taken:]
            self._taken = len(self.text)
            return out

    def full_text(self) -> str:
        with self._lock:
            return self.text

    def snapshot(self) -> LiveSnapshot:
        with self._lock:
            now = self.now()
            end = self.t_last if self.done else now
            rate = None
            if self.t_first is not None and self.tokens > 1 and self.t_last and self.t_last > self.t_first:
                rate = (self.tokens - 1) / (self.t_last - self.t_first)
            ttft_ms = (self.t_first - self.t_submit) * 1000 if self.t_first is not None else None
            return LiveSnapshot(
                phase=self.phase, computed=self.computed, total=self.total, cached=self.cached,
                phase_ms=max(0.0, ((end or now) - self.t_phase) * 1000), ttft_ms=ttft_ms,
                output_tokens=self.tokens, decode_tok_s=rate, itl_ms=list(self.itl),
                metrics=self.done.metrics if self.done else None, **self._prefill_pace(now),
                **self._transfer_times(end or now, ttft_ms))

    def _transfer_times(self, end: float, ttft_ms: float | None) -> dict[str, float | None]:
        """The hand-off's time (so far, or until decoding began) and the wait before it: up to
        the first token, the rest of the TTFT, as the finished reply's timeline splits it."""
        if self.t_transfer is None:
            return {"transfer_ms": None, "pause_ms": None}
        transfer = max(0.0, ((self.t_transfer_end or end) - self.t_transfer) * 1000)
        pause = ttft_ms - transfer if ttft_ms is not None else (self.t_transfer - self.t_submit) * 1000
        return {"transfer_ms": transfer, "pause_ms": max(0.0, pause)}

    def _prefill_pace(self, now: float) -> dict[str, Any]:
        """Prompt tokens done (a forward under way counted by the share of its layers that ran,
        and between reports moved on at its predicted pace, never past the next report), the rate
        so far, and the rest of the prompt at that rate less the time since the last report.
        The rate is unknown until something was computed; the time left is then the prediction's."""
        reported = float(self.computed)
        if self.layers:
            reported += self.step_tokens * self.layers_done / self.layers
        shown = reported
        predicting = self.phase == "prefill" and self.step_tokens > 0 and self.step_s > 0
        if predicting:
            to_next_report = 1 / self.layers if self.layers else 1.0      # a share of the step
            ahead = min((now - self.t_progress) / self.step_s, to_next_report)
            shown += self.step_tokens * max(0.0, ahead)
        pace: dict[str, Any] = {"prefill_done": shown, "layers_done": self.layers_done, "layers": self.layers,
                                "prefill_tok_s": None, "prefill_left_ms": None}
        spent = self.t_progress - self.t_phase
        if self.phase == "prefill" and reported > self.cached and spent > 0:
            rate = (reported - self.cached) / spent
            left = (self.total - reported) / rate - (now - self.t_progress)
            pace.update(prefill_tok_s=rate, prefill_left_ms=max(0.0, left * 1000))
        elif predicting:
            left = (self.total - shown) * self.step_s / self.step_tokens
            pace.update(prefill_left_ms=max(0.0, left * 1000))
        return pace

    def taken_text(self) -> str:
        """The text already handed to the UI (to rebuild a view when switching back)."""
        with self._lock:
            return self.text[: self._taken]
