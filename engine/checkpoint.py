"""A checkpoint's tensors by Hugging Face name, read one at a time as the model takes them.

Loading used to read the whole checkpoint into memory beside the model's own parameters, and to
fuse q/k/v and gate/up for every layer before copying any: about 10 bytes per parameter at the
peak for fp32 weights (a 1B model: 12.8 GB). Read by name, a safetensors file is memory-mapped and
each tensor is read when asked for, and a random preset's weights are generated in order, so the
peak stays near the model's final size.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from .errors import ModelLoadError


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The tensors of a model folder's .safetensors shards, each read from the mapped file when
    it is looked up (so look each up once)."""

    def __init__(self, shards: list[Path]):
        from safetensors import SafetensorError, safe_open
        self._errors = (SafetensorError, OSError)
        self._where: dict[str, Any] = {}
        self._paths: dict[str, Path] = {}
        for shard in shards:
            try:
                handle = safe_open(str(shard), framework="pt")
            except self._errors as e:
                raise ModelLoadError(f"corrupt weights file {shard}: {e}") from e
            for name in handle.keys():
                self._where[name], self._paths[name] = handle, shard

    def __getitem__(self, name: str) -> torch.Tensor:
        handle = self._where[name]
        try:
            return handle.get_tensor(name)
        except self._errors as e:
            raise ModelLoadError(f"corrupt weights file {self._paths[name]}: {e}") from e

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class GeneratedWeights(Mapping[str, torch.Tensor]):
    """Weights that come from an ordered generator (a random preset's): a lookup generates up to
    the name asked for, keeping the ones passed on the way until they are asked for in turn. Each
    name can be looked up once; a loader that takes a layer's weights out of order holds at most
    that layer's."""

    def __init__(self, names: list[str], weights: Iterator[tuple[str, torch.Tensor]]):
        self._names = names
        self._known = set(names)
        self._weights = weights
        self._waiting: dict[str, torch.Tensor] = {}
        self._taken: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        if name in self._taken:
            raise KeyError(f"{name} was already taken")
        while name not in self._waiting:
            got, tensor = next(self._weights)
            self._waiting[got] = tensor
        self._taken.add(name)
        return self._waiting.pop(name)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
