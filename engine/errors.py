"""Typed engine errors. The edges (CLI, UI, HTTP) turn them into readable messages."""


class EngineError(Exception):
    """Base class: anything the engine rejects or cannot do, with a message fit for a user."""


class ModelNotFound(EngineError):
    """The model spec names nothing we can find or fetch."""


class ModelLoadError(EngineError):
    """The model was found but its files are unusable (corrupt, truncated, unsupported)."""


class UnsupportedModel(ModelLoadError):
    """An architecture or option our model code does not implement."""


class DeviceUnavailable(EngineError):
    """The requested device (e.g. cuda) is not present."""


class InvalidRequest(EngineError):
    """Bad sampling parameters or an empty / malformed prompt."""


class ContextTooLong(InvalidRequest):
    """The prompt (plus at least one new token) does not fit the model's context window."""

    def __init__(self, prompt_tokens: int, max_model_len: int):
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"prompt is {prompt_tokens} tokens but the context window is {max_model_len} tokens "
            f"(and at least one token must be generated)"
        )


class KVCacheTooSmall(InvalidRequest):
    """The request can never fit in the KV pool, even alone."""


class SamplingFailed(EngineError):
    """A request's logits gave no distribution to sample from (non-finite numbers)."""


class EngineClosed(EngineError):
    """The engine was shut down."""
