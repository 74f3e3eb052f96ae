"""Weights are read one at a time as the model takes them (checkpoint.py), so loading holds no
second copy of the model: the same weights as reading everything first, a bounded number waiting,
and a corrupt file still one readable error."""
from __future__ import annotations

import weakref

import pytest
import torch
from safetensors.torch import save_file

from pdchat.engine.model import Transformer
from pdchat.engine import checkpoint, loader
from pdchat.engine.checkpoint import GeneratedWeights, SafetensorsWeights
from pdchat.engine.errors import ModelLoadError
from pdchat.engine.model_source import resolve
from pdchat.engine.random_models import PRESETS, preset_config, random_state_dict, random_weights, weight_specs


def generated(preset: str = "tiny") -> GeneratedWeights:
    cfg = preset_config(preset)
    return GeneratedWeights([n for n, *_ in weight_specs(cfg)], random_weights(cfg, seed=3))


def test_generated_weights_come_in_any_order_each_once():
    everything = random_state_dict(preset_config("tiny"), seed=3)
    weights = generated()
    names = list(everything)
    assert list(weights) == names and len(weights) == len(names)
    late, early = names[-1], names[0]
    assert "model.no_such.weight" not in weights and late in weights   # looking does not generate
    assert torch.equal(weights[late], everything[late])             # the rest wait...
    assert torch.equal(weights[early], everything[early])           # ...and come out the same
    with pytest.raises(KeyError):
        weights[early]                                               # taken: not kept twice
    with pytest.raises(KeyError):
        weights["model.no_such.weight"]
    assert weights.get("model.no_such.weight", "absent") == "absent"


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3"])
def test_loading_a_preset_copies_each_weight_before_reading_on(preset, monkeypatch):
    seen = {"since_copy": 0, "most": 0, "waiting": 0}
    getitem, load_state = GeneratedWeights.__getitem__, Transformer.load_hf_state_dict

    def taking(self, name):
        seen["since_copy"] += 1
        seen["most"] = max(seen["most"], seen["since_copy"])
        tensor = getitem(self, name)
        seen["waiting"] = max(seen["waiting"], len(self._waiting))
        return tensor

    def loading(self, hf, place):
        def placing(name, tensor):
            seen["since_copy"] = 0
            place(name, tensor)
        return load_state(self, hf, placing)
    monkeypatch.setattr(GeneratedWeights, "__getitem__", taking)
    monkeypatch.setattr(Transformer, "load_hf_state_dict", loading)
    files = resolve(f"random:{preset}", lambda m: None)
    lazy = loader.load(files, torch.device("cpu"), torch.float32).model
    assert seen["most"] == 3                          # q, k and v read for one fused copy
    assert seen["waiting"] <= 1                       # o_proj generated while q/k/v were asked for
    # the same parameters as from everything read at once
    everything = random_state_dict(preset_config(preset), seed=loader.zlib.crc32(preset.encode()))
    params = dict(lazy.named_parameters(remove_duplicate=False))
    expected = dict(lazy._from_hf(everything))
    assert expected.keys() <= params.keys() and len(expected) > 10
    for name, tensor in expected.items():
        assert torch.equal(params[name], tensor), name


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama3"])
def test_a_quantized_load_lets_go_of_each_full_precision_tensor(preset, monkeypatch):
    """Each tensor read is quantized and dropped before the load reads on: by the last layer, no
    tensor read earlier is alive (the embedding, 1 GB in fp32 for a 128K vocabulary, was once
    held to the end)."""
    read, alive_at_end = {}, []
    getitem = GeneratedWeights.__getitem__

    def taking(self, name):
        tensor = getitem(self, name)
        if name.endswith(f"{PRESETS[preset]['num_hidden_layers'] - 1}.mlp.down_proj.weight"):
            alive_at_end.extend(n for n, ref in read.items() if ref() is not None and ref().dim() == 2)
        read[name] = weakref.ref(tensor)
        return tensor
    monkeypatch.setattr(GeneratedWeights, "__getitem__", taking)
    loader.load(resolve(f"random:{preset}", lambda m: None), torch.device("cpu"), torch.float32, quant_mode="int8")
    assert len(read) > 10 and alive_at_end == []


def test_safetensors_are_read_by_name_and_a_corrupt_file_is_one_error(tmp_path):
    save_file({"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}, str(tmp_path / "model-1.safetensors"))
    save_file({"c": torch.zeros(2)}, str(tmp_path / "model-2.safetensors"))
    weights = SafetensorsWeights(sorted(tmp_path.glob("*.safetensors")))
    assert sorted(weights) == ["a", "b", "c"] and "c" in weights and "d" not in weights
    assert torch.equal(weights["a"], torch.arange(6.0).view(2, 3))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="corrupt weights file .*bad.safetensors"):
        SafetensorsWeights([bad])
    assert checkpoint.__doc__ and "one at a time" in checkpoint.__doc__
