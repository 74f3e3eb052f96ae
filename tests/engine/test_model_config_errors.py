"""A config.json our code cannot use is a typed error naming the file and the key, never a
KeyError or AttributeError from deep inside."""
from __future__ import annotations

import pytest

from pdchat.engine.errors import ModelLoadError, UnsupportedModel
from pdchat.engine.model_config import ModelConfig
from pdchat.engine.random_models import PRESETS

SOURCE = "/models/x/config.json"
GOOD = dict(PRESETS["tiny"])


def bad(**changes) -> dict:
    cfg = {**GOOD, **changes}
    return {k: v for k, v in cfg.items() if v is not ...}       # ... removes a key


@pytest.mark.parametrize("cfg, error, words", [
    ([GOOD], ModelLoadError, f"{SOURCE} holds a JSON list, not an object"),
    ("llama", ModelLoadError, "holds a JSON str"),
    (bad(model_type=...), UnsupportedModel, f"model type '' in {SOURCE} is not supported"),
    (bad(hidden_size=...), ModelLoadError, f"{SOURCE} has no 'hidden_size'"),
    (bad(num_attention_heads=None), ModelLoadError, f"{SOURCE} has no 'num_attention_heads'"),
    (bad(vocab_size=...), ModelLoadError, "has no 'vocab_size'"),
    (bad(intermediate_size=...), ModelLoadError, "has no 'intermediate_size'"),
    (bad(num_hidden_layers=...), ModelLoadError, "has no 'num_hidden_layers'"),
    (bad(hidden_size="64"), ModelLoadError, "'hidden_size' must be a positive whole number, got '64'"),
    (bad(num_attention_heads=0), ModelLoadError, "'num_attention_heads' must be a positive whole number, got 0"),
    (bad(num_hidden_layers=2.5), ModelLoadError, "'num_hidden_layers' must be a positive whole number"),
    (bad(vocab_size=True), ModelLoadError, "'vocab_size' must be a positive whole number, got True"),
    (bad(rms_norm_eps=-1), ModelLoadError, "'rms_norm_eps' must be a positive number"),
    (bad(num_key_value_heads=3), ModelLoadError, "attention heads cannot share 3 key-value heads evenly"),
    (bad(head_dim=7), ModelLoadError, "head size must be even"),
    (bad(rope_scaling="linear"), ModelLoadError, "the RoPE settings must be an object"),
    (bad(rope_scaling={"rope_type": "yarn", "factor": 2.0}), UnsupportedModel, f"RoPE scaling 'yarn' in {SOURCE}"),
    (bad(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ModelLoadError,
     f"{SOURCE} (RoPE settings) has no 'low_freq_factor'"),
])
def test_a_config_it_cannot_use_is_a_typed_error(cfg, error, words):
    with pytest.raises(error) as e:
        ModelConfig.from_hf(cfg, source=SOURCE)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_default_source_is_the_file_name():
    with pytest.raises(ModelLoadError, match="^config.json has no 'hidden_size'"):
        ModelConfig.from_hf(bad(hidden_size=...))


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_still_reads(name):
    cfg = ModelConfig.from_hf(dict(PRESETS[name]))
    assert cfg.num_heads % cfg.num_kv_heads == 0 and cfg.rope_inv_freq().shape == (cfg.head_dim // 2,)


def test_optional_keys_that_are_null_take_their_defaults():
    cfg = ModelConfig.from_hf(bad(num_key_value_heads=None, head_dim=None, rms_norm_eps=None,
                                  max_position_embeddings=None, rope_theta=None))
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.max_position, cfg.rope_theta) == \
        (cfg.num_heads, cfg.hidden_size // cfg.num_heads, 1e-6, 2048, 10000.0)
