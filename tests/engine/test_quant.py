"""Weight-only int8 and int4: faithful to fp32, held once in the precision that runs, switchable
at run time (by reading the weights again), cached on disk, and a quarter / about a sixth of the
bytes."""
from __future__ import annotations

import pytest
import torch

from pdchat.engine import Engine, SamplingParams
from pdchat.engine import quant
from pdchat.kernels import reference


def test_quantize_round_trip_error_is_bounded_per_row():
    w = torch.randn(64, 96) * torch.linspace(0.01, 3, 64)[:, None]     # rows of very different scale
    q, s = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    err = (q.float() * s[:, None] - w).abs().amax(dim=1)
    assert (err <= s / 2 + 1e-6).all()                                   # half a step at most


def test_int4_groups_span_their_own_range():
    w = torch.randn(4, 128)
    w[0, :32] += 10                        # one group far from zero: asymmetric groups follow it
    packed, params = quant.quantize_int4(w)
    d, m = params.float().unbind(dim=2)
    assert torch.allclose(m, w.view(4, 4, 32).amin(dim=2), rtol=1e-2)    # bf16's precision
    assert torch.allclose(d * 15 + m, w.view(4, 4, 32).amax(dim=2), rtol=1e-2, atol=1e-2)
    back = reference.dequantize_int4(packed, params, torch.float32)
    assert ((back - w).abs().view(4, 4, 32) <= 0.55 * d[..., None] + 1e-6).all()


def test_fits_names_the_widths_int4_takes():
    assert quant.fits("int4", torch.empty(8, 128)) and not quant.fits("int4", torch.empty(8, 96))
    assert quant.fits("int8", torch.empty(8, 96))
    assert quant.fits("int4", torch.empty(8, 65536 + 64, device="meta"))       # any multiple of 64


def logits_of(engine: Engine) -> torch.Tensor:
    return engine.prompt_logits(engine.encode("quantize me please"))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_modes_are_close_to_fp32_and_switch_back_exactly(mode):
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=64) as engine:
        fp = logits_of(engine)
        engine.update(quant=mode)
        assert engine.stats().quant == mode
        q = logits_of(engine)
        engine.update(quant="none")
        back = logits_of(engine)
    assert torch.equal(fp, back)                   # read again from the source: the same fp32 weights
    assert not torch.equal(fp, q)                  # the quantized path really ran
    cos = torch.nn.functional.cosine_similarity(fp, q, dim=-1)
    assert cos.min() > (0.99 if mode == "int8" else 0.9)     # random weights: int4's worst case


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_loading_quantized_equals_switching_after_loading(mode):
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=64, quant=mode) as engine:
        loaded = logits_of(engine)
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=64) as engine:
        engine.update(quant=mode)
        switched = logits_of(engine)
    assert torch.equal(loaded, switched)


def test_quantized_models_hold_no_full_precision_weights():
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=64, quant="int4") as engine:
        layers = quant.quantized_layers(engine.loaded.model)
        assert layers and all(m.weight is None for m in layers.values())
        formats = {name: m.quantized["int4"].fmt for name, m in layers.items()}
        assert formats.pop("embed") == "int8"                 # the embedding (and tied head) stay int8
        assert set(formats.values()) == {"int4"}
        assert all(p.dtype == torch.float32 and p.dim() == 1 for p in engine.loaded.model.parameters())  # norms


def test_decode_reads_a_quarter_and_about_a_sixth_of_the_bytes(tiny_engine):
    fp = tiny_engine.stats().weight_bytes
    tiny_engine.update(quant="int8")
    q8 = tiny_engine.stats().weight_bytes
    tiny_engine.update(quant="int4")
    q4 = tiny_engine.stats().weight_bytes
    assert 0.24 < q8 / fp < 0.30                   # int8 + fp32 scales + fp32 norms
    # int4 layers at 0.625 bytes a weight, the tied head at int8 (random:tiny's head is a third
    # of its weights, so the ratio sits well above 0.625 / 4).
    assert q4 < q8 * 0.75 and q4 / fp > 0.625 / 4


def test_self_draft_copies_come_and_go_and_refuse_quantized_targets(tiny_engine):
    full = tiny_engine.stats().model_bytes
    tiny_engine.update(spec="draft")
    with_copies = tiny_engine.stats().model_bytes
    assert with_copies > full * 1.2                      # int8 copies beside the fp32 weights
    tiny_engine.update(quant="int4")                     # the draft would cost as much as the model
    assert tiny_engine.config.spec == "off"
    assert any("self-draft" in n and "int4" in n for n in tiny_engine.notices)
    tiny_engine.update(quant="none")
    assert tiny_engine.stats().model_bytes == full       # no copies left behind
    with pytest.raises(Exception, match="self-draft"):
        tiny_engine.update(quant="int8", spec="draft")


EVAL_TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
             "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
             "from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the centerpiece "
             "of the 1889 World's Fair, and to crown the centennial anniversary of the French Revolution.")


@pytest.mark.parametrize("mode, max_ppl_ratio, min_agree", [("int8", 1.10, 0.95), ("int4", 1.25, 0.85)])
def test_default_model_quality_and_cache(default_engine, mode, max_ppl_ratio, min_agree):
    """Perplexity and next-token agreement against fp32 on the real model (figures: `pdchat bench
    quant`); the quantized weights are cached on disk and read back from there.

    Agreement is teacher-forced: the quantized model reads fp32's greedy replies and predicts each
    next token. Comparing free-running greedy replies position by position measured luck: one
    flipped near-tie early misaligns every later token (a 1e-7 change in the int4 kernel's
    summation order moved that figure from over 0.3 to 0.125 with identical perplexity)."""
    ids = default_engine.tokenizer.encode(EVAL_TEXT, add_special_tokens=False)

    def perplexity() -> float:
        logits = default_engine.prompt_logits(ids)[:-1]
        return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).exp().item()

    prompts = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    fp_ppl = perplexity()

    def greedy_replies() -> list[tuple[list[int], list[int]]]:
        # One request at a time: submitted together, how the step loop admits them depends on the
        # threads' timing (all in one prefill, or one decoding while the others come in slices),
        # and the quantized model's near-ties made the figures move between runs.
        return [(default_engine.encode(p), default_engine.generate([p], greedy)[0].token_ids) for p in prompts]

    def agreement(replies: list[tuple[list[int], list[int]]]) -> float:
        """How often the model, reading each prompt and reply, predicts the reply's next token."""
        agree = 0
        for prompt_ids, reply in replies:
            logits = default_engine.prompt_logits(prompt_ids + reply)
            predicted = logits[len(prompt_ids) - 1:-1].argmax(dim=-1)
            agree += (predicted == torch.tensor(reply)).sum().item()
        return agree / sum(len(r) for _, r in replies)

    fp_replies = greedy_replies()
    assert agreement(fp_replies) == 1.0              # fp32 predicts its own greedy replies
    default_engine.update(quant=mode)
    try:
        q_ppl = perplexity()
        q_agree = agreement(fp_replies)
        # The decode step's kernels (one row at a time) against the prompt's (rows in tiles): the
        # quantized model's own greedy replies, read back, are what it predicts.
        self_agree = agreement(greedy_replies())
        cache = quant.cache_file(default_engine.files, mode)
        assert cache is not None and cache.is_file()
        default_engine.update(quant="none")
        default_engine.update(quant=mode)                  # now from the cache file
        assert perplexity() == pytest.approx(q_ppl, rel=1e-6)
    finally:
        default_engine.update(quant="none")
    assert q_ppl < fp_ppl * max_ppl_ratio, (fp_ppl, q_ppl)
    assert q_agree >= min_agree, q_agree
    assert self_agree >= 0.95, self_agree
