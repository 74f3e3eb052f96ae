"""A CUDA graph's contract on the CPU, for the decode-graph tests (engine/cuda_graphs.py)."""
from __future__ import annotations

from typing import Any, Callable


class EagerGraph:
    """Capture runs the function; replay runs it again. That is what a real replay does: the
    recorded kernels read the captured input addresses as they are now and write the captured
    outputs, so a step that leaves stale data in a static buffer goes wrong here as it would on a GPU."""

    captures = 0                 # across instances: how many graphs were captured

    def __init__(self, pool: Any = None):
        self._fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        type(self).captures += 1
        self._fn = fn
        fn()

    def replay(self) -> None:
        self._fn()


class FailingGraph(EagerGraph):
    """A capture that fails as a driver might (an op that cannot be captured)."""

    def capture(self, fn: Callable[[], None]) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")
