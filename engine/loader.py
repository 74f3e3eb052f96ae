"""Build our Transformer and the tokenizer from resolved model files, on a device and dtype."""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping

import torch
from torch import nn

from . import quant
from .checkpoint import GeneratedWeights, SafetensorsWeights
from .errors import DeviceUnavailable, ModelLoadError
from .model import Transformer
from .model_config import ModelConfig
from .model_source import ModelFiles

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def pick_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu; an explicit cuda without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceUnavailable("--device cuda was asked for, but no CUDA GPU is available "
                                    "(use --device cpu, or auto to pick the best device)")
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise DeviceUnavailable(f"unknown device {name!r} (auto, cpu, cuda, cuda:N)")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 through torch on CPU is far slower than fp32; on GPU bf16 is the norm, and fp16 where
        # the GPU has no bf16 (before Ampere).
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r} (auto, float32, bfloat16, float16)") from None


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Any
    config: ModelConfig
    hf_config: dict[str, Any]
    eos_token_ids: frozenset[int]
    files: ModelFiles
    quant: "quant.QuantSwitch"
    seed: int                      # random presets: regenerating with it gives the same weights


def hf_config_of(files: ModelFiles) -> dict[str, Any]:
    if files.random_preset is not None:
        from .random_models import preset_config
        return preset_config(files.random_preset)
    try:
        return json.loads((files.path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"unreadable config.json in {files.path}: {e}") from e


def load_hf_state_dict(files: ModelFiles, device: torch.device, dtype: torch.dtype,
                       seed: int = 0) -> Mapping[str, torch.Tensor]:
    """The checkpoint's tensors by Hugging Face name, each read (or generated) when it is looked
    up, once (checkpoint.py): loading never holds a second copy of the whole model."""
    if files.random_preset is not None:
        from .random_models import random_weights, weight_specs
        cfg = hf_config_of(files)
        # Presets of the same shape still get different weights.
        seed = seed + zlib.crc32(files.random_preset.encode())
        return GeneratedWeights([name for name, *_ in weight_specs(cfg)],
                                random_weights(cfg, seed=seed, device=device, dtype=dtype))
    shards = sorted(files.path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"no .safetensors weights in {files.path}")
    return SafetensorsWeights(shards)


def load_tokenizer(files: ModelFiles) -> Any:
    if files.random_preset is not None:
        from .random_models import byte_tokenizer
        return byte_tokenizer()
    try:
        if (files.path / "tokenizer.json").is_file():
            # The fast class directly: AutoTokenizer's resolution costs over a second at start-up.
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(str(files.path))
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(files.path))
    except Exception as e:
        raise ModelLoadError(f"could not load the tokenizer in {files.path}: {e}") from e


def eos_ids(cfg: ModelConfig, files: ModelFiles, tokenizer: Any) -> frozenset[int]:
    ids = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen = files.path / "generation_config.json" if files.path else None
    if gen is not None and gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)


def load(files: ModelFiles, device: torch.device, dtype: torch.dtype, seed: int = 0,
         ops: SimpleNamespace | None = None, quant_mode: str = "none") -> LoadedModel:
    """Build the model on the device with the given kernel backend (default: plain PyTorch), its
    matrices in `quant_mode` (none | int8 | int4): quantized as they are read, never held in full
    precision."""
    hf_cfg = hf_config_of(files)
    cfg = ModelConfig.from_hf(hf_cfg, source=str(files.path / "config.json") if files.path else files.name)
    tokenizer = load_tokenizer(files)
    with torch.device("meta"):
        model = Transformer(cfg)                  # no memory and no time spent on random init
    if ops is not None:
        model.ops = ops
    switch = quant.install(model, model.ops, dtype, quant_mode)
    loaded = LoadedModel(model, tokenizer, cfg, hf_cfg, eos_ids(cfg, files, tokenizer), files, switch, seed)
    place_weights(loaded, device, dtype, quant_mode)
    model.inv_freq = model.inv_freq.to(device)
    model.eval()
    return loaded


def place_weights(loaded: LoadedModel, device: torch.device, dtype: torch.dtype, mode: str) -> None:
    """Read the checkpoint into the model, tensor by tensor: matrices that fit `mode` quantized
    (from the cache file when it has them, which is then written if it missed any), the rest in
    `dtype`. Each matrix drops what it held before as its new form arrives, so switching precision
    at run time never holds two forms of the whole model."""
    model, files = loaded.model, loaded.files
    layers = quant.quantized_layers(model)
    cache_path = quant.cache_file(files, mode) if mode != "none" else None
    cache = quant.CachedWeights(cache_path)
    missed = False

    def place(name: str, tensor: torch.Tensor) -> None:
        nonlocal missed
        owner, _, attr = name.rpartition(".")
        layer = layers.get(owner) if attr == "weight" else None
        if layer is not None:
            layer.quantized.clear()
        fmt = layer.format_for(mode) if layer is not None and mode != "none" else None
        if fmt is not None and quant.fits(fmt, tensor):
            cached = cache.get(owner)
            if cached is not None and _cache_fits(fmt, cached, tensor.shape):
                layer.adopt(mode, cached, device)
            else:
                missed = True
                layer.quantize(mode, tensor, device)
            layer.weight = None
            return
        placed = tensor.to(device, dtype)
        if not (layer is not None and layer.hold_exact(placed)):
            setattr(model.get_submodule(owner), attr, nn.Parameter(placed, requires_grad=False))

    state = load_hf_state_dict(files, device, dtype, loaded.seed)
    try:
        model.load_hf_state_dict(state, place)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"weights do not fit the config in {files.path}: {e}") from e
    del state
    model.quant_switch.mode = mode
    model.quant_switch.version += 1
    if missed and cache_path is not None:
        try:
            quant.save(model, mode, cache_path)
        except OSError:
            pass                          # a read-only cache folder costs the next load time, not this one


def _cache_fits(fmt: str, cached: tuple[torch.Tensor, torch.Tensor], shape: torch.Size) -> bool:
    """A cached entry is used only with the shapes and dtypes this model's matrix needs."""
    q, s = cached
    N, K = shape
    if fmt == "int8":
        return q.shape == (N, K) and q.dtype == torch.int8 and s.shape == (N,) and s.dtype == torch.float32
    return (q.shape == (N, K // 2) and q.dtype == torch.uint8 and s.shape == (N, K // quant.INT4_GROUP, 2)
            and s.dtype == torch.bfloat16)
