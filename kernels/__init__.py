"""Attention kernels over the paged KV cache.

`reference` holds the pure-PyTorch versions: they define the semantics, run on CPU, and are the
oracle for the Triton kernels beside them (imported lazily, since Triton is optional on CPU).
"""
from .reference import paged_attention, store_kv

__all__ = ["paged_attention", "store_kv"]
