"""`pdchat` CLI: output formats, and every bad input gives one clear line and a non-zero exit."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from pdchat.chatapp.cli.main import main
from pdchat.chatapp.cli.parser import build_parser
from pdchat.engine.metrics import RequestMetrics

METRIC_FIELDS = set(RequestMetrics.__dataclass_fields__)


def run_cli(capsys, monkeypatch, *argv, stdin: bytes | None = None):
    if stdin is not None:
        fake = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
        monkeypatch.setattr(sys, "stdin", fake)
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_run_json_prints_one_object_with_every_metric(capsys, monkeypatch):
    code, out, err = run_cli(capsys, monkeypatch, "run", "hello", "--model", "random:tiny", "--json",
                             "--max-tokens", "7", "--temperature", "0")
    assert code == 0
    data = json.loads(out)                          # nothing else on stdout
    assert set(data) == {"text", "token_ids", "finish_reason", "metrics"}
    assert len(data["token_ids"]) == 7 or data["finish_reason"] == "stop"
    assert set(data["metrics"]) == METRIC_FIELDS
    assert data["metrics"]["output_tokens"] == len(data["token_ids"])


def test_run_streams_text_then_summary(capsys, monkeypatch):
    code, out, err = run_cli(capsys, monkeypatch, "run", "-", "--model", "random:tiny", "--max-tokens", "5",
                             "--temperature", "0", stdin="from stdin".encode())
    assert code == 0
    assert "TTFT" in err and "tok/s" in err and "TPOT" in err and "prompt tok" in err
    # stdout is the streamed text itself: the engine's greedy answer to the same prompt, then a newline
    from pdchat.engine import Engine, SamplingParams
    with Engine(model="random:tiny", telemetry=False, kv_cache_mb=8) as engine:
        want = engine.submit("from stdin", SamplingParams(max_tokens=5, temperature=0)).result()
    assert want.text and out == want.text + "\n"
    assert f"{len(want.token_ids)} tok" in err


def test_run_disaggregated_reports_the_kv_transfer(capsys, monkeypatch):
    code, out, err = run_cli(capsys, monkeypatch, "run", "hello " * 40, "--model", "random:tiny", "--json",
                             "--max-tokens", "2", "--temperature", "0", "--disaggregate", "--kv-link-ms", "5")
    assert code == 0
    m = json.loads(out)["metrics"]
    assert set(m) == METRIC_FIELDS
    assert m["kv_transfer_ms"] >= 5.0 and m["kv_transfer_bytes"] > 0       # the simulated latency included
    assert "disaggregated" in err                                         # the engine's note on the split


def test_summary_line_mentions_the_kv_transfer_only_when_there_was_one():
    from pdchat.chatapp.cli.turn import summary_line
    m = {"ttft_ms": 30.0, "prompt_tokens": 16, "prefill_tok_s": 500.0, "output_tokens": 4, "decode_tok_s": 40.0,
         "tpot_ms": 25.0, "finish_reason": "stop"}
    line = summary_line({**m, "kv_transfer_bytes": 138240, "kv_transfer_ms": 4.0})
    assert "· prefill 500.0 tok/s · KV transfer 135.0 KB in 4.0 ms · 4 tok @" in line
    assert "KV" not in summary_line({**m, "kv_transfer_bytes": None, "kv_transfer_ms": None})


def _gguf_file(path, truncate: bool) -> None:
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("case", ["unknown model", "hub id offline", "corrupt gguf", "truncated gguf",
                                  "empty prompt", "invalid utf8", "cuda without gpu",
                                  "context too long", "missing gguf"])
def test_bad_input_gives_a_clear_message(case, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["run", "hi", "--model", "random:tiny"]
    stdin = None
    expect = ""
    if case == "unknown model":
        args, expect = ["run", "hi", "--model", "no-such-model"], "unknown model"
    elif case == "hub id offline":
        args, expect = ["run", "hi", "--model", "nobody/nothing"], "unreachable"
    elif case in ("corrupt gguf", "truncated gguf"):
        bad = tmp_path / "bad.gguf"
        if case == "corrupt gguf":
            bad.write_bytes(b"this is not a gguf file at all")
            expect = "not a GGUF file"
        else:
            _gguf_file(bad, truncate=True)
            expect = "could not read GGUF"
        args = ["run", "hi", "--model", str(bad)]
    elif case == "missing gguf":
        args, expect = ["run", "hi", "--model", str(tmp_path / "nope.gguf")], "no such file or folder"
    elif case == "empty prompt":
        args, expect = ["run", "   ", "--model", "random:tiny"], "empty prompt"
    elif case == "invalid utf8":
        args, stdin, expect = ["run", "--model", "random:tiny"], b"caf\xe9 \xff", "not valid UTF-8"
    elif case == "cuda without gpu":
        args, expect = args + ["--device", "cuda"], "no CUDA GPU"
    elif case == "context too long":
        args, stdin = ["run", "-", "--model", "random:tiny"], ("word " * 1000).encode()
        expect = "context window is 4096 tokens"
    code, out, err = run_cli(capsys, monkeypatch, *args, stdin=stdin)
    assert code != 0
    assert expect in err
    assert "Traceback" not in err + out
    assert err.strip().startswith("pdchat: error:") or "pdchat: error:" in err


def test_real_command_has_no_traceback_and_fails():
    proc = subprocess.run([sys.executable, "-m", "pdchat.chatapp.cli.main", "run", "hi", "--model", "random:nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "unknown random preset 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_default_model_json_metrics_agree_with_a_stopwatch(default_engine):
    # default_engine makes sure the model is cached; the CLI then loads it itself.
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pdchat.chatapp.cli.main", "run", "What is the capital of France?",
                           "--temperature", "0", "--json", "--max-tokens", "48"],
                          capture_output=True, text=True, timeout=300)
    wall_ms = (time.perf_counter() - t0) * 1000
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    m = data["metrics"]
    assert set(m) == METRIC_FIELDS
    assert "Paris" in data["text"]
    for key in ("queue_ms", "ttft_ms", "prefill_ms", "prefill_tok_s", "decode_ms", "tpot_ms", "decode_tok_s"):
        assert m[key] is not None and m[key] > 0, key
    # What the engine measured fits inside what the outside clock saw.
    assert m["ttft_ms"] + m["decode_ms"] < wall_ms
    assert m["output_tokens"] == len(data["token_ids"]) and m["prompt_tokens"] > 10


def test_version(capsys):
    from importlib.metadata import version
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"pdchat {version('pdchat')}"
    assert main(["--version"]) == 0


_CHAT_SEES = """
import os, sys
import pdchat.chatapp.tui.app as app
app.run_app = lambda *args, **kwargs: print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules) or 0
from pdchat.chatapp.cli.main import main
sys.exit(main([]))
"""


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_chat_sets_openmp_to_wait_asleep_before_torch_loads_unless_the_user_chose(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    proc = subprocess.run([sys.executable, "-c", _CHAT_SEES], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [expected, "False"]       # set, and OpenMP not loaded yet to read it
