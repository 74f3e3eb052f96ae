"""Careless input to `pdchat run | models | info | --help` gives one readable line and exit code 1
(2 for a usage error), never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdchat.chatapp.cli.main import main

from .loopback import free_port


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def one_line(capsys, argv: list[str], code: int) -> str:
    """main(argv) fails with `code` and says why in one line, the last on stderr (progress lines
    such as "loading ..." may come before it)."""
    assert main(argv) == code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert lines and lines[-1].startswith("pdchat") and "error" in lines[-1], err
    assert sum("error" in line for line in lines) == 1, err
    return lines[-1]


@pytest.mark.parametrize("flag, value, words", [
    ("--seed", str(2**70), "--seed: must be at least -2**63 and less than 2**64"),
    ("--seed", str(2**64), "--seed: must be at least -2**63 and less than 2**64"),
    ("--seed", str(-2**63 - 1), "--seed: must be at least -2**63"),
    ("--seed", "1.5", "--seed: expected a whole number"),
    ("--temperature", "nan", "--temperature: must be at least 0 and at most 2, got nan"),
    ("--temperature", "inf", "--temperature: must be at least 0 and at most 2"),
    ("--temperature", "-0.1", "--temperature: must be at least 0 and at most 2"),
    ("--temperature", "2.5", "--temperature: must be at least 0 and at most 2"),
    ("--temperature", "warm", "--temperature: expected a number"),
    ("--top-p", "0", "--top-p: must be more than 0 and at most 1"),
    ("--top-p", "1.01", "--top-p: must be more than 0 and at most 1"),
    ("--top-p", "nan", "--top-p: must be more than 0 and at most 1"),
    ("--top-k", "-1", "--top-k: must be at least 0, got -1"),
    ("--max-tokens", "0", "--max-tokens: must be at least 1"),
    ("--threads", "100000", "--threads: must be at least 1 and at most"),
    ("--chunk-size", "-5", "--chunk-size: must be at least 1"),
])
def test_a_bad_number_is_a_usage_error_before_any_model_loads(flag, value, words, capsys):
    err = one_line(capsys, ["run", "hi", "--model", "random:nope", flag, value], code=2)
    assert words in err


def test_a_tiny_temperature_samples_greedily(capsys):
    # 1e-40 passes the CLI's range; the engine must not divide the logits by it.
    code = main(["run", "hi", "--model", "random:tiny", "--temperature", "1e-40", "--max-tokens", "4", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    greedy = main(["run", "hi", "--model", "random:tiny", "--temperature", "0", "--max-tokens", "4", "--json"])
    assert greedy == 0 and json.loads(out)["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]


@pytest.mark.parametrize("argv", [["run", "caf\udce9"], ["run", "hi", "--system", "\udcff"]], ids=["prompt", "system"])
def test_text_that_is_not_utf8_is_a_usage_error(argv, capsys):
    # Bytes that are not UTF-8 on the command line reach Python as lone surrogates.
    assert "not valid UTF-8" in one_line(capsys, argv + ["--model", "random:tiny"], code=2)


@pytest.mark.parametrize("spec", ["/nonexistent", "./no/such", "../no-such", "~/no-such-pdchat-model",
                                  "no/such/folder", "missing.gguf"])
def test_a_missing_path_is_no_such_file(spec, capsys):
    err = one_line(capsys, ["run", "hi", "--model", spec], code=1)
    assert f"no such file or folder: {os.path.expanduser(spec)}" in err


def test_a_file_that_is_no_model(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    assert f"{notes} is a file: give a model folder or a .gguf file" in one_line(
        capsys, ["run", "hi", "--model", str(notes)], code=1)


def test_a_hub_id_is_not_a_path(capsys):
    err = one_line(capsys, ["run", "hi", "--model", "HuggingFaceTB/no-such-model-pdchat"], code=1)
    assert "is not cached and the Hugging Face hub is unreachable" in err


@pytest.mark.parametrize("config, words", [
    ([1, 2], "{folder}/config.json holds a JSON list"),
    ({"model_type": "llama", "vocab_size": 64}, "{folder}/config.json has no 'num_attention_heads'"),
    ({"model_type": "llama", "num_attention_heads": 2, "hidden_size": "64"}, "'hidden_size' must be a positive"),
    ({"model_type": "gpt2"}, "model type 'gpt2' in {folder}/config.json is not supported"),
])
def test_a_broken_config_json_is_one_line(config, words, tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    # The message names the file with its whole path.
    assert words.format(folder=folder) in one_line(capsys, ["run", "hi", "--model", str(folder)], code=1)


@pytest.mark.parametrize("url, words", [
    ("http://[::1", "Invalid IPv6 URL"),
    ("http://127.0.0.1:99999", "Port out of range"),
    ("http://127.0.0.1:port", "Port could not be cast"),
    ("localhost:8000", "wants an http(s) URL"),
])
def test_a_bad_backend_url_is_one_line(url, words, capsys):
    assert words in one_line(capsys, ["run", "hi", "--backend", url], code=1)


def test_a_server_that_is_not_openai_is_one_line(capsys):
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    from .loopback import running
    page = Starlette(routes=[Route("/v1/models", lambda request: HTMLResponse("<h1>hello</h1>"))])
    with running(page) as url:
        assert "did not answer with a model list" in one_line(capsys, ["run", "hi", "--backend", url], code=1)
        assert "did not answer with a model list" in one_line(
            capsys, ["bench", "serve", "--backend", url, "--requests", "1"], code=1)


def test_unreachable_backend_still_one_line(capsys):
    assert "cannot reach" in one_line(capsys, ["run", "hi", "--backend", f"http://127.0.0.1:{free_port()}"], code=1)


def test_models_lists_a_folder_with_a_damaged_note(tmp_path, capsys):
    folder = tmp_path / "cache" / "models" / "damaged"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "pdchat.json").write_text('{"name": ')        # cut short
    assert main(["models"]) == 0
    assert "damaged" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["models", "info"])
def test_a_cache_dir_that_is_a_file_is_one_line(command, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(blocker))
    assert "a-file" in one_line(capsys, [command], code=1)


def test_help_returns_zero(capsys):
    assert main(["--help"]) == 0 and "usage: pdchat" in capsys.readouterr().out


def test_a_closed_pipe_ends_quietly():
    # `pdchat run ... | head -c 0`: the reader is gone before the first write (there is always one:
    # the reply ends with a newline), so the outcome does not depend on when the model stops;
    # no traceback, no "Exception ignored".
    proc = subprocess.Popen([sys.executable, "-m", "pdchat.chatapp.cli.main", "run", "hi", "--model", "random:tiny",
                             "--max-tokens", "4000", "--temperature", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 1
    assert "Traceback" not in err and "Exception ignored" not in err
