"""pdchat's inference engine: no UI code here; importable alone.

    from pdchat.engine import Engine, EngineConfig, SamplingParams

Names load on first use (PEP 562), so `pdchat.engine.settings` and `pdchat.engine.errors` can be
imported by the CLI and the chat UI without loading torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "DEFAULT_MODEL": "config", "EngineConfig": "config", "SamplingParams": "config",
    "Engine": "engine",
    "EngineStats": "metrics", "RequestMetrics": "metrics",
    "Completion": "stream", "FinishEvent": "stream", "ProgressEvent": "stream", "RequestStream": "stream",
    "TokenEvent": "stream",
    **dict.fromkeys(("EngineError", "ContextTooLong", "DeviceUnavailable", "EngineClosed", "InvalidRequest",
                     "KVCacheTooSmall", "ModelLoadError", "ModelNotFound", "SamplingFailed", "UnsupportedModel"),
                    "errors"),
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pdchat.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value          # next time without this call
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
