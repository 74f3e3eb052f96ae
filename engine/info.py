"""What `pdchat info` prints: versions, device, GPU, and where pdchat keeps its files."""
from __future__ import annotations

import importlib.metadata as md
import platform
import sys

import torch

from . import paths
from .model_source import cached_models


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _cpu_kernels() -> str:
    from pdchat.kernels import cpu
    try:
        lib = cpu.library(paths.cache_dir())
    except cpu.KernelsUnavailable as e:
        return f"unavailable ({e}); PyTorch ops are used"
    # (each setting -1 on a build without that choice)
    narrow = "; 48 rows as three strips of 16 (timed faster here)" if lib.pd_outer_narrow_48(-1) == 1 else ""
    single = "; the 8 rows past strips of 16 against one weight block at a time (timed faster here)" \
        if lib.pd_outer_pair_8(-1) == 0 else ""
    tiles = "; exact blocks on AMX tiles" if lib.pd_exact_amx(-1) else ""
    return f"C, int8 and int4 products on {cpu.int8_path(lib).title}{narrow}{single}{tiles}"


def gpu_info() -> dict[str, str]:
    """The device line, and the GPU's name, memory and CUDA version where there is one."""
    if not torch.cuda.is_available():
        return {"device": "cpu (no CUDA GPU found)"}
    props = torch.cuda.get_device_properties(0)
    return {"device": f"cuda ({torch.cuda.device_count()} GPU)",
            "gpu": f"{props.name}, {props.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}"}


def info() -> dict[str, str]:
    out = {
        "pdchat": _version("pdchat"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "textual": _version("textual"),
        "cpu threads": str(torch.get_num_threads()),
        "cpu kernels": _cpu_kernels(),
    }
    out.update(gpu_info())
    out["data dir"] = str(paths.data_dir())
    out["config dir"] = str(paths.config_dir())
    out["cache dir"] = str(paths.cache_dir())
    models = cached_models()
    out["cached models"] = ", ".join(name for name, _, _ in models) or "none"
    return out
