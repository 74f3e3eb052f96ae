"""The target model's weight precision at run time: its load dtype, or int8 weight-only copies.

The int8 copies are made once (or read from the on-disk cache) and kept beside the originals, so
the mode flips without reloading, and a self-draft can run them while the target verifies.
"""
from __future__ import annotations

import torch

from . import quant
from .loader import LoadedModel
from .model_source import ModelFiles


class WeightPrecision:
    def __init__(self, loaded: LoadedModel, files: ModelFiles, device: torch.device, dtype: torch.dtype):
        self.loaded = loaded
        self.files = files
        self.device = device
        self.dtype = dtype
        self.read_bytes = quant.decode_read_bytes(loaded.model, loaded.quant)   # per decode step
        self.resident_bytes = quant.resident_bytes(loaded.model)                # held in memory

    @property
    def switch(self) -> quant.QuantSwitch:
        """Shared by every quantized layer: which weights the next forward reads."""
        return self.loaded.quant

    def ensure_int8(self) -> bool:
        """Make the int8 weight copies (from the cache when possible); False if unsupported here."""
        if not self.loaded.quant.ops.int8_supported(self.device):
            return False
        model = self.loaded.model
        cache = quant.cache_file(self.files)
        if cache is None or not cache.is_file() or not quant.load(model, cache):
            quant.prepare(model)
            if cache is not None:
                quant.save(model, cache)
        self.resident_bytes = quant.resident_bytes(model)
        return True

    def set(self, mode: str, notices: list[str]) -> str:
        """Switch to `mode` (none | int8); returns the mode in effect, with a notice when int8
        cannot run here."""
        if mode == "int8" and not self.ensure_int8():
            notices.append(f"int8 weights are not supported on {self.device} by this torch build; "
                           f"running {str(self.dtype).removeprefix('torch.')}")
            mode = "none"
        self.loaded.quant.int8 = mode == "int8"
        self.read_bytes = quant.decode_read_bytes(self.loaded.model, self.loaded.quant)
        return mode

    def release(self) -> None:
        """Drop the model (the engine is closing); the figures stay readable."""
        self.loaded = self.files = None
