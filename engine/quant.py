"""Weight-only int8 quantization (per-output-channel scales) for the linear layers and LM head.

Decode on CPU is bound by reading weights: int8 moves a quarter of fp32's bytes. Each
`QuantLinear` keeps its full-precision weight too, so the mode can flip at run time and a
speculative "self-draft" can run the int8 copy while the target verifies with the original weights.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import torch
from torch import nn

from .model_source import ModelFiles
from .paths import cache_dir, models_dir


class QuantSwitch:
    """Shared by all QuantLinear layers of a model: which weights the next forward uses, and the
    kernel backend that runs the products (it also decides the int8 weights' packed layout)."""

    def __init__(self, ops: SimpleNamespace) -> None:
        self.int8 = False
        self.ops = ops
        self.version = 0     # bumped when any layer's int8 weights change (cached kernel plans go stale)


QUANT_ROWS = 4096


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization: weight [N, K] -> (int8 [N, K], fp32 scales [N]), QUANT_ROWS
    rows at a time: a vocabulary-sized matrix in one go made GBs of fp32 temporaries."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for lo in range(0, weight.shape[0], QUANT_ROWS):
        w = weight[lo:lo + QUANT_ROWS].float()
        s = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q[lo:lo + QUANT_ROWS] = torch.round(w / s[:, None]).clamp(-127, 127)
        scales[lo:lo + QUANT_ROWS] = s
    return q, scales


class QuantLinear(nn.Module):
    """A linear layer with an optional int8 copy of its weight (packed for the backend)."""

    def __init__(self, linear: nn.Linear | None, switch: QuantSwitch, weight: torch.Tensor | None = None):
        super().__init__()
        self.weight = linear.weight if linear is not None else weight
        self.bias = linear.bias if linear is not None else None
        self.switch = switch
        self.register_buffer("qweight", None, persistent=False)
        self.register_buffer("scales", None, persistent=False)

    def set_int8(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        """Adopt canonical int8 weights (int8 [N, K], fp32 scales [N])."""
        device = self.weight.device
        self.qweight, self.scales = self.switch.ops.pack_int8(q.to(device), scales.to(device), self.weight.dtype)
        self.switch.version += 1

    def int8_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The canonical form back (for the cache file)."""
        return self.switch.ops.unpack_int8(self.qweight, self.scales)

    def active_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight, scales, bias) of the next forward: the packed int8 copy with its scales when
        int8 is on, else the full-precision weight and None."""
        if self.switch.int8 and self.qweight is not None:
            return self.qweight, self.scales, self.bias
        return self.weight, None, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The engine's activations are always [tokens, features]: no reshape needed.
        weight, scales, bias = self.active_weights()
        if scales is not None:
            return self.switch.ops.linear_int8(x, weight, scales, bias)
        return self.switch.ops.linear(x, weight, bias)


def install(model: nn.Module, ops: SimpleNamespace) -> QuantSwitch:
    """Wrap every nn.Linear of the model in QuantLinear; fp weights unchanged."""
    switch = QuantSwitch(ops)
    model.quant_switch = switch
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, QuantLinear(child, switch))
    return switch


def prepare(model: nn.Module) -> None:
    """Compute the int8 copies (once)."""
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.qweight is None:
            module.set_int8(*quantize_int8(module.weight))


@contextlib.contextmanager
def int8_mode(switch: QuantSwitch, on: bool = True) -> Iterator[None]:
    saved, switch.int8 = switch.int8, on
    try:
        yield
    finally:
        switch.int8 = saved


def _quant_modules(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def cache_file(files: ModelFiles) -> Path | None:
    """Where a model's int8 weights are cached: beside our own converted checkpoints, else in the
    cache folder; None for random weights (cheap to regenerate)."""
    if files.path is None:
        return None
    if files.path.parent == models_dir():
        return files.path / "int8.safetensors"
    folder = cache_dir() / "quant"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / (files.name.replace("/", "--").replace(":", "-") + ".int8.safetensors")


def save(model: nn.Module, path) -> None:
    from safetensors.torch import save_file
    tensors = {}
    for name, m in _quant_modules(model).items():
        q, scales = m.int8_weights()
        tensors[f"{name}.qweight"] = q.contiguous().cpu()
        tensors[f"{name}.scales"] = scales.contiguous().cpu()
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp))
    tmp.replace(path)                      # atomic: never a half-written cache


def load(model: nn.Module, path) -> bool:
    """Fill the int8 copies from a cache file; False if it does not match this model."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError):
        return False
    modules = _quant_modules(model)
    if set(tensors) != {f"{n}.{k}" for n in modules for k in ("qweight", "scales")}:
        return False
    for name, m in modules.items():
        q, s = tensors[f"{name}.qweight"], tensors[f"{name}.scales"]
        # (caches from before fp32 scales hold bf16 ones: rebuilt rather than trusted)
        if q.shape != m.weight.shape or q.dtype != torch.int8 or s.dtype != torch.float32:
            return False
    for name, m in modules.items():
        m.set_int8(tensors[f"{name}.qweight"], tensors[f"{name}.scales"])
    return True


def resident_bytes(model: nn.Module) -> int:
    """Bytes the model holds in memory: every parameter and buffer once (tied ones once), the int8
    copies beside the full-precision weights included."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def decode_read_bytes(model: nn.Module, switch: QuantSwitch) -> int:
    """Weight bytes one decode step reads: every linear layer (int8 copy when active), the norms;
    the embedding contributes one row per token, which is negligible."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            if switch.int8 and m.qweight is not None:
                total += m.qweight.numel() + m.scales.numel() * m.scales.element_size()
            else:
                total += m.weight.numel() * m.weight.element_size()
            if m.bias is not None:
                total += m.bias.numel() * m.bias.element_size()
        elif type(m).__name__ == "RMSNorm":
            total += m.weight.numel() * m.weight.element_size()
    return total
