"""The seam between the UI and whatever generates text.

The UI only knows this module: a Backend loads a model, streams a reply as a Generation (a
thread-safe iterator of Phase / Token / Done events that can be cancelled), reports an engine
snapshot (a dict with the stable metric names of engine/metrics.py, None = cannot be measured),
and takes runtime toggles. LocalBackend wraps pdchat.engine (imported lazily); FakeBackend is
scripted for tests. No torch import here or in any UI module.
"""
from __future__ import annotations

import abc
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterator

Progress = Callable[[str], None]

# The engine's CPU default (chosen with `pdchat bench toggles`); the user can change it live.
DEFAULT_CHUNK = 32


@dataclass
class Settings:
    """Per-conversation sampling settings (and system prompt)."""
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    system: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "Settings":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})


@dataclass
class Toggles:
    """Engine-wide optimizations; applied to the next request."""
    kv_cache: bool = True
    prefix_cache: bool = True
    chunk_size: int | None = DEFAULT_CHUNK   # None: chunked prefill off
    spec: str = "off"                 # off | ngram | draft
    quant: str = "none"               # none | int8
    neighbours: int = 0               # synthetic background users

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "Toggles":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})


@dataclass
class Phase:
    phase: str          # queued | prefill | decode
    computed: int       # prompt tokens whose K/V exist (cached included)
    total: int          # prompt tokens
    cached: int         # prompt tokens from the prefix cache
    t: float            # backend clock, seconds


@dataclass
class Token:
    text: str
    t: float
    index: int


@dataclass
class Done:
    text: str
    finish_reason: str                  # stop | length | cancelled | error
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


Event = Phase | Token | Done


class Generation(abc.ABC):
    """One reply in flight. Iterate (from a worker thread) until Done; cancel() from anywhere."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Event]: ...

    @abc.abstractmethod
    def cancel(self) -> None: ...


# Every capability the UI may offer; a backend says which it has.
CAPABILITIES = ("kv_cache", "prefix_cache", "chunked_prefill", "spec", "quant", "neighbours")


class Backend(abc.ABC):
    """What the chat UI talks to. load() blocks (run it in a worker); the rest is quick."""

    name: str = "backend"
    model: str = ""

    @abc.abstractmethod
    def load(self, progress: Progress) -> None:
        """Load the model, reporting progress lines; raise an exception with a readable message."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> dict[str, bool]: ...

    @abc.abstractmethod
    def stream(self, messages: list[dict[str, str]], settings: Settings) -> Generation:
        """Start a reply to `messages` (chat format); raises ValueError-like errors at once."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Engine snapshot with the stable names; values that cannot be measured are None."""

    @abc.abstractmethod
    def update(self, **toggles: Any) -> None:
        """Apply toggles (names of Toggles fields) to new requests."""

    def models(self) -> list[str]:
        """Models this backend can switch to without a download (for the model picker)."""
        return [self.model] if self.model else []

    def now(self) -> float:
        """The clock the event times use (the fake backend has a fake one)."""
        import time
        return time.perf_counter()

    def close(self) -> None:
        pass
