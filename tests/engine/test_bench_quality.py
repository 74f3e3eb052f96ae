"""`pdchat bench quant`: quality of quantized weights, refused where it would mean nothing."""
from __future__ import annotations

import pytest
from rich.console import Console

from pdchat.bench import run_suite
from pdchat.chatapp.reporting.bench_report import render
from pdchat.engine import EngineConfig
from pdchat.engine.errors import InvalidRequest


def test_random_weights_have_no_quality_to_measure():
    with pytest.raises(InvalidRequest, match="random weights have none"):
        run_suite("quant", EngineConfig(model="random:tiny", device="cpu", kv_cache_mb=16), quick=True)


def test_a_rows_only_section_renders_as_one_table():
    console = Console(record=True, width=100, color_system=None)
    render({"suite": "quant", "machine": {}, "quality": {"rows": [{"weights": "int4", "perplexity": 32.6}]}}, console)
    text = console.export_text()
    assert "int4" in text and "32.6" in text
    assert "measure" not in text and text.count("┌") + text.count("┏") == 1       # no empty second table
