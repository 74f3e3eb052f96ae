"""The seam between the UI and whatever generates text.

The UI only knows this module: a Backend loads a model, streams a reply as a Generation (a
thread-safe iterator of Phase / Token / Done events that can be cancelled), reports an engine
snapshot (a dict with the stable metric names of pdchat/engine/metrics.py, None = cannot be measured),
and takes runtime toggles. LocalBackend wraps pdchat.engine (imported lazily); FakeBackend is
scripted for tests. No torch import here or in any UI module.
"""
from __future__ import annotations

import abc
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterator

from pdchat.engine import settings
from pdchat.engine.settings import TOGGLES

__all__ = ["CAPABILITIES", "TOGGLES", "Backend", "Done", "Event", "Generation", "Phase", "Progress", "Settings",
           "Toggles", "Token"]

Progress = Callable[[str], None]

# What a conversation keeps (sampling and system prompt) and what the toggles panel changes, as
# declared once in pdchat.engine.settings (no torch there).
CONVERSATION_SETTINGS = tuple(s for s in settings.SETTINGS
                              if (s.scope == settings.SAMPLING and s.chat) or (s.scope == settings.CHAT and not s.toggle))


class _FromDict:
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None):
        """Known fields only, each checked; an unknown or no longer valid saved value is dropped."""
        names = {f.name: f for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names and _valid(cls, k, v)})

    def __post_init__(self) -> None:
        settings.check_all(self, self.declared)


def _valid(cls: type, name: str, value: Any) -> bool:
    return next(s for s in cls.declared if s.name == name).problem(value) is None


@dataclass
class Settings(_FromDict, settings.fields_of(CONVERSATION_SETTINGS, "ConversationSettings")):
    """Per-conversation sampling settings (and system prompt)."""
    declared = CONVERSATION_SETTINGS


@dataclass
class Toggles(_FromDict, settings.fields_of(settings.TOGGLES, "ToggleSettings")):
    """Engine-wide optimizations (and the demo's neighbours); applied to the next request."""
    declared = settings.TOGGLES


@dataclass
class Phase:
    phase: str          # queued | prefill | transfer (another process prefilled it: its K/V cross) | decode
    computed: int       # prompt tokens whose K/V exist (cached included)
    total: int          # prompt tokens
    cached: int         # prompt tokens from the prefix cache
    t: float            # backend clock, seconds
    layers_done: int = 0    # a long prefill forward's way through the layers (engine's ProgressEvent)
    layers: int = 0
    step_tokens: int = 0    # prompt tokens that forward computes
    step_s: float = 0.0     # that forward's predicted time (0: no prediction)


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


# Every capability the UI may offer; a backend says which it has: one per toggle (the backend can
# apply it), and "lab" (it can run `pdchat bench lab` on its own engine).
CAPABILITIES = tuple(s.name for s in settings.TOGGLES) + ("lab",)


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

    def notices(self) -> list[str]:
        """What the engine changed itself or could not do since the last call, in words, each
        once (the engine's settings in force are in stats())."""
        return []

    def run_lab(self, progress: Callable[[str, float], None], quick: bool = False) -> dict[str, Any]:
        """Run `pdchat bench lab` (its quick sizes if `quick`) on this backend's model (only where
        capabilities["lab"])."""
        raise NotImplementedError(f"the lab measures the local engine; {self.name} cannot run it")

    def last_lab_run(self) -> dict[str, Any] | None:
        """The last saved lab run on this machine, if the backend keeps them."""
        return None

    def models(self) -> list[str]:
        """Models this backend can switch to without a download (for the model picker)."""
        return [self.model] if self.model else []

    def model_size(self, model: str) -> str | None:
        """A short size of a model models() lists ("135M params · 513.0 MB"), found without loading
        it or asking the network; None where it is not known."""
        return None

    def now(self) -> float:
        """The clock the event times use (the fake backend has a fake one)."""
        import time
        return time.perf_counter()

    def close(self) -> None:
        pass
