"""Whether the machine was busy with other work while the lab measured: a verdict timed on a busy
machine says so ("noisy") instead of passing for a clean measurement."""
from __future__ import annotations

from typing import Any

import psutil

from pdchat.engine.telemetry import ProcessFamily

BUSY_PCT = 30.0        # others' share of the whole machine (all CPUs) that makes timings noisy

# Which experiments each claim's numbers come from (the KV arithmetic times nothing).
CLAIM_SOURCES = {"prefill_linear": ("prefill",), "decode_slow_growth": ("decode",),
                 "prefill_vs_decode": ("prefill", "decode"), "int8_memory_bound": ("int8",), "kv_bytes": (),
                 "prefix_cache": ("prefix_cache",), "batching": ("batching",),
                 "chunked_prefill": ("chunked_prefill",), "disaggregation": ("disaggregation",),
                 "spec": ("spec",)}


class OthersLoad:
    """Other processes' mean share of the machine (%) between successive calls: the machine's CPU
    use less this process's own (its prefill worker's included), both over all the machine's CPUs."""

    def __init__(self, process: Any = None, cpu_percent: Any = None, cpus: int | None = None):
        self.process = process or ProcessFamily()
        self.cpu_percent = cpu_percent or psutil.cpu_percent
        self.cpus = cpus or psutil.cpu_count() or 1
        self.since_last()                    # psutil's first reading of each only starts the clock

    def since_last(self) -> float | None:
        try:
            machine, own = self.cpu_percent(interval=None), self.process.cpu_percent(interval=None)
        except (psutil.Error, OSError):
            return None
        return max(0.0, machine - own / self.cpus)


def mark_noisy(claims: list[dict[str, Any]], busy: dict[str, float | None]) -> list[dict[str, Any]]:
    """Each verdict timed while others used BUSY_PCT or more of the machine gets a `noisy` note."""
    for claim in claims:
        loads = [busy.get(key) for key in CLAIM_SOURCES.get(claim["id"], ())]
        worst = max((v for v in loads if v is not None), default=None)
        if worst is not None and worst >= BUSY_PCT:
            claim["noisy"] = f"noisy: the machine was busy (other processes used {worst:.0f}% of it)"
    return claims
