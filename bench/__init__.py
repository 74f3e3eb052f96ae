"""`pdchat bench SUITE`: measurements taken side by side in one run, returned as plain dicts.

Suites report their inputs, medians and ratios; the CLI renders them (tables, progress bars),
so nothing here depends on a UI library.
"""
from __future__ import annotations

import datetime
import platform
import statistics
from typing import Any, Callable

from pdchat.engine.config import EngineConfig
from pdchat.engine.errors import InvalidRequest
from pdchat.engine.telemetry import cpu_model_name

Progress = Callable[[str, float], None]      # (what is running, fraction done 0..1)


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def paired_ratio(ours: list[float], theirs: list[float]) -> float | None:
    """The median over rounds of ours / theirs measured in the same round. On a machine whose speed
    drifts between rounds (a shared VM: a third within the hour), a ratio of medians can compare a
    fast phase with a slow one; each round's ratio compares runs seconds apart."""
    pairs = [a / b for a, b in zip(ours, theirs) if b]
    return median(pairs) if pairs else None


def machine() -> dict[str, Any]:
    import torch
    info: dict[str, Any] = {"date": datetime.date.today().isoformat(), "platform": platform.platform(),
                            "torch": torch.__version__, "cpu_threads": torch.get_num_threads()}
    info["cpu"] = cpu_model_name()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def filler_text(n_words: int, seed: int = 0) -> str:
    """Deterministic, varied English-like text (so tokenization is realistic, not one repeated token)."""
    import random
    words = ("the system memory cache request token model layer decode prefill batch user answer "
             "question engine block table paper graph kernel fast slow river mountain city light "
             "data value number story history science music garden window morning evening").split()
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < n_words:
        n = rng.randrange(6, 16)
        sentences.append(" ".join(rng.choice(words) for _ in range(n)).capitalize() + ".")
    return " ".join(sentences)


def run_suite(name: str, config: EngineConfig, *, quick: bool = False,
              progress: Progress | None = None) -> dict[str, Any]:
    from pdchat.bench import baseline, disagg, gpu, lab, quality, spec, toggles
    suites = {"toggles": toggles.run, "baseline": baseline.run, "spec": spec.run, "lab": lab.run,
              "quant": quality.run, "gpu": gpu.run, "disagg": disagg.run}
    if name not in suites:
        raise InvalidRequest(f"unknown bench suite {name!r}; available: {', '.join(suites)}")
    result = suites[name](config, quick=quick, progress=progress or (lambda what, frac: None))
    result["suite"] = name
    result["machine"] = machine()
    return result
