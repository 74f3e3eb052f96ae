"""The in-process backend: pdchat.engine.Engine, imported lazily so the UI appears at once."""
from __future__ import annotations

import threading
import time
from dataclasses import fields
from typing import Any, Iterator

from pdchat.chatapp import format as fmt
from pdchat.chatapp.backends.base import CAPABILITIES, Backend, Done, Generation, Phase, Settings, Token

NEIGHBOUR_PROMPT = ("You are a background user. Write a long, detailed story about a lighthouse keeper "
                    "who discovers a strange signal in the fog.")


def _count(n: int) -> str:
    """A parameter count as people say it: 135M, 1.2B."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


class LocalGeneration(Generation):
    def __init__(self, stream):
        self._stream = stream

    def __iter__(self) -> Iterator:
        from pdchat.engine import FinishEvent, ProgressEvent, TokenEvent
        for ev in self._stream:
            if isinstance(ev, TokenEvent):
                yield Token(ev.text, ev.t, ev.index)
            elif isinstance(ev, ProgressEvent):
                yield Phase(ev.phase, ev.computed, ev.total, ev.cached, ev.t, ev.layers_done, ev.layers,
                            ev.step_tokens, ev.step_s)
            elif isinstance(ev, FinishEvent):
                c = ev.completion
                yield Done(c.text, c.finish_reason, c.metrics.to_dict(), c.error)

    def cancel(self) -> None:
        self._stream.cancel()


class LocalBackend(Backend):
    name = "local"

    def __init__(self, model: str = "smollm2-135m", device: str = "auto", dtype: str = "auto",
                 **engine_options: Any):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.engine_options = engine_options     # the other EngineConfig fields; those left out keep its defaults
        self.engine = None
        self._neighbours: list[threading.Event] = []

    def load(self, progress) -> None:
        from pdchat.engine import Engine, EngineConfig
        self.engine = Engine(EngineConfig(model=self.model, device=self.device, dtype=self.dtype,
                                          **self.engine_options), say=progress)
        for notice in self.engine.take_notices():
            progress(notice)
        progress(f"{self.model} ready on {self.engine.device}")

    @property
    def capabilities(self) -> dict[str, bool]:
        caps = {c: True for c in CAPABILITIES}
        # CUDA graphs exist on a GPU only; before the engine loads the device is not known yet.
        caps["cuda_graphs"] = self.engine is not None and self.engine.device.type == "cuda"
        return caps

    def run_lab(self, progress, quick: bool = False) -> dict[str, Any]:
        from pdchat.bench import run_suite
        from pdchat.engine import EngineConfig
        # The chat's machine settings (threads, kernels) hold; the lab sets the toggles itself.
        machine = {k: v for k, v in self.engine_options.items() if k in ("threads", "kernels")}
        config = EngineConfig(model=self.model, device=self.device, dtype=self.dtype, **machine)
        return run_suite("lab", config, quick=quick, progress=progress)

    def last_lab_run(self) -> dict[str, Any] | None:
        from pdchat.bench.lab_files import last_run
        return last_run()

    def models(self) -> list[str]:
        from pdchat.engine.model_source import cached_models
        names = [name for name, _, _ in cached_models()]
        return [self.model] + [n for n in names if n != self.model]

    def model_size(self, model: str) -> str | None:
        from pdchat.engine.model_source import model_size
        try:
            size = model_size(model)
        except Exception:          # a size is a convenience: a damaged folder shows none
            return None
        if size is None:
            return None
        parts = [f"{_count(size.params)} params" if size.params else "",
                 fmt.size(size.disk_bytes) if size.disk_bytes else "",
                 f"{fmt.size(size.download_bytes)} download" if size.download_bytes else ""]
        return " · ".join(p for p in parts if p) or None

    def _engine(self):
        if self.engine is None:
            raise RuntimeError("the model is not loaded yet")
        return self.engine

    def stream(self, messages, settings: Settings) -> LocalGeneration:
        from pdchat.engine import SamplingParams
        sampling = {f.name for f in fields(SamplingParams)}
        params = SamplingParams(**{k: v for k, v in settings.to_dict().items() if k in sampling})
        return LocalGeneration(self._engine().submit(messages, params, system=settings.system or None))

    def stats(self) -> dict[str, Any]:
        if self.engine is None:
            return {}
        return self.engine.stats().to_dict()

    def notices(self) -> list[str]:
        return self.engine.take_notices() if self.engine is not None else []

    def update(self, **toggles: Any) -> None:
        engine = self._engine()
        if "neighbours" in toggles:
            self._set_neighbours(int(toggles.pop("neighbours")))
        if toggles:
            engine.update(**toggles)

    # ---- synthetic background users ------------------------------------------------------
    def _set_neighbours(self, n: int) -> None:
        while len(self._neighbours) > n:
            self._neighbours.pop().set()
        while len(self._neighbours) < n:
            stop = threading.Event()
            self._neighbours.append(stop)
            threading.Thread(target=self._neighbour, args=(stop, len(self._neighbours)), daemon=True,
                             name="pdchat-neighbour").start()

    def _neighbour(self, stop: threading.Event, i: int) -> None:
        from pdchat.engine import SamplingParams
        while not stop.is_set() and self.engine is not None:
            try:
                s = self.engine.submit(f"{NEIGHBOUR_PROMPT} (#{i})", SamplingParams(max_tokens=64, temperature=0.8))
                for _ in s:
                    if stop.is_set():
                        s.cancel()
            except Exception:
                time.sleep(1.0)

    def close(self) -> None:
        self._set_neighbours(0)
        if self.engine is not None:
            self.engine.close()
            self.engine = None
