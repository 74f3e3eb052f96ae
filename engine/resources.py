"""What the engine takes from the machine at start-up: a kernel backend and a KV pool size. Pure
choices from the config and the device; the Engine calls them once."""
from __future__ import annotations

from types import SimpleNamespace

import psutil
import torch

from pdchat import kernels
from pdchat.kernels.cpu import KernelsUnavailable

from .config import EngineConfig
from .errors import InvalidRequest, KVCacheTooSmall
from .paths import cache_dir

# The CPU pool by default: room for CPU_KV_TOKENS tokens of this model (two 8K conversations, or
# twice a shorter context), at most CPU_KV_MEMORY_SHARE of the memory available once the weights
# are in. (It was a fixed 512 MB: 11K tokens of the default model, 4K of an 8B one.)
CPU_KV_TOKENS = 16384
CPU_KV_MEMORY_SHARE = 0.25
def kv_pool_blocks(cfg: EngineConfig, device: torch.device, bytes_per_token: int, max_model_len: int,
                   available: int | None = None) -> int:
    """Blocks in the KV pool: an exact count, else a byte budget (set, or the device's default)
    divided by a block's bytes, never more than max_num_seqs full-length requests can use.
    `available`: the memory free now (default: what the OS says)."""
    per_block = bytes_per_token * cfg.block_size
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_mb is not None:
        budget = int(cfg.kv_cache_mb * 2**20)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.gpu_memory_fraction)
    else:
        tokens = min(CPU_KV_TOKENS, 2 * max_model_len)
        free = available if available is not None else psutil.virtual_memory().available
        budget = min(tokens * bytes_per_token, int(free * CPU_KV_MEMORY_SHARE))
    useful = cfg.max_num_seqs * (-(-max_model_len // cfg.block_size))   # more is never used
    blocks = min(budget // per_block, useful)
    if blocks < 1:
        raise KVCacheTooSmall(f"a KV budget of {budget / 2**20:.1f} MB holds no block of "
                              f"{per_block / 2**20:.2f} MB")
    return int(blocks)


def kernel_backend(name: str, device: torch.device, dtype: torch.dtype, notices: list[str]) -> SimpleNamespace:
    """The kernel backend; an automatic choice that cannot be built falls back to PyTorch's ops
    with a notice, an explicit one is an error."""
    chosen = name
    try:
        chosen = kernels.choose(name, device.type, dtype == torch.float32)
        return kernels.load(chosen, cache_dir())
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    except (ImportError, KernelsUnavailable) as e:
        if name != "auto":
            raise InvalidRequest(f"{chosen} kernels unavailable: {e}") from None
        notices.append(f"{chosen} kernels unavailable ({e}); running PyTorch's ops")
        return kernels.load("torch")
