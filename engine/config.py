"""EngineConfig and SamplingParams: dataclasses whose fields, defaults and checks all come from the
declaration in settings.py; validated once, when made (and by dataclasses.replace)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from . import settings
from .settings import DEFAULT_MODEL, ENGINE, SAMPLING, SEED_RANGE

__all__ = ["DEFAULT_MODEL", "EngineConfig", "GREEDY_BELOW_TEMPERATURE", "SEED_RANGE", "SamplingParams"]

# Below this temperature sampling is greedy: logits / t would overflow fp32 (a logit of 10 over
# 1e-40 is inf, then softmax is NaN), and the distribution is one-hot long before that anyway.
# vLLM draws the line at the same place.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass
class EngineConfig(settings.fields_of(settings.of(ENGINE), "EngineSettings")):
    """How an Engine is built and runs; see settings.py for every field."""

    def __post_init__(self) -> None:
        settings.check_all(self, settings.of(ENGINE))


@dataclass
class SamplingParams(settings.fields_of(settings.of(SAMPLING), "SamplingSettings")):
    """How one request samples; see settings.py for every field."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (list, tuple)):
            self.stop = [s for s in self.stop if s]
        settings.check_all(self, settings.of(SAMPLING))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    def with_(self, **changes) -> "SamplingParams":
        return replace(self, **changes)
