"""A model whose embedding and LM head are GGUF Q8_0 matrices read as fp32 (the default model's
embedding and tied head), or whose layer matrices are Q4_1 ones (the default model's layers): on
the CPU kernels they are held as exact blocks (int8, a quarter of the bytes; Q4, under a fifth),
and the model's numbers do not move by a bit (off AMX tiles: on them, within rounding, the last
test)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdchat.engine import Engine, SamplingParams, paths, quant
from pdchat.engine.random_models import byte_tokenizer, preset_config, random_state_dict
from pdchat.kernels import cpu, reference

HEADS = ("model.embed_tokens.weight", "lm_head.weight")
PROMPT = list(range(60, 100))        # 40 tokens: the strips' path; a decode row takes the dot path


def q8_0_form(w: torch.Tensor) -> torch.Tensor:
    """What a GGUF Q8_0 matrix reads as: per 32 weights an fp16 scale times integers in -127..127."""
    blocks = w.view(-1, 32)
    scale = (blocks.abs().amax(dim=1) / 127).half().float()
    q = torch.round(blocks / scale[:, None]).clamp(-127, 127).to(torch.int8)     # (no -0: integers)
    return (q.float() * scale[:, None]).view_as(w)


LONG_PROMPT = list(range(3, 253)) + list(range(3, 53))   # 300 tokens: past every build's fast rows
LEFT_FP32 = "model.layers.1.mlp.down_proj.weight"     # one layer matrix not of the form: held as it is


@pytest.fixture
def fp32_sums(monkeypatch):
    """Every kernel library the test loads sums exact blocks as its fp32 products do (off AMX
    tiles, where the build takes them there); on again afterwards (the default)."""
    loaded = []
    real = cpu.library

    def library(*args, **kwargs):
        lib = real(*args, **kwargs)
        lib.pd_exact_amx(0)
        loaded.append(lib)
        return lib
    monkeypatch.setattr(cpu, "library", library)
    yield
    for lib in loaded:
        lib.pd_exact_amx(1)


@pytest.fixture(scope="module")
def q4_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("q4-layers")
    cfg = preset_config("tiny")
    state = random_state_dict(cfg, seed=5)
    for name in state:
        if name.startswith("model.layers.") and name.endswith("proj.weight") and name != LEFT_FP32:
            state[name] = reference.q4_1_weights(state[name])
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    byte_tokenizer().save_pretrained(str(folder))
    return folder


def test_q4_1_layers_are_held_as_exact_blocks_and_change_no_number(q4_folder, monkeypatch, fp32_sums):
    with monkeypatch.context() as mp:
        mp.setattr(cpu.CpuKernels, "exact_q4_blocks", lambda self, weight, multiplied=True: None)
        plain, fp_logits, fp_tokens = run(q4_folder)
        with plain:
            fp_bytes = plain.stats().model_bytes
            fp_long = plain.prompt_logits(LONG_PROMPT)
    engine, logits, tokens = run(q4_folder)
    with engine:
        model = engine.loaded.model
        held = {name: m.quantized["none"].fmt if m.weight is None else "fp32"
                for name, m in quant.quantized_layers(model).items() if name.startswith("layers.")}
        assert held.pop("layers.1.mlp.down") == "fp32"
        assert set(held.values()) == {quant.EXACT_Q4}
        assert torch.equal(logits, fp_logits)           # a 40-token prompt: the strips, one C call
        assert tokens == fp_tokens                      # decode rows: the dot products
        assert model._layer_plan() is not None           # the one-call forward reads the mixed forms
        weights = [block.weights(norm) for block, norm in zip(model.layers, model._norms_after())]
        q, dm, bias = weights[0].qkv
        if q.shape[0] == 2:      # held by panels too (x86 with AVX2): a rows-only copy is not this build's
            weights[0] = weights[0]._replace(qkv=(q[:1].clone(), dm[:1].clone(), bias))
            cfg = model.cfg
            assert model.ops.prepare_layers(weights, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                            cfg.rms_norm_eps) is None
        # 6 bits a weight a layout (by rows; AVX-512 builds by panels too, the kernels' tests)
        layouts = {n: model.get_submodule(n).quantized["none"].weight.shape[0] for n in held}
        saved = sum(w.numel() * 4 - layouts[name] * (w.numel() // 2 + w.numel() // 32 * 8)
                    for name, w in ((n, model.get_submodule(n).full_precision_weight()) for n in held))
        assert fp_bytes - engine.stats().model_bytes == saved
        # past the fast rows, op by op: C by chunks of them, or BLAS on weights rebuilt a slice at
        # a time (the same weights; BLAS's sums may differ by slice)
        torch.testing.assert_close(engine.prompt_logits(LONG_PROMPT), fp_long, atol=1e-4, rtol=1e-4)
        engine.update(spec="draft")                     # int8 copies made from the rebuilt weights
        drafted = engine.submit(PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).result()
        assert drafted.token_ids == fp_tokens


@pytest.fixture(scope="module")
def q8_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("q8-heads")
    cfg = preset_config("tiny")                        # an untied head: two matrices outside the layers
    state = random_state_dict(cfg, seed=3)
    for name in HEADS:
        state[name] = q8_0_form(state[name])
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    byte_tokenizer().save_pretrained(str(folder))
    return folder


def run(folder: Path, **settings) -> tuple[Engine, torch.Tensor, list[int]]:
    engine = Engine(model=str(folder), device="cpu", telemetry=False, kv_cache_mb=16, **settings)
    logits = engine.prompt_logits(PROMPT)
    tokens = engine.submit(PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).result().token_ids
    return engine, logits, tokens


@pytest.fixture(scope="module")
def as_fp32(q8_folder) -> tuple[torch.Tensor, list[int], int]:
    """The same model with the form not looked for: fp32 matrices, as before exact blocks."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu.CpuKernels, "exact_int8_blocks", lambda self, weight, multiplied=True: None)
        engine, logits, tokens = run(q8_folder)
        with engine:
            assert all(m.weight is not None for m in quant.quantized_layers(engine.loaded.model).values())
            return logits, tokens, engine.stats().model_bytes


def test_q8_0_heads_are_held_as_exact_blocks_and_change_no_number(q8_folder, as_fp32, fp32_sums):
    engine, logits, tokens = run(q8_folder)
    with engine:
        model = engine.loaded.model
        for name in ("embed", "lm_head"):
            layer = model.get_submodule(name)
            assert layer.weight is None and layer.quantized["none"].fmt == quant.EXACT_INT8
        assert all(m.weight is not None for m in model.layers.modules() if isinstance(m, quant.QuantLinear))
        fp_logits, fp_tokens, fp_bytes = as_fp32
        assert torch.equal(logits, fp_logits)          # the embedding's rows and the head's products
        assert tokens == fp_tokens
        vocab, hidden = model.cfg.vocab_size, model.cfg.hidden_size
        # the untied embedding by rows only (looked up, never multiplied); the head by panels too
        # where the build multiplies by them (x86 with AVX2)
        assert model.get_submodule("embed").quantized["none"].weight.shape[0] == 1
        layouts = 1 + model.get_submodule("lm_head").quantized["none"].weight.shape[0]
        saved = 2 * vocab * hidden * 4 - layouts * (vocab * hidden + vocab * hidden // 32 * 4)
        assert fp_bytes - engine.stats().model_bytes == saved


def test_precision_switches_and_the_self_draft_keep_exact_heads(q8_folder, as_fp32, fp32_sums):
    engine, logits, _ = run(q8_folder)
    with engine:
        embed = engine.loaded.model.embed
        engine.update(quant="int8")
        assert embed.quantized["int8"].fmt == "int8" and "none" not in embed.quantized
        engine.update(quant="none")
        assert embed.quantized["none"].fmt == quant.EXACT_INT8
        assert torch.equal(engine.prompt_logits(PROMPT), logits)
        held = engine.stats().model_bytes
        engine.update(spec="draft")                    # int8 copies beside, the head's made from its blocks
        assert set(embed.quantized) == {"none", "int8"} and embed.weight is None
        drafted = engine.submit(PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).result()
        assert drafted.token_ids == as_fp32[1]         # speculation never changes greedy output
        engine.update(spec="off")
        assert set(embed.quantized) == {"none"} and engine.stats().model_bytes == held


def test_matrices_not_of_that_form_stay_fp32(tiny_engine):
    model = tiny_engine.loaded.model
    assert model.embed.weight is not None and "none" not in model.embed.quantized


def test_on_amx_tiles_exact_blocks_decode_the_fp32_tokens_within_rounding(q4_folder, monkeypatch):
    """Where the CPU has AMX tiles, exact blocks go on them from 4 rows: the numbers move by fp32
    rounding, not the greedy tokens."""
    if not cpu.library(paths.cache_dir()).pd_exact_amx(-1):        # the engine's build
        pytest.skip("no AMX tiles in this build (an x86 CPU with amx_tile, amx_bf16 and avx512_bf16)")
    engine, logits, tokens = run(q4_folder)
    engine.close()
    with monkeypatch.context() as mp:
        mp.setattr(cpu.CpuKernels, "exact_q4_blocks", lambda self, weight, multiplied=True: None)
        plain, fp_logits, fp_tokens = run(q4_folder)
        plain.close()
    assert not torch.equal(logits, fp_logits)
    torch.testing.assert_close(logits, fp_logits, atol=1e-4, rtol=1e-4)
    assert tokens == fp_tokens
