"""Whether speculative decoding and quantized weights pay on this machine, measured while
decoding: the UI should say when an optimization does not help here, with the figures.

Speculative decoding (SpecPayoff) is turned off when it does not pay. A draft pays only when
drafting and verifying k tokens costs less than the tokens it saves: on a CPU where int8 is
barely faster than fp32, the int8 self-draft slowed decoding to 0.7x (README). Rather than
guess from the CPU's features, the engine measures: decode-only steps' tokens per
request-second with drafts, and, every PROBE_EVERY speculative steps, one step of the same batch
without drafts (a probe). Once both are measured at one batch size, a method making
fewer than LOSS x the plain rate is turned off with the two figures as the reason.

Quantized weights (QuantPayoff) are compared with the mode before them the same way, and kept:
they save memory even where they save no time.
"""
from __future__ import annotations

from collections import defaultdict, deque
from statistics import median

PROBE_EVERY = 8          # speculative steps between probes
MIN_SPEC_STEPS = 16      # measured steps with drafts before a verdict
MIN_PROBES = 2
LOSS = 0.95              # below this share of the plain rate, speculation does not pay
SPEC_WINDOW = 64         # the recent steps a rate is the median of (a server runs for days)


class SpecPayoff:
    """Decode-only steps' tokens per request-second, with drafts and in probes without, per
    batch size; the verdict that speculation does not pay once both are measured."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget what was measured (the method or the draft length changed)."""
        self._with: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=SPEC_WINDOW))
        self._without: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=SPEC_WINDOW))
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
                f"verifying cost more than the tokens they saved")


QUANT_STEPS = 8          # decode-only steps at one batch size in each mode before comparing
QUANT_WINDOW = 64        # the recent steps a mode's time is the median of
QUANT_GAIN = 1.1         # a quantized mode under this speed-up is said to save memory only


class QuantPayoff:
    """Decode-only step times per weight mode and batch size. After a switch, once both modes
    have QUANT_STEPS steps at one batch size, one verdict: when the new quantized mode is not
    QUANT_GAIN x faster than the old one (a CPU whose integer products are no faster than its
    fp32 ones), why it helps memory but not speed, or neither (full precision held in exact blocks
    can take fewer bytes than int8). Quantization is not turned off: that is the user's choice."""

    def __init__(self) -> None:
        self._times: dict[tuple[str, int], deque[float]] = defaultdict(lambda: deque(maxlen=QUANT_WINDOW))
        self._pending: tuple[str, str, int, int] | None = None     # (old mode, new mode, bytes before, after)

    def switched(self, old: str, new: str | None, bytes_before: int, bytes_after: int) -> None:
        """The weights went from `old` to quantized `new` (None: to full precision, nothing to
        weigh), the model holding bytes_before and then bytes_after."""
        self._pending = (old, new, bytes_before, bytes_after) if new is not None else None

    def record(self, mode: str, requests: int, seconds: float) -> str | None:
        """One decode-only step without drafts; returns the verdict once it is measured and
        the new mode is not faster, else None."""
        self._times[(mode, requests)].append(seconds)
        if self._pending is None or self._pending[1] != mode:
            return None
        old, new, bytes_before, bytes_after = self._pending
        before, after = self._times[(old, requests)], self._times[(new, requests)]
        if len(before) < QUANT_STEPS or len(after) < QUANT_STEPS:
            return None
        self._pending = None
        gain = median(before) / median(after)
        if gain >= QUANT_GAIN:
            return None
        said = (f"{new} weights decode at {gain:.2f}x the speed of {old} on this machine ({len(after)} steps "
                f"at batch {requests})")
        memory = f"{bytes_before / 1e6:,.0f} -> {bytes_after / 1e6:,.0f} MB of weights"
        if bytes_after < bytes_before:
            return (f"{said}: this CPU's integer products are no faster than its float ones, so {new} saves "
                    f"memory ({memory}), not time")
        return (f"{said} and hold no less memory ({memory}: this model's {old} weights are stored in "
                f"fewer bytes), so {new} saves neither time nor memory here")
