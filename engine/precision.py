"""The target model's weight precision at run time: its load dtype, int8 or int4 weight-only.

Weights are held once, in the precision that runs: switching reads the checkpoint again (the
quantized forms from their cache file when there is one) and drops the old form matrix by matrix.
The int8 self-draft is the exception: it runs int8 copies kept beside full-precision weights.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from . import quant
from .loader import LoadedModel, place_weights
from .memory import release_freed_memory
from .payoff import QuantPayoff


def unsupported(mode: str, ops: SimpleNamespace, device: torch.device) -> str | None:
    """Why weights in `mode` cannot run on `device` with the kernel backend `ops`, or None."""
    if mode == "int8" and not ops.int8_supported(device):
        return f"int8 weights are not supported on {device} by this torch build"
    return None


class WeightPrecision:
    def __init__(self, loaded: LoadedModel, device: torch.device, dtype: torch.dtype):
        self.loaded = loaded
        self.device = device
        self.dtype = dtype
        self.payoff = QuantPayoff()
        self._measure()

    @property
    def switch(self) -> quant.QuantSwitch:
        """Shared by every quantized layer: which weights the next forward reads."""
        return self.loaded.quant

    @property
    def mode(self) -> str:
        return self.loaded.quant.mode

    def _measure(self) -> None:
        self.read_bytes = quant.decode_read_bytes(self.loaded.model)        # per decode step
        self.resident_bytes = quant.resident_bytes(self.loaded.model)       # held in memory

    def supported(self, mode: str) -> str | None:
        """Why `mode` cannot run here, or None."""
        return unsupported(mode, self.loaded.quant.ops, self.device)

    def set(self, mode: str, notices: list[str]) -> str:
        """Switch to `mode` (none | int8 | int4), reading the weights again when it changes;
        returns the mode in effect, with a notice when `mode` cannot run here."""
        reason = self.supported(mode)
        if reason is not None:
            notices.append(f"{reason}; running {self.label('none')}")
            mode = "none"
        old, before = self.mode, self.resident_bytes
        if mode != old:
            place_weights(self.loaded, self.device, self.dtype, mode)
            release_freed_memory(self.device)
        self._measure()
        if mode != old:
            self.payoff.switched(self.label(old), self.label(mode) if mode != "none" else None,
                                 before, self.resident_bytes)
        return mode

    def label(self, mode: str) -> str:
        """A mode as people read it: the load dtype's name for "none"."""
        return str(self.dtype).removeprefix("torch.") if mode == "none" else mode

    def measured(self, requests: int, seconds: float) -> str | None:
        """After a decode-only step without drafts: why the quantized weights just switched to
        are no faster here, once measured (payoff.py), else None."""
        return self.payoff.record(self.label(self.mode), requests, seconds)

    def self_draft_refusal(self) -> str | None:
        """Why the int8 self-draft cannot run beside the weights in use, or None (then the int8
        copies exist once this returns)."""
        if self.mode != "none":
            return (f"self-draft drafts with int8 copies of full-precision weights; with {self.mode} "
                    f"weights it would cost as much as the model it drafts for")
        reason = self.supported("int8")
        if reason is not None:
            return reason
        quant.add_copies(self.loaded.model, "int8", self.device)
        self._measure()
        return None

    def drop_draft_copies(self) -> None:
        """The self-draft stopped: its int8 copies go."""
        if self.mode == "none":
            quant.drop_copies(self.loaded.model, "int8")
            self._measure()

    def release(self) -> None:
        """Drop the model (the engine is closing); the figures stay readable."""
        self.loaded = None
