"""Where pdchat keeps things. PDCHAT_CACHE_DIR / PDCHAT_DATA_DIR / PDCHAT_CONFIG_DIR override."""
from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def _dir(env: str, default: str) -> Path:
    path = Path(os.environ.get(env) or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    return _dir("PDCHAT_CACHE_DIR", platformdirs.user_cache_dir("pdchat"))


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    return _dir("PDCHAT_DATA_DIR", platformdirs.user_data_dir("pdchat"))


def config_dir() -> Path:
    return _dir("PDCHAT_CONFIG_DIR", platformdirs.user_config_dir("pdchat"))
