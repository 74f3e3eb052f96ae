"""Which cores the prefill worker and the decoding engine get, and pinning a process to its share.

Pinning is what keeps the two apart: without it the OS moves both sides' threads across all the
cores, and a prefill still slows the streams down. Where the OS cannot pin (macOS), each side
still runs as many threads as its share, and the split is a request rather than a guarantee.
Torch's thread count is a setting of each thread under OpenMP (torch.set_num_threads on one thread
leaves another's as it was), so each side sets it on the thread that runs its forwards.
"""
from __future__ import annotations

import os

import torch

CAN_PIN = hasattr(os, "sched_setaffinity")


def available_cores() -> list[int]:
    if CAN_PIN:
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_cores(prefill: int | None, cores: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(prefill cores, decode cores): `prefill` of them (default half, at least one) for the prefill
    worker, the rest for decoding. On one core both sides share it."""
    cores = available_cores() if cores is None else cores
    if len(cores) < 2:
        return list(cores), list(cores)
    n = min(prefill or max(1, len(cores) // 2), len(cores) - 1)
    return cores[:n], cores[n:]


def pin_process(cores: list[int]) -> set[int] | None:
    """Run every thread of this process on `cores` (threads started later inherit it); returns
    the cores it ran on before, for unpin_process. (Torch's thread count is per thread under
    OpenMP: the thread that runs the forward sets its own, see threads_for.)"""
    before = set(os.sched_getaffinity(0)) if CAN_PIN else None
    _set_affinity(set(cores))
    return before


def unpin_process(before: set[int] | None) -> None:
    if before is not None:
        _set_affinity(before)


def threads_for(cores: list[int], threads: int | None) -> int:
    """Torch threads for a side pinned to `cores`: one per core, or `threads` if fewer."""
    return min(len(cores), threads or len(cores))


def _set_affinity(cores: set[int]) -> None:
    if not CAN_PIN:
        return
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):   # a thread that just ended
            pass


class DecodeCores:
    """The engine's side while disaggregated: every thread of the process pinned to the decode
    cores, and the step thread's torch thread count set to match there (apply(), at each step's
    start on that thread) and put back once unpinned. Pinning and unpinning happen on whichever
    thread turns disaggregation on or off; only apply() touches the step thread's count."""

    def __init__(self) -> None:
        self._affinity: set[int] | None = None        # the cores before pinning
        self._want: int | None = None                 # the count apply() sets next
        self._before: int | None = None               # the step thread's count before pinning

    def pin(self, cores: list[int], threads: int | None) -> None:
        self._affinity = pin_process(cores)
        self._want = threads_for(cores, threads)

    def unpin(self) -> None:
        unpin_process(self._affinity)
        self._affinity = None
        self._want = self._before                     # (None: apply() never ran, nothing to undo)

    def apply(self) -> None:
        if self._want is None:
            return
        if self._affinity is not None and self._before is None:
            self._before = torch.get_num_threads()
        if torch.get_num_threads() != self._want:
            torch.set_num_threads(self._want)
        if self._affinity is None:                    # restored: done until the next pin
            self._want = self._before = None
