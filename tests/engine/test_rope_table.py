"""RoPE's cos and sin as rows of a table the model keeps (engine/model.py, _rope_rows): the same
numbers as computing them for the positions at hand, the table grown by powers of two and rebuilt
when the model's precision changes."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from pdchat.engine.model import Transformer
from pdchat.engine.model_config import ModelConfig


def _model() -> Transformer:
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position=8192, tie_embeddings=True)
    return Transformer(cfg)


def _lengths(*lens: int) -> SimpleNamespace:
    return SimpleNamespace(context_lens_host=list(lens))


def test_rows_of_the_table_are_the_computed_values_bit_for_bit() -> None:
    model = _model()
    torch.manual_seed(0)
    positions = torch.cat([torch.arange(40, 63), torch.randint(0, 3000, (200,)), torch.tensor([2999, 0])])
    cos, sin = model._rope_rows(positions, _lengths(63, 3000))
    want_cos, want_sin = model.rope(positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_the_table_grows_to_the_next_power_of_two() -> None:
    model = _model()
    model._rope_rows(torch.tensor([5]), _lengths(6))
    assert model._rope_cache[0].shape[0] == 256            # at least 256 rows
    model._rope_rows(torch.tensor([256]), _lengths(257))
    assert model._rope_cache[0].shape[0] == 512
    first = model._rope_cache[0]
    model._rope_rows(torch.tensor([300, 511]), _lengths(301, 512))
    assert model._rope_cache[0] is first                    # long enough: kept
    model._rope_rows(torch.tensor([1500]), _lengths(1501))
    assert model._rope_cache[0].shape[0] == 2048
    exact = _model()
    exact._rope_rows(torch.tensor([511]), _lengths(512))
    assert exact._rope_cache[0].shape[0] == 512           # a power of two already: that size


def test_a_change_of_precision_rebuilds_the_table() -> None:
    model = _model()
    model._rope_rows(torch.tensor([3]), _lengths(4))
    model.to(torch.float64)
    cos, sin = model._rope_rows(torch.tensor([3]), _lengths(4))
    assert cos.dtype == sin.dtype == torch.float64
    assert torch.equal(cos, model.rope(torch.tensor([3]))[0])


def test_without_lengths_on_the_host_the_values_are_computed() -> None:
    # (a CUDA graph's capture: the positions live on the device only)
    model = _model()
    positions = torch.tensor([7, 9000])                     # past any table: nothing looked up
    cos, _ = model._rope_rows(positions, _lengths())
    assert torch.equal(cos, model.rope(positions)[0]) and model._rope_cache is None
