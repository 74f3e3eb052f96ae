"""pdchat's inference engine: no UI code here; importable alone.

    from pdchat.engine import Engine, EngineConfig, SamplingParams
"""
from .config import DEFAULT_MODEL, EngineConfig, SamplingParams
from .engine import Engine
from .errors import (ContextTooLong, DeviceUnavailable, EngineClosed, EngineError, InvalidRequest,
                     KVCacheTooSmall, ModelLoadError, ModelNotFound, SamplingFailed, UnsupportedModel)
from .metrics import EngineStats, RequestMetrics
from .stream import Completion, FinishEvent, ProgressEvent, RequestStream, TokenEvent

__all__ = [
    "DEFAULT_MODEL", "Engine", "EngineConfig", "SamplingParams", "EngineStats", "RequestMetrics",
    "Completion", "FinishEvent", "ProgressEvent", "RequestStream", "TokenEvent",
    "EngineError", "ContextTooLong", "DeviceUnavailable", "EngineClosed", "InvalidRequest",
    "KVCacheTooSmall", "ModelLoadError", "ModelNotFound", "SamplingFailed", "UnsupportedModel",
]
