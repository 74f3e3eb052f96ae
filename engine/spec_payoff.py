"""Whether speculative decoding pays on this machine, measured while it runs.

A draft pays only when drafting and verifying k tokens costs less than the tokens it saves: on
a CPU where int8 is barely faster than fp32, the int8 self-draft slowed decoding to 0.7x
(README). Rather than guess from the CPU's features, the engine measures: decode-only steps'
tokens per request-second with drafts, and, every PROBE_EVERY speculative steps, one step of the
same batch without drafts (a probe). Once both are measured at one batch size, a method making
fewer than LOSS x the plain rate is turned off with the two figures as the reason.
"""
from __future__ import annotations

from collections import defaultdict
from statistics import median

PROBE_EVERY = 8          # speculative steps between probes
MIN_SPEC_STEPS = 16      # measured steps with drafts before a verdict
MIN_PROBES = 2
LOSS = 0.95              # below this share of the plain rate, speculation does not pay


class SpecPayoff:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget what was measured (the method, the weights or the draft length changed)."""
        # per batch size: each step's tokens per request-second
        self._with: dict[int, list[float]] = defaultdict(list)
        self._without: dict[int, list[float]] = defaultdict(list)
        self._since_probe = 0

    def probe_now(self) -> bool:
        """Whether the next decode-only step should run without drafts."""
        return self._since_probe >= PROBE_EVERY

    def record(self, requests: int, tokens: int, seconds: float, drafted: bool, method: str) -> str | None:
        """One decode-only step of `requests` requests that made `tokens` tokens in `seconds`;
        returns why speculation should stop, once it measurably does not pay, else None."""
        if requests < 1 or seconds <= 0:
            return None
        rate = tokens / requests / seconds
        if drafted:
            self._with[requests].append(rate)
            self._since_probe += 1
        else:
            self._without[requests].append(rate)
            self._since_probe = 0
        return self._verdict(requests, method)

    def _verdict(self, requests: int, method: str) -> str | None:
        with_, without = self._with[requests], self._without[requests]
        if len(with_) < MIN_SPEC_STEPS or len(without) < MIN_PROBES:
            return None
        spec, plain = median(with_), median(without)
        if spec >= LOSS * plain:
            return None
        return (f"{method} decoded {spec:.1f} tok/s per request against {plain:.1f} without drafts on "
                f"this machine ({len(with_)} steps measured at batch {requests}): drafting and "
                f"verifying cost more than the tokens it saved")
