"""Which cores the prefill worker and the decoding engine get, and pinning a process to its share.

Pinning is what keeps the two apart: without it the OS moves both sides' threads across all the
cores, and a prefill still slows the streams down. Where the OS cannot pin (macOS), each side
still runs as many threads as its share, and the split is a request rather than a guarantee.
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


def pin_process(cores: list[int], threads: int | None = None) -> tuple[set[int] | None, int]:
    """Run every thread of this process on `cores` (threads started later inherit it) and use that
    many threads for torch and the C kernels (or `threads`, if fewer). Returns what was in force,
    for unpin_process."""
    before = (set(os.sched_getaffinity(0)) if CAN_PIN else None, torch.get_num_threads())
    _set_affinity(set(cores))
    torch.set_num_threads(min(len(cores), threads or len(cores)))
    return before


def unpin_process(before: tuple[set[int] | None, int]) -> None:
    affinity, threads = before
    if affinity is not None:
        _set_affinity(affinity)
    torch.set_num_threads(threads)


def _set_affinity(cores: set[int]) -> None:
    if not CAN_PIN:
        return
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):   # a thread that just ended
            pass
