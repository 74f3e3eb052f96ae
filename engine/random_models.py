"""`random:<preset>` models: real architectures with seeded random weights and a byte tokenizer.

For tests and for benchmarks where no weights can be fetched. Weights are generated with Hugging
Face names, so they load through the same path as real checkpoints and into transformers too.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import torch

from .errors import ModelNotFound

_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
             rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=256, eos_token_id=[257, 258])

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {**_TINY, "model_type": "llama", "tie_word_embeddings": False},
    "tiny-llama3": {**_TINY, "model_type": "llama", "tie_word_embeddings": True,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
    "tiny-mistral": {**_TINY, "model_type": "mistral", "tie_word_embeddings": False, "sliding_window": None},
    "tiny-qwen2": {**_TINY, "model_type": "qwen2", "tie_word_embeddings": True, "num_key_value_heads": 1},
    "tiny-qwen3": {**_TINY, "model_type": "qwen3", "tie_word_embeddings": True, "head_dim": 32,
                   "num_attention_heads": 4, "num_key_value_heads": 2},
    # Real shapes, for speed measurements without downloads.
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True, bos_token_id=256, eos_token_id=[257, 258]),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         tie_word_embeddings=True, bos_token_id=256, eos_token_id=[257, 258]),
    "llama-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                     tie_word_embeddings=True, bos_token_id=256, eos_token_id=[257, 258],
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                     tie_word_embeddings=False, bos_token_id=256, eos_token_id=[257, 258],
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def preset_config(name: str) -> dict[str, Any]:
    try:
        return dict(PRESETS[name])
    except KeyError:
        raise ModelNotFound(f"unknown random preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


@torch.no_grad()
def weight_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], float, float]]:
    """Every weight of a preset in generation order: (Hugging Face name, shape, std, offset); the
    value is offset + std * N(0, 1). Linear layers get std 1/sqrt(fan_in) so every layer matters
    (tests then exercise attention, not just the embedding)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    mtype = cfg["model_type"]

    def linear(name: str, out_f: int, in_f: int) -> tuple[str, tuple[int, ...], float, float]:
        return name, (out_f, in_f), 1 / math.sqrt(in_f), 0.0

    def norm(name: str, dim: int) -> tuple[str, tuple[int, ...], float, float]:
        return name, (dim,), 0.1, 1.0

    # The final norm gets random signs: with tied embeddings a positive one makes every token
    # predict itself (logit = |e|^2), and greedy text degenerates into repeats.
    specs = [("model.embed_tokens.weight", (cfg["vocab_size"], h), 1.0, 0.0), ("model.norm.weight", (h,), 1.0, 0.0)]
    if not cfg.get("tie_word_embeddings"):
        specs.append(linear("lm_head.weight", cfg["vocab_size"], h))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [linear(p + "self_attn.q_proj.weight", heads * hd, h), linear(p + "self_attn.k_proj.weight", kv * hd, h),
                  linear(p + "self_attn.v_proj.weight", kv * hd, h), linear(p + "self_attn.o_proj.weight", h, heads * hd)]
        if mtype == "qwen2":
            specs += [(p + f"self_attn.{n}_proj.bias", (size,), 0.1, 0.0)
                      for n, size in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd))]
        if mtype == "qwen3":
            specs += [norm(p + "self_attn.q_norm.weight", hd), norm(p + "self_attn.k_norm.weight", hd)]
        specs += [linear(p + "mlp.gate_proj.weight", inter, h), linear(p + "mlp.up_proj.weight", inter, h),
                  linear(p + "mlp.down_proj.weight", h, inter), norm(p + "input_layernorm.weight", h),
                  norm(p + "post_attention_layernorm.weight", h)]
    return specs


def random_weights(cfg: dict[str, Any], seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """The preset's seeded weights one at a time, in weight_specs' order (the same values as
    random_state_dict, without holding them all)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape, std, offset in weight_specs(cfg):
        # In place: `randn * std` held a second copy of each tensor (2 GB for an 8B embedding).
        t = torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(std)
        yield name, (t.add_(offset) if offset else t)
        del t             # not held while the next one is generated


def random_state_dict(cfg: dict[str, Any], seed: int = 0, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All of a preset's seeded weights by Hugging Face name (for a Hugging Face model to adopt)."""
    return dict(random_weights(cfg, seed, device, dtype))


CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer() -> Any:
    """A byte-level tokenizer (ids 0..255 = bytes, then <|endoftext|>, <|im_start|>, <|im_end|>):
    every text round-trips, no download needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {ch: i for i, ch in enumerate(byte_to_char)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode mapping."""
    code = ord(ch)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
