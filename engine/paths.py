"""Where pdchat keeps things. PDCHAT_CACHE_DIR / PDCHAT_DATA_DIR / PDCHAT_CONFIG_DIR override.

The platform's own folders come from platformdirs; without it (a GPU box with only the engine's
packages, where the chat app is not installed) the XDG base directories stand in, so the engine
imports and runs with torch, transformers and their dependencies alone."""
from __future__ import annotations

import os
from pathlib import Path

try:
    import platformdirs
except ImportError:              # the engine alone: no UI packages
    platformdirs = None

_XDG = {"cache": ("XDG_CACHE_HOME", ".cache"), "data": ("XDG_DATA_HOME", ".local/share"),
        "config": ("XDG_CONFIG_HOME", ".config")}


def _platform_dir(kind: str) -> str:
    if platformdirs is not None:
        return getattr(platformdirs, f"user_{kind}_dir")("pdchat")
    env, home_relative = _XDG[kind]
    return str(Path(os.environ.get(env) or Path.home() / home_relative) / "pdchat")


def _dir(env: str, kind: str) -> Path:
    path = Path(os.environ.get(env) or _platform_dir(kind))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    return _dir("PDCHAT_CACHE_DIR", "cache")


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    return _dir("PDCHAT_DATA_DIR", "data")


def config_dir() -> Path:
    return _dir("PDCHAT_CONFIG_DIR", "config")
