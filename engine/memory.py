"""Handing freed memory back to the operating system.

Closing an engine frees its weights and KV pool, but glibc keeps freed heap pages for reuse, so a
process that switches models would keep every model it ever loaded in its resident size. After
the objects are gone we ask the allocators to return what they hold.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache

import torch


@cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    return getattr(ctypes.CDLL(name), "malloc_trim", None)


def release_freed_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
