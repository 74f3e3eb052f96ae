"""`pdchat bench` tables: the llama.cpp peer's section reads well measured and skipped."""
from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from pdchat.chatapp.reporting.bench_report import render
from pdchat.bench import llamacpp_peer


def _text(result: dict) -> str:
    console = Console(record=True, width=140, color_system=None)
    render(result, console)
    return console.export_text()


def _result(section: dict) -> dict:
    return {"suite": "baseline", "model": "smollm2-135m", "device": "cpu", "machine": {"date": "2026-11-22"},
            "decode": {"pdchat_tok_s": 14.5, "hf_tok_s": 14.3}, "llamacpp": section}


def test_skipped_peer_shows_why_not_a_column_of_na():
    reason = "llama-cpp-python is not installed (No module named 'llama_cpp'); pip install 'pdchat[peer]'"
    text = _text(_result(llamacpp_peer.section(None, reason, [], [], ours_decode={"int4": [25.0]},
                                               ours_prefill=[514.0])))
    assert "llama.cpp (optional peer: same weights as Q4_0, same threads)" in text
    assert "pip install 'pdchat[peer]'" in text and ">= 1.0x (int4 decode vs Q4_0)" in text
    assert "llamacpp decode tok s" not in text and text.count("n/a") == 1        # only `met`


def test_measured_peer_shows_speeds_and_ratios():
    peer = SimpleNamespace(gguf="/models/source.gguf", threads=2, version="0.3.36", gguf_type="MOSTLY_Q4_0")
    text = _text(_result(llamacpp_peer.section(peer, None, [llamacpp_peer.Rate(40.0, 2.0)],
                                               [llamacpp_peer.Rate(800.0, 2.0)],
                                               ours_decode={"float32": [14.5], "int4": [25.0]},
                                               ours_prefill=[514.0])))
    assert "llamacpp decode tok s" in text and "40.0" in text
    assert "pdchat int4 decode ratio" in text and "0.625" in text
    assert "/models/source.gguf" in text                                         # wrapped, not cut
    assert "MOSTLY_Q4_0" in text and "reason" not in text and "NO" in text        # met: no
