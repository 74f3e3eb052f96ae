"""Hugging Face transformers on exactly the weights an Engine loaded: the baseline of
`pdchat bench baseline` and the oracle of the parity tests."""
from __future__ import annotations

from typing import Any

import torch

from .loader import load_hf_state_dict


def hf_model_for(engine, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    files = engine.files
    if files.random_preset is None:
        return AutoModelForCausalLM.from_pretrained(str(files.path), dtype=dtype).to(device).eval()
    cfg = AutoConfig.for_model(**dict(engine.loaded.hf_config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    state = dict(load_hf_state_dict(files, torch.device(device), dtype, seed=engine.config.seed))
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    # assign=True adopts our tensors (no copy, no init); buffers that are not weights (RoPE
    # frequencies) are then rebuilt by a real construction of the rotary module on the device.
    model.load_state_dict(state, strict=True, assign=True)
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            with torch.device(device):
                setattr(parent, name.rsplit(".", 1)[-1], type(module)(config=cfg))
    return model.to(device).eval()


@torch.inference_mode()
def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, **generate_kw: Any) -> list[int]:
    """Greedy `generate`, never stopping early (like our ignore_eos); generate_kw go to `generate`
    (a cache implementation, say)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    # An EOS id no token can have: clearing the EOS does not work (transformers falls back to the
    # model config), and min_new_tokens would *suppress* EOS and change the tokens.
    never = model.config.vocab_size + 1
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=[never], pad_token_id=0, **generate_kw)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits at every position of ids ([len, vocab]), in one forward."""
    device = next(model.parameters()).device
    return model(torch.tensor([ids], device=device)).logits[0].float()
