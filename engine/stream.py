"""What a request hands back: a thread-safe stream of events, ending in a Completion."""
from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .errors import EngineError
from .metrics import RequestMetrics


@dataclass
class TokenEvent:
    token_id: int
    text: str            # text delta this token completed (may be empty mid-character)
    t: float             # perf_counter seconds
    index: int           # 0-based position among the output tokens


@dataclass
class ProgressEvent:
    """Phase changes and prefill progress: phase is queued | prefill | decode."""
    phase: str
    computed: int        # prompt tokens whose K/V exist (cached ones included)
    total: int           # prompt tokens
    cached: int          # prompt tokens taken from the prefix cache
    t: float
    # A long prefill forward reports its way through the layers (CPU): `layers_done` of `layers`
    # have run over the request's next `step_tokens` prompt tokens. 0: no forward under way.
    layers_done: int = 0
    layers: int = 0
    step_tokens: int = 0
    step_s: float = 0.0  # the forward's predicted time (step_cost.py): a UI moves the bar between reports


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics
    error: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)
    # The typed error behind finish_reason "error", so an edge can tell the client's fault
    # (an InvalidRequest such as KVCacheTooSmall) from the engine's.
    exception: EngineError | None = field(default=None, repr=False)


@dataclass
class FinishEvent:
    """The last event. completion.text is authoritative: after an EOS or a cancel it may extend
    the streamed deltas by text that was held back (a forming stop string, half a character)."""
    completion: Completion


Event = TokenEvent | ProgressEvent | FinishEvent


class RequestStream:
    """Iterate to receive events; the iteration ends after the FinishEvent. Thread-safe."""

    def __init__(self, request_id: str, cancel: Callable[[str], None]):
        self.request_id = request_id
        self._cancel = cancel
        self._events: queue.Queue[Event] = queue.Queue()
        self._completion: Completion | None = None
        self._done = False

    def put(self, event: Event) -> None:
        if isinstance(event, FinishEvent):
            self._done = True
        self._events.put(event)

    @property
    def done(self) -> bool:
        """True once the request has finished (its FinishEvent may still be unread)."""
        return self._done

    def __iter__(self) -> Iterator[Event]:
        while self._completion is None:
            event = self._events.get()
            if isinstance(event, FinishEvent):
                self._completion = event.completion
            yield event

    def cancel(self) -> None:
        """Stop generating; the stream still ends with a FinishEvent (finish_reason 'cancelled')."""
        self._cancel(self.request_id)

    def result(self, timeout: float | None = None) -> Completion:
        """Block until done and return the Completion (events not yet read are dropped)."""
        while self._completion is None:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                raise EngineError(f"request {self.request_id} did not finish in {timeout} s") from None
            if isinstance(event, FinishEvent):
                self._completion = event.completion
        return self._completion

    def text(self) -> str:
        return self.result().text
