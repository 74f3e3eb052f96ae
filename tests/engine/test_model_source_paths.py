"""A model spec that looks like a path is looked for on disk only: a missing one is "no such file
or folder", not a hub lookup; `org/name` stays a hub id. A damaged cache note costs only a name."""
from __future__ import annotations

import os

import pytest

from pdchat.engine.errors import ModelNotFound
from pdchat.engine.model_source import cached_models, looks_like_path, resolve, source_gguf


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("spec, path", [
    ("/nonexistent", True), ("./model", True), ("../model", True), ("~/model", True), ("~", True),
    ("models/llama/v2", True), ("my model/x y", True), ("x.gguf", True), ("org/name.gguf", True),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", False), ("Qwen/Qwen2.5-0.5B-Instruct", False),
    ("meta-llama/Llama-3.2-1B", False), ("smollm2-135m", False), ("random:tiny", False), ("gpt2", False),
])
def test_looks_like_path(spec, path):
    assert looks_like_path(spec) is path


@pytest.mark.parametrize("spec", ["/nonexistent", "./missing", "../missing", "~/no-such-pdchat-model",
                                  "a/b/c", "missing.gguf", "sub/missing.gguf"])
def test_a_missing_path_is_no_such_file_or_folder(spec):
    with pytest.raises(ModelNotFound, match="^no such file or folder: ") as e:
        resolve(spec, say=lambda line: None)
    assert str(e.value).endswith(os.path.expanduser(spec))


def test_a_plain_file_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFound, match="notes.txt is a file: give a model folder or a .gguf file"):
        resolve("./notes.txt", say=lambda line: None)


def test_a_hub_id_is_looked_up_on_the_hub():
    with pytest.raises(ModelNotFound, match="'nobody/nothing' is not cached and the Hugging Face hub is unreachable"):
        resolve("nobody/nothing", say=lambda line: None)


def test_a_folder_named_like_a_hub_id_is_a_folder(tmp_path):
    folder = tmp_path / "org" / "name"
    folder.mkdir(parents=True)
    with pytest.raises(ModelNotFound, match="has no config.json"):
        resolve("org/name", say=lambda line: None)


@pytest.mark.parametrize("note", ['{"name": ', "[1]", '{"name": 5, "source": 7}'])
def test_a_damaged_note_costs_only_the_name(note, tmp_path):
    folder = tmp_path / "cache" / "models" / "kept"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "pdchat.json").write_text(note)
    assert [(name, path) for name, path, _ in cached_models()] == [("5" if "5" in note else "kept", folder)]
    assert source_gguf(str(folder), fetch=False) is None
