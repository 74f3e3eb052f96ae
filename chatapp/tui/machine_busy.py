"""Whether other processes keep the machine busy, from the engine's CPU figures over time.

pdchat's timings are only as steady as the machine under them: when other work takes a good
share of the CPUs for a few seconds, the panel says so. Both figures are % of the whole machine
(all logical CPUs): `cpu_util_pct` the machine's, `process_cpu_pct` the engine process's own.
"""
from __future__ import annotations

BUSY_PCT = 30.0       # other processes' share of the machine that makes timings noisy
BUSY_S = 3.0          # for at least this long, so one burst does not raise the warning


class MachineBusy:
    """Fed successive readings; says how much other processes use once they have used at least
    BUSY_PCT of the machine for BUSY_S seconds."""

    def __init__(self, pct: float = BUSY_PCT, seconds: float = BUSY_S):
        self.pct = pct
        self.seconds = seconds
        self._since: float | None = None       # when the others' share first reached pct

    def update(self, now: float | None, machine_pct: float | None, own_pct: float | None) -> float | None:
        """The others' share (%) while the machine has been busy long enough, else None. A
        missing reading or clock is no evidence of a busy machine, so it resets the watch."""
        if now is None or machine_pct is None or own_pct is None or machine_pct - own_pct < self.pct:
            self._since = None
            return None
        if self._since is None:
            self._since = now
        return machine_pct - own_pct if now - self._since >= self.seconds else None
