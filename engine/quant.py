"""Weight-only int8 quantization (per-output-channel scales) for the linear layers and LM head.

Decode on CPU is bound by reading weights: int8 moves a quarter of fp32's bytes, and for small
models the whole int8 model fits in a large L3 cache. Each `QuantLinear` keeps its full-precision
weight too, so the mode can flip at run time and a speculative "self-draft" can run the int8
copy while the target verifies with the original weights.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class QuantSwitch:
    """Shared by all QuantLinear layers of a model: which weights the next forward uses."""

    def __init__(self) -> None:
        self.int8 = False


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization: weight [N, K] -> (int8 [N, K], scales [N])."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


class QuantLinear(nn.Module):
    """A linear layer with an optional int8 copy of its weight."""

    def __init__(self, linear: nn.Linear | None, switch: QuantSwitch, weight: torch.Tensor | None = None):
        super().__init__()
        self.weight = linear.weight if linear is not None else weight
        self.bias = linear.bias if linear is not None else None
        self.switch = switch
        self.register_buffer("qweight", None, persistent=False)
        self.register_buffer("scales", None, persistent=False)

    def prepare(self) -> None:
        if self.qweight is None:
            self.qweight, self.scales = quantize_int8(self.weight)

    @property
    def act_dtype(self) -> torch.dtype:
        # aten's int8 CPU kernel is fast with bf16 activations (its fp32 path is not).
        return torch.bfloat16 if self.weight.device.type == "cpu" else self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.switch.int8 and self.qweight is not None):
            rows = x.shape[0]
            if x.device.type == "cpu" and 1 < rows < 4:
                # CPU BLAS runs a 2- or 3-row product as that many matrix-vector passes, each
                # reading the whole weight (2-3.5x a single row, measured); padded to 4 rows it is
                # one matrix product. Batches of 2-3 and short speculative verifies hit this.
                padded = torch.cat([x, x.new_zeros(4 - rows, x.shape[1])])
                return F.linear(padded, self.weight, self.bias)[:rows]
            return F.linear(x, self.weight, self.bias)
        # The engine's activations are always [tokens, features]: no reshape needed.
        y = torch.ops.aten._weight_int8pack_mm(x.to(self.scales.dtype), self.qweight, self.scales).to(x.dtype)
        return y + self.bias if self.bias is not None else y


def int8_supported(device: torch.device) -> bool:
    """Whether this torch build runs the int8 weight-only matmul on the device."""
    try:
        x = torch.zeros(1, 32, dtype=torch.bfloat16, device=device)
        q = torch.zeros(8, 32, dtype=torch.int8, device=device)
        torch.ops.aten._weight_int8pack_mm(x, q, torch.ones(8, dtype=torch.bfloat16, device=device))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def install(model: nn.Module) -> QuantSwitch:
    """Wrap every nn.Linear of the model (and a tied LM head) in QuantLinear; fp weights unchanged."""
    switch = QuantSwitch()
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, QuantLinear(child, switch))
    return switch


def prepare(model: nn.Module) -> None:
    """Compute the int8 copies (once)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.prepare()
            module.scales = module.scales.to(module.act_dtype)


@contextlib.contextmanager
def int8_mode(switch: QuantSwitch, on: bool = True) -> Iterator[None]:
    saved, switch.int8 = switch.int8, on
    try:
        yield
    finally:
        switch.int8 = saved


def _quant_modules(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def save(model: nn.Module, path) -> None:
    from safetensors.torch import save_file
    tensors = {}
    for name, m in _quant_modules(model).items():
        tensors[f"{name}.qweight"] = m.qweight.contiguous().cpu()
        tensors[f"{name}.scales"] = m.scales.contiguous().cpu()
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
        if q.shape != m.weight.shape:
            return False
        m.qweight, m.scales = q.to(m.weight.device), s.to(m.weight.device, m.act_dtype)
    return True


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
