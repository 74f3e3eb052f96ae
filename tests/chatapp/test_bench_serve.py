"""`pdchat bench serve`: the metric definitions (vLLM's serving benchmark), and a real run of the
`pdchat serve` command as a subprocess, loaded by the `pdchat bench serve` command."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pdchat.chatapp.cli.main import main
from pdchat.chatapp.reporting.loadtest import LoadSpec, make_prompts, report
from pdchat.chatapp.backends.openai_client import Endpoint, Reply

from .loopback import free_port


def reply(t_start: float, chunk_times: list[float], t_end: float, tokens: int) -> Reply:
    return Reply(t_start, chunk_times=chunk_times, parts=["x"] * len(chunk_times), t_end=t_end,
                 finish_reason="length", usage={"prompt_tokens": 10, "completion_tokens": tokens})


def test_report_uses_vllm_definitions():
    spec = LoadSpec(Endpoint("http://h:1"), "m", concurrency=2, requests=3, max_tokens=4, temperature=0,
                    prompt_words=8, ignore_eos=True)
    a = reply(0.0, [0.1, 0.2, 0.4], 0.5, tokens=3)       # TTFT 100, TPOT (500-100)/2 = 200, ITL 100, 200
    b = reply(1.0, [1.3, 1.4], 1.4, tokens=2)            # TTFT 300, TPOT 100, ITL 100
    result = report(spec, "m", [a, b, "HTTP 500: boom"], duration=2.0, server={})
    s = result["summary"]
    assert (s["successful_requests"], s["failed_requests"], s["first_error"]) == (2, 1, "HTTP 500: boom")
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (20, 5)
    assert s["cached_input_tokens"] is None              # the server did not say
    assert s["request_throughput_req_s"] == 1.0 and s["output_throughput_tok_s"] == 2.5
    assert s["total_token_throughput_tok_s"] == 12.5
    rows = {r["metric"]: r for r in result["latency_ms"]["rows"]}
    assert rows["TTFT"]["mean"] == pytest.approx(200) and rows["TTFT"]["p50"] == pytest.approx(200)
    assert rows["TTFT"]["p90"] == pytest.approx(280)     # numpy's linear interpolation
    assert rows["TPOT"]["mean"] == pytest.approx(150)
    assert rows["ITL"]["mean"] == pytest.approx(400 / 3) and result["latency_ms"]["itl_samples"] == 3
    assert rows["E2E"]["mean"] == pytest.approx(450) and rows["E2E"]["p99"] == pytest.approx(499)
    assert "server_after" not in result                 # no /metrics: nothing claimed


def test_no_successful_request_gives_na_not_zero():
    spec = LoadSpec(Endpoint("http://h:1"), "m", 1, 1, 4, 0.0, 8, False)
    rows = report(spec, "m", ["HTTP 404: no"], duration=1.0, server={})["latency_ms"]["rows"]
    assert all(v is None for r in rows for k, v in r.items() if k != "metric")


def test_prompts_differ_and_repeat():
    p = make_prompts(5, 12)
    assert len(set(p)) == 5 and p == make_prompts(5, 12)


@pytest.fixture(scope="module")
def pdchat_serve():
    """The real `pdchat serve` command on a free loopback port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdchat.chatapp.cli.main", "serve", "--model", "random:tiny",
                             "--device", "cpu", "--port", str(port), "--kv-cache-mb", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"pdchat serve did not start: {proc.stdout.read()}")
        time.sleep(0.1)
    yield url, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def bench(capsys, *argv: str) -> tuple[int, dict | None, str]:
    code = main(["bench", "serve", "--json", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def test_bench_serve_against_pdchat_serve(pdchat_serve, capsys, monkeypatch):
    monkeypatch.delenv("PDCHAT_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    url, _ = pdchat_serve
    code, result, err = bench(capsys, "--backend", url, "--concurrency", "4", "--requests", "12",
                              "--max-tokens", "8", "--ignore-eos", "--prompt-words", "16")
    assert code == 0, err
    s = result["summary"]
    assert (s["successful_requests"], s["failed_requests"]) == (12, 0)
    assert s["total_output_tokens"] == 12 * 8 and s["total_input_tokens"] > 12 * 16
    assert 0 <= s["cached_input_tokens"] < s["total_input_tokens"]
    assert all(r["mean"] is not None and r["p50"] <= r["p90"] <= r["p99"] for r in result["latency_ms"]["rows"])
    assert result["setup"]["server"] == "pdchat" and result["model"] == "random:tiny"
    assert result["server_after"]["kv_blocks_used"] == 0 and result["server_after"]["running"] == 0


def test_bench_serve_counts_failures(pdchat_serve, capsys):
    url, _ = pdchat_serve
    code, result, err = bench(capsys, "--backend", url, "--model", "gpt-4", "--concurrency", "2", "--requests", "3",
                              "--endpoint", "completions")
    assert code == 0, err
    assert (result["summary"]["successful_requests"], result["summary"]["failed_requests"]) == (0, 3)
    assert result["summary"]["first_error"].startswith("HTTP 404")


def test_pdchat_serve_stops_cleanly_on_ctrl_c(pdchat_serve):
    url, proc = pdchat_serve
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0


@pytest.mark.parametrize("argv, words", [
    ([], "give --backend URL"),
    (["--backend", "ftp://x"], "http(s) URL"),
])
def test_bench_serve_bad_input_is_one_line(capsys, argv, words):
    code = main(["bench", "serve", *argv])
    err = capsys.readouterr().err
    assert code == 1 and words in err and "Traceback" not in err
