"""A long prefill forward reports its way through the layers (the prefill pause, the thing people
come to watch, is seconds on a CPU); short forwards and decodes report none."""
from __future__ import annotations

from pdchat.engine import SamplingParams
from pdchat.engine.output_processor import LAYER_PROGRESS_TOKENS
from pdchat.engine.stream import ProgressEvent


def prefill_events(engine, ids: list[int]) -> list[ProgressEvent]:
    stream = engine.submit(ids, SamplingParams(max_tokens=4, temperature=0))
    events = [e for e in stream if isinstance(e, ProgressEvent) and e.phase == "prefill"]
    stream.result()
    return events


def test_a_long_prefill_reports_every_layer_of_its_forward(tiny_engine):
    layers = tiny_engine.model_config.num_layers
    ids = [(i * 7) % 200 + 3 for i in range(LAYER_PROGRESS_TOKENS + 44)]
    events = prefill_events(tiny_engine, ids)
    assert events[0].layers_done == 0                       # the pause starts before the forward
    by_layer = [(e.computed, e.layers_done, e.layers, e.step_tokens) for e in events[1:]]
    assert by_layer == [(0, n, layers, len(ids)) for n in range(1, layers + 1)]
    times = [e.t for e in events]
    assert times == sorted(times)


def test_a_short_prompt_reports_no_layers(tiny_engine):
    events = prefill_events(tiny_engine, list(range(3, 3 + LAYER_PROGRESS_TOKENS - 1)))
    assert [e.layers for e in events] == [0]
