"""A CUDA graph's contract on the CPU, for the decode-graph tests (engine/cuda_graphs.py)."""
from __future__ import annotations

from typing import Any, Callable

import torch


class EagerGraph:
    """Capture runs the function and keeps its output tensor; replay runs it again into that same
    tensor. That is what a real replay does: the recorded kernels read the captured input
    addresses as they are now and write the captured output, so a step that leaves stale data in
    a static buffer goes wrong here as it would on a GPU."""

    captures = 0                 # across instances: how many graphs were captured

    def __init__(self, pool: Any = None):
        self._fn: Callable[[], torch.Tensor] | None = None
        self._out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        type(self).captures += 1
        self._fn, self._out = fn, fn()
        return self._out

    def replay(self) -> None:
        self._out.copy_(self._fn())


class FailingGraph(EagerGraph):
    """A capture that fails as a driver might (an op that cannot be captured)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        raise RuntimeError("operation not permitted when stream is capturing")
