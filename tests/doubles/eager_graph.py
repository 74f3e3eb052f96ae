"""A CUDA graph's contract on the CPU, for the decode-graph tests (engine/cuda_graphs.py)."""
from __future__ import annotations

from typing import Any, Callable

import torch

# The kernels of the tests of the graphs' own bookkeeping (test_cuda_graphs, test_decode_ahead): on
# a GPU the Triton ones, as the engine runs them; off one torch's, as in Triton's CPU interpreter
# those tests took four minutes of the suite. The tests of what the kernels must do inside a graph
# (padding rows, the int8 product) run the Triton kernels everywhere.
BOOKKEEPING_KERNELS = "triton" if torch.cuda.is_available() else "torch"


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
