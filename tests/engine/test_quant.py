"""Weight-only int8: faithful to fp32, switchable at run time, cached, and a quarter of the bytes."""
from __future__ import annotations

import torch

from pdchat.engine import Engine, SamplingParams
from pdchat.engine import quant


def test_quantize_round_trip_error_is_bounded_per_row():
    w = torch.randn(64, 96) * torch.linspace(0.01, 3, 64)[:, None]     # rows of very different scale
    q, s = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    err = (q.float() * s[:, None] - w).abs().amax(dim=1)
    assert (err <= s / 2 + 1e-6).all()                                   # half a step at most


def test_int8_mode_is_close_to_fp32_and_switches_back_exactly():
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=64) as engine:
        ids = engine.encode("quantize me please")
        fp = engine.prompt_logits(ids)
        engine.update(quant="int8")
        assert engine.stats().quant == "int8"
        q8 = engine.prompt_logits(ids)
        engine.update(quant="none")
        back = engine.prompt_logits(ids)
    assert torch.equal(fp, back)                   # fp32 weights are untouched by quantization
    assert not torch.equal(fp, q8)                 # the int8 path really ran
    cos = torch.nn.functional.cosine_similarity(fp, q8, dim=-1)
    assert cos.min() > 0.99


def test_decode_reads_a_quarter_of_the_bytes(tiny_engine):
    fp = tiny_engine.stats().weight_bytes
    tiny_engine.update(quant="int8")
    q8 = tiny_engine.stats().weight_bytes
    assert 0.24 < q8 / fp < 0.30                   # int8 + fp32 scales + fp32 norms


def test_default_model_int8_quality_and_cache(default_engine, tmp_path):
    """Greedy match rate and perplexity of int8 against fp32 on the real model."""
    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
            "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
            "from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the centerpiece "
            "of the 1889 World's Fair, and to crown the centennial anniversary of the French Revolution.")
    ids = default_engine.tokenizer.encode(text, add_special_tokens=False)

    def perplexity() -> float:
        logits = default_engine.prompt_logits(ids)[:-1]
        return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).exp().item()

    prompts = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    fp_ppl = perplexity()
    fp_out = [c.token_ids for c in default_engine.generate(prompts, greedy)]
    default_engine.update(quant="int8")
    try:
        q_ppl = perplexity()
        q_out = [c.token_ids for c in default_engine.generate(prompts, greedy)]
        cache = quant.cache_file(default_engine.files)
        assert cache is not None and cache.is_file()
    finally:
        default_engine.update(quant="none")
    assert q_ppl < fp_ppl * 1.10, (fp_ppl, q_ppl)
    same = sum(a == b for x, y in zip(fp_out, q_out) for a, b in zip(x, y)) / sum(map(len, fp_out))
    assert same > 0.5, same
