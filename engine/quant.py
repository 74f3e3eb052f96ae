"""Weight-only quantization of the linear layers, the LM head and the embedding: int8 (one scale
per output row) and int4 (groups of 32 weights of a row with a scale and an offset each; the
embedding and a tied LM head stay int8 in int4 mode, as llama.cpp keeps its output matrix at
higher precision: on the default model int4 there cost 8 % in perplexity).

Decode on a CPU is bound by reading weights: int8 moves a quarter of fp32's bytes, int4 about an
eighth. Weights are held once, in the precision that runs: the loader quantizes each tensor as it
reads it (loader.py), so a quantized model never holds its full-precision weights, and switching
precision at run time reads the checkpoint again (precision.py). The one exception is the int8
self-draft, which runs int8 copies made beside the full-precision weights the target verifies with.

Full precision has two more forms, lossless (hold_exact): a matrix whose every 32 weights of a row
are d * u + m with u in 0..15 (a GGUF Q4_1 matrix read as fp32: every layer matrix of the default
model) is held as its nibbles and (d, m) (EXACT_Q4, 0.75 bytes a weight), and one whose every 32
weights are one scale times integers in -127..127 (a GGUF Q8_0 matrix: the default model's
embedding and tied LM head) as those integers and scales (EXACT_INT8, a quarter of fp32's bytes).
The same numbers and the same products bit for bit, from fewer bytes to read each decode step.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pdchat.kernels import reference
from .model_source import ModelFiles
from .paths import cache_dir, models_dir

FORMATS = ("int8", "int4")          # quantized weight formats; "none" runs the load dtype
EXACT_INT8 = "exact-int8"           # "none"'s fp32 matrix held in exact int8 blocks (reference.py)
EXACT_Q4 = "exact-q4"               # ... in exact Q4 blocks (reference.py)
INT4_GROUP = reference.INT4_GROUP
INT4_WIDTH = 64                     # int4 matrices' widths are multiples of this (the kernels' unit)
QUANT_ROWS = 4096


class QuantSwitch:
    """Shared by all quantized layers of a model: which weights the next forward uses, and the
    kernel backend that runs the products (it also decides int8's packed layout)."""

    def __init__(self, ops: SimpleNamespace, mode: str = "none") -> None:
        self.mode = mode         # none | int8 | int4
        self.ops = ops
        self.version = 0         # bumped when any layer's weights change (cached kernel plans go stale)


# ---- quantizers: full-precision weight [N, K] -> its stored form (two tensors) --------------

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


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric groups of 32: weight [N, K] (K a multiple of 64) -> (packed uint8 [N, K / 2],
    bf16 params [N, K / 32, 2]), the form every backend stores (kernels/reference.py). Each group
    spans its own minimum to maximum in 15 steps; u is rounded against the bf16 (d, m) it will be
    read with."""
    N, K = weight.shape
    packed = torch.empty(N, K // 2, dtype=torch.uint8, device=weight.device)
    params = torch.empty(N, K // INT4_GROUP, 2, dtype=torch.bfloat16, device=weight.device)
    for lo in range(0, N, QUANT_ROWS):
        w = weight[lo:lo + QUANT_ROWS].float().view(-1, K // INT4_GROUP, INT4_GROUP)
        low = w.amin(dim=2)
        d = ((w.amax(dim=2) - low) / 15).to(torch.bfloat16)
        m = low.to(torch.bfloat16)
        step = d.float().clamp(min=1e-30)[..., None]
        u = torch.round((w - m.float()[..., None]) / step).clamp(0, 15).to(torch.uint8)
        rows = w.shape[0]
        packed[lo:lo + rows] = reference.pack_int4(u.view(rows, K))
        params[lo:lo + rows] = torch.stack([d, m], dim=2)
    return packed, params


QUANTIZERS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "int8": quantize_int8, "int4": quantize_int4}


def fits(fmt: str, weight: torch.Tensor) -> bool:
    """Whether a matrix can take the format (int4: a width that is a multiple of 64)."""
    return weight.dim() == 2 and (fmt != "int4" or weight.shape[1] % INT4_WIDTH == 0)


# ---- layers ---------------------------------------------------------------------------------

class Quantized(NamedTuple):
    """A matrix's quantized weights as the backend stores them."""
    fmt: str                 # int8 | int4 | exact-int8 | exact-q4
    weight: torch.Tensor     # int8: packed by the backend; int4, exact-q4: packed nibbles; exact-int8: int8
    scales: torch.Tensor     # int8: per row; int4: bf16 (d, m) per group; exact-int8: per 32; exact-q4: fp32 (d, m)
    # (exact forms: by layouts, the rows' first, reference.py)


class QuantLinear(nn.Module):
    """A linear layer whose weight is held in full precision, quantized, or (int8 self-draft)
    both. `quantized` maps a mode (the switch's) to the weights that mode runs; under "none", a
    full-precision matrix held in exact blocks (hold_exact), with no `weight` beside it."""

    def __init__(self, linear: nn.Linear | None, switch: QuantSwitch, dtype: torch.dtype,
                 weight: torch.Tensor | None = None):
        super().__init__()
        self.weight = linear.weight if linear is not None else weight
        self.bias = linear.bias if linear is not None else None
        self.switch = switch
        self.dtype = dtype                        # the activations' (and full-precision weights') dtype
        self.quantized: dict[str, Quantized] = {}
        self.multiplied = True                    # products read the matrix (an embedding: only when tied)

    def format_for(self, mode: str) -> str:
        """The format this matrix takes in `mode`."""
        return mode

    def adopt(self, mode: str, stored: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> None:
        """Take weights in their stored form (a quantizer's output, or the cache file's) for `mode`."""
        fmt = self.format_for(mode)
        a, b = stored[0].to(device), stored[1].to(device)
        if fmt == "int8":
            a, b = self.switch.ops.pack_int8(a, b, self.dtype)
        self.quantized[mode] = Quantized(fmt, a, b)
        self.switch.version += 1

    def quantize(self, mode: str, weight: torch.Tensor, device: torch.device) -> None:
        self.adopt(mode, QUANTIZERS[self.format_for(mode)](weight.to(device)), device)

    def hold_exact(self, weight: torch.Tensor) -> bool:
        """Hold a full-precision weight in exact blocks, if the backend finds it has one of their
        forms (Q4 tried first: fewer bytes): the same products from fewer bytes, for every mode
        that has no form of its own."""
        ops = self.switch.ops
        for fmt, find in ((EXACT_Q4, ops.exact_q4_blocks), (EXACT_INT8, ops.exact_int8_blocks)):
            found = find(weight, multiplied=self.multiplied)
            if found is not None:
                self.quantized["none"] = Quantized(fmt, *found)
                self.weight = None
                self.switch.version += 1
                return True
        return False

    @property
    def full_precision(self) -> bool:
        """Whether the matrix is held in full precision (as loaded, or in exact blocks)."""
        return self.weight is not None or "none" in self.quantized

    def full_precision_weight(self) -> torch.Tensor | None:
        """The full-precision weight, rebuilt from exact blocks where held so; None for a matrix
        held only quantized."""
        exact = self.quantized.get("none")
        if self.weight is not None or exact is None:
            return self.weight
        return dequantize_exact(exact.fmt, *reference.exact_rows(exact.weight, exact.scales))

    def running(self) -> Quantized | None:
        """The stored form the next forward multiplies by: the switch mode's, else the exact blocks
        of a full-precision weight held so; None: the full-precision weight itself."""
        return self.quantized.get(self.switch.mode) or (self.quantized.get("none") if self.weight is None else None)

    def stored(self, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The mode's weights in their backend-independent stored form, for the cache file: int8
        canonical (int8, fp32 scales), int4 packed (the same for every backend)."""
        fmt, a, b = self.quantized[mode]
        return self.switch.ops.unpack_int8(a, b) if fmt == "int8" else (a, b)

    def active_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight, scales, bias) of the next forward: the quantized weights of the switch's mode
        when this layer has them, else the full-precision weight and None."""
        got = self.running()
        if got is not None:
            return got.weight, got.scales, self.bias
        return self.weight, None, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The engine's activations are always [tokens, features]: no reshape needed.
        ops = self.switch.ops
        got = self.running()
        if got is None:
            return ops.linear(x, self.weight, self.bias)
        if got.fmt == "int4":
            return ops.linear_int4(x, got.weight, got.scales, self.bias)
        if got.fmt == EXACT_INT8:
            return ops.linear_exact_int8(x, got.weight, got.scales, self.bias)
        if got.fmt == EXACT_Q4:
            return ops.linear_exact_q4(x, got.weight, got.scales, self.bias)
        return ops.linear_int8(x, got.weight, got.scales, self.bias)


def dequantize_exact(fmt: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The fp32 weights (rows of them) of a matrix held in exact blocks of either form, in their
    rows' layout (reference.exact_rows)."""
    if fmt == EXACT_Q4:
        return reference.dequantize_exact_q4(a, b)
    return reference.dequantize_exact_int8(a, b)


class QuantEmbedding(QuantLinear):
    """The token embedding: rows looked up by token id, dequantized when the matrix is held
    quantized. A tied LM head projects with the same matrix (TiedHead)."""

    def __init__(self, embedding: nn.Embedding, switch: QuantSwitch, dtype: torch.dtype):
        super().__init__(None, switch, dtype, weight=embedding.weight)

    def format_for(self, mode: str) -> str:
        return "int8"         # in int4 mode too: int4 here cost 8 % in perplexity (module docstring)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        fmt, a, b = self.running() or next(iter(self.quantized.values()))
        if fmt == "int4":
            return reference.dequantize_int4(a[ids], b[ids], self.dtype)
        if fmt in (EXACT_INT8, EXACT_Q4):
            rows, params = reference.exact_rows(a, b)
            return dequantize_exact(fmt, rows[ids], params[ids])
        q, s = self.switch.ops.unpack_int8(a[ids], b[ids])
        return q.to(self.dtype) * s.to(self.dtype)[:, None]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return QuantLinear.forward(self, x)


class TiedHead(nn.Module):
    """An LM head that shares the embedding's matrix (held, quantized or not, by the embedding)."""

    def __init__(self, embed: QuantEmbedding):
        super().__init__()
        self.embed = embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed.project(x)


def install(model: nn.Module, ops: SimpleNamespace, dtype: torch.dtype, mode: str = "none") -> QuantSwitch:
    """Wrap every nn.Linear and the embedding (and a tied LM head) so they can hold quantized
    weights; works on a model still on the meta device."""
    switch = QuantSwitch(ops, mode)
    model.quant_switch = switch
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, QuantLinear(child, switch, dtype))
    model.embed = QuantEmbedding(model.embed, switch, dtype)
    model.embed.multiplied = model.lm_head is None
    if model.lm_head is None:
        model.lm_head = TiedHead(model.embed)
    return switch


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """Every matrix that can be held quantized (the embedding included), by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def step_linears(model: nn.Module) -> list[QuantLinear]:
    """The matrices a decode step multiplies by: every linear layer and the LM head (the
    embedding's matrix when tied), not the embedding lookup."""
    head = model.lm_head
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and not isinstance(m, QuantEmbedding)]
    return layers + [head.embed] if isinstance(head, TiedHead) else layers


@contextlib.contextmanager
def precision_mode(switch: QuantSwitch, mode: str) -> Iterator[None]:
    """Run the forwards inside with another format (a self-draft's int8 copies)."""
    saved, switch.mode = switch.mode, mode
    try:
        yield
    finally:
        switch.mode = saved


def add_copies(model: nn.Module, mode: str, device: torch.device) -> None:
    """Quantize every full-precision matrix that fits into `mode`, beside its weight (self-draft);
    one held in exact blocks is quantized from its weights rebuilt: the draft's int8 LM head runs
    integer dot products, where exact blocks rebuild every weight as a float (the default model's
    head 1.5-1.7 ms against 2.3, 2-core AMD EPYC, AVX2, 2026-11-28)."""
    for m in quantized_layers(model).values():
        if mode in m.quantized or not m.full_precision:
            continue
        weight = m.full_precision_weight()
        if fits(m.format_for(mode), weight):
            m.quantize(mode, weight, device)


def drop_copies(model: nn.Module, mode: str) -> None:
    for m in quantized_layers(model).values():
        if mode != "none" and m.full_precision:
            m.quantized.pop(mode, None)


# ---- the on-disk cache of quantized weights -------------------------------------------------

CACHE_VERSION = {"int8": "int8", "int4": "int4-g32"}   # a new quantizer or format gets a new file name


def cache_file(files: ModelFiles, mode: str) -> Path | None:
    """Where a model's quantized weights are cached: beside our own converted checkpoints, else in
    the cache folder; None for random weights (cheap to regenerate)."""
    if files.path is None:
        return None
    name = CACHE_VERSION[mode]
    if files.path.parent == models_dir():
        return files.path / f"{name}.safetensors"
    folder = cache_dir() / "quant"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / (files.name.replace("/", "--").replace(":", "-") + f".{name}.safetensors")


class CachedWeights:
    """A cache file's tensors, each read (memory-mapped) when asked for; an unreadable file is an
    empty cache."""

    def __init__(self, path: Path | None):
        self.handle = None
        if path is not None and path.is_file():
            from safetensors import SafetensorError, safe_open
            try:
                self.handle = safe_open(str(path), framework="pt")
                self.names = set(self.handle.keys())
            except (SafetensorError, OSError):
                self.handle = None

    def get(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.handle is None or {f"{name}.qweight", f"{name}.scales"} - self.names:
            return None
        return self.handle.get_tensor(f"{name}.qweight"), self.handle.get_tensor(f"{name}.scales")


def save(model: nn.Module, mode: str, path: Path) -> None:
    from safetensors.torch import save_file
    tensors = {}
    for name, m in quantized_layers(model).items():
        if mode in m.quantized:
            q, scales = m.stored(mode)
            tensors[f"{name}.qweight"] = q.contiguous().cpu()
            tensors[f"{name}.scales"] = scales.contiguous().cpu()
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp))
    tmp.replace(path)                      # atomic: never a half-written cache


# ---- sizes ------------------------------------------------------------------------------------

def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
    for m in quantized_layers(model).values():
        for q in m.quantized.values():
            yield q.weight
            yield q.scales


def resident_bytes(model: nn.Module) -> int:
    """Bytes the model holds in memory: every tensor once (shared ones once), quantized weights
    and any copies beside the full-precision ones included."""
    seen: set[int] = set()
    total = 0
    for t in _tensors(model):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def decode_read_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step reads: every matrix it multiplies by (the active form), the
    norms; the embedding contributes one row per token, which is negligible."""
    total = 0
    for m in step_linears(model):
        weight, scales, bias = m.active_weights()
        got = m.running()
        if got is not None and got.fmt in (EXACT_INT8, EXACT_Q4):   # (by panels too: a decode reads the rows')
            weight, scales = reference.exact_rows(weight, scales)
        for t in (weight, scales, bias):
            if t is not None:
                total += t.numel() * t.element_size()
    for m in model.modules():
        if type(m).__name__ == "RMSNorm":
            total += m.weight.numel() * m.weight.element_size()
    return total
