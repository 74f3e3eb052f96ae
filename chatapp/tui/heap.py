"""When the garbage collector may stop the app: never while a reply streams or the lab measures.

CPython's full collection walks every tracked object holding the GIL, so every thread waits, the
engine's step loop too. In the app, with Textual's widgets and their render caches beside the
engine's modules, one took 160-230 ms, about every 10 s of chatting: stalls inside replies, and
when the submit itself set one off, a first TTFT of up to 375 ms where the engine alone answers in
80-100 (2026-11-27, 2-core AMD EPYC, the default model; README). The engine makes almost no
garbage of its own (no full collection during `pdchat bench toggles`' stutter run); the UI does.
So:

- what survives a load is frozen (`gc.freeze`): modules, the model, the first screens live as long
  as the process and are not walked again (closing a model still frees its weights: they go by
  reference count). A later freeze first unfreezes and collects, so a closed model's cycles go too;
- automatic full collections are off; the young generations still collect themselves (a few ms);
- a full collection, over what came after the freeze only (18-127 ms there), runs at the app's
  next quiet moment: no reply streaming, no lab run.
"""
from __future__ import annotations

import gc
from typing import Any, Callable

CHECK_S = 5.0                # how often the app looks for a quiet moment
NEVER = 1 << 30              # a threshold the oldest generation's count does not reach


class HeapKeeper:
    """The app's full collections, each at a quiet moment. `collector` is the gc module (tests
    pass a recorder); `busy` says whether a pause would stall something now (a reply streaming)."""

    def __init__(self, busy: Callable[[], bool], collector: Any = gc):
        self.busy = busy
        self.gc = collector
        self.measuring = 0              # lab runs in progress: no collection may stall them
        self._saved: tuple[int, int, int] | None = None
        self._refreeze = False

    def start(self) -> None:
        """Automatic full collections off (the young generations keep theirs)."""
        self._saved = self.gc.get_threshold()
        young, middle, _ = self._saved
        self.gc.set_threshold(young, middle, NEVER)

    def stop(self) -> None:
        """The collector as it was (the app is ending, or a test's app)."""
        if self._saved is not None:
            self.gc.set_threshold(*self._saved)
            self.gc.unfreeze()
            self._saved = None

    def model_changed(self) -> None:
        """A model was loaded or closed: collect everything and freeze the survivors, now if
        nothing streams, else at the next quiet moment."""
        self._refreeze = True
        self.tidy()

    def tidy(self) -> bool:
        """At a quiet moment, the collection that is due (if any); True if one ran."""
        if self.measuring or self._saved is None or self.busy():
            return False
        if self._refreeze:
            self.gc.unfreeze()
            self.gc.collect()
            self.gc.freeze()
            self._refreeze = False
        elif self.gc.get_count()[2]:    # the middle generation collected since the last full one
            self.gc.collect()
        else:
            return False
        return True
