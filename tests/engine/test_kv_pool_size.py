"""The CPU's default KV pool comes from the model (bytes per token), its context and the memory
free, not a fixed size; an explicit size still wins."""
from __future__ import annotations

import torch

from pdchat.engine import Engine
from pdchat.engine.config import EngineConfig
from pdchat.engine.resources import CPU_KV_MEMORY_SHARE, CPU_KV_TOKENS, kv_pool_blocks

CPU = torch.device("cpu")
GB = 2**30


def blocks(bytes_per_token: int, max_model_len: int, available: int, **cfg) -> int:
    return kv_pool_blocks(EngineConfig(**cfg), CPU, bytes_per_token, max_model_len, available=available)


def test_room_for_a_fixed_number_of_tokens_of_this_model():
    # 46 KB a token (the default model), plenty of memory: CPU_KV_TOKENS tokens, in 16-token blocks
    assert blocks(46080, 8192, 20 * GB) == CPU_KV_TOKENS // 16
    # a bigger model's tokens cost more bytes, but the pool still holds as many tokens
    assert blocks(131072, 131072, 20 * GB) == CPU_KV_TOKENS // 16


def test_a_short_context_needs_only_twice_its_length():
    assert blocks(46080, 2048, 20 * GB) == 2 * 2048 // 16


def test_little_free_memory_caps_the_pool():
    free = 1 * GB
    assert blocks(131072, 131072, free) == int(free * CPU_KV_MEMORY_SHARE) // (131072 * 16)


def test_an_explicit_size_wins():
    assert blocks(46080, 8192, 20 * GB, kv_cache_mb=64) == 64 * 2**20 // (46080 * 16)


def test_the_engine_sizes_its_pool_so():
    with Engine(model="random:tiny", device="cpu", telemetry=False) as engine:
        s = engine.stats()
        tokens = s.kv_blocks_total * engine.blocks.block_size
        assert tokens == min(CPU_KV_TOKENS, 2 * engine.max_model_len, engine.config.max_num_seqs * engine.max_model_len)
