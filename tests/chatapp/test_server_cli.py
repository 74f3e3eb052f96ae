"""`pdchat serve` on the command line: its options and their defaults in --help, the flags, the
environment and the keys file reaching the server, one-line errors, and Ctrl+C on a real process
with a stream open."""
from __future__ import annotations

import argparse
import json
import queue
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from pdchat.chatapp.cli.main import build_parser, main
from pdchat.chatapp.serve.options import Limits, ServeOptions

from .loopback import MODEL

SERVE_OPTIONS = ["--host", "--port", "--api-key", "--api-key-file", "--shared-prefix-cache", "--allowed-hosts",
                 "--allowed-origins", "--max-pending", "--max-body-mb", "--read-timeout", "--max-connections"]


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


@pytest.mark.parametrize("option", SERVE_OPTIONS)
def test_every_serve_option_says_its_default(option):
    action = serve_parser()._option_string_actions[option]
    assert action.help and "default" in action.help, option


def test_help_shows_the_limits_it_applies():
    text = serve_parser().format_help()
    limits = Limits()
    for shown in (f"(default {limits.max_body_bytes // 2**20})", f"(default {limits.read_timeout_s:g})",
                  f"(default {limits.max_connections})", "(default 8000;", "(default 127.0.0.1"):
        assert shown in " ".join(text.split()), shown


@pytest.fixture
def served(monkeypatch) -> dict:
    """What cmd_serve hands to serve(), which then does nothing."""
    got: dict = {}
    monkeypatch.setattr("pdchat.chatapp.serve.app.serve", lambda config, **kw: got.update(kw, config=config))
    monkeypatch.delenv("PDCHAT_API_KEY", raising=False)
    return got


def test_serve_defaults_reach_the_server(served):
    assert main(["serve", "--model", MODEL]) == 0
    assert (served["host"], served["port"], served["max_pending"]) == ("127.0.0.1", 8000, 256)
    assert served["options"] == ServeOptions()
    assert served["config"].model == MODEL


def test_serve_flags_environment_and_keys_file_reach_the_server(served, tmp_path, monkeypatch):
    monkeypatch.setenv("PDCHAT_API_KEY", "env-key")
    keys = tmp_path / "keys"
    keys.write_text("# team A\nfile-key\n")
    assert main(["serve", "--port", "0", "--api-key-file", str(keys), "--shared-prefix-cache",
                 "--allowed-hosts", "box.lan, gpu.lan", "--allowed-origins", "http://localhost:3000",
                 "--max-pending", "5", "--max-body-mb", "2", "--read-timeout", "7", "--max-connections", "9"]) == 0
    assert served["options"] == ServeOptions(
        api_keys=("env-key", "file-key"), shared_prefix_cache=True, allowed_hosts=("box.lan", "gpu.lan"),
        allowed_origins=("http://localhost:3000",),
        limits=Limits(max_body_bytes=2 * 2**20, read_timeout_s=7, max_connections=9))
    assert (served["port"], served["max_pending"]) == (0, 5)
    assert main(["serve", "--api-key", "flag-key"]) == 0
    assert served["options"].api_keys == ("flag-key",)             # the flag wins over the variable


@pytest.mark.parametrize("argv, line", [
    (["--api-key-file", "/nonexistent/keys"], "pdchat: error: cannot read the keys file /nonexistent/keys: "
                                              "No such file or directory"),
    (["--port", "70000"], "pdchat: error: cannot listen on 127.0.0.1:70000: a port is a number from 0 to 65535 "
                          "(0: any free port)"),
    (["--host", "no-such-host.invalid"], "pdchat: error: cannot listen on no-such-host.invalid:8000: "),
])
def test_a_setting_that_cannot_work_is_one_line_before_loading(capsys, monkeypatch, argv, line):
    monkeypatch.delenv("PDCHAT_API_KEY", raising=False)
    # the model does not exist: the error must come before anything tries to load it
    assert main(["serve", "--model", "no-such-model-anywhere", *argv]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(line)


def test_ctrl_c_ends_open_streams_and_exits_without_a_traceback(tmp_path):
    """The real thing: `pdchat serve` in its own process, a key from a file, a stream open, SIGINT."""
    keys = tmp_path / "keys"
    keys.write_text("sekret\n")
    code = "import sys; from pdchat.chatapp.cli.main import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--model", MODEL, "--device", "cpu", "--port", "0",
                             "--kv-cache-mb", "16", "--api-key-file", str(keys)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)
    reader.start()
    err: list[str] = []
    try:
        while not (banner := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", "".join(err))):
            err.append(lines.get(timeout=120))
        url = banner.group(1)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                "ignore_eos": True, "stream": True}
        assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
        events = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer sekret"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 4:
                        proc.send_signal(signal.SIGINT)          # what Ctrl+C sends
        status = proc.wait(60)
    finally:
        proc.kill()
    reader.join(10)
    err += list(lines.queue)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert status == 0                                   # Ctrl+C is how a server stops
    text = "".join(err)
    assert "Traceback" not in text and "CancelledError" not in text, text
