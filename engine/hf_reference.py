"""Helpers to run Hugging Face transformers on exactly the weights an Engine loaded."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pdchat.engine.loader import load_hf_state_dict


def hf_model_for(engine) -> torch.nn.Module:
    """A transformers model with the engine's weights (fp32, CPU, eager attention off: sdpa)."""
    files = engine.files
    if files.random_preset is None:
        return AutoModelForCausalLM.from_pretrained(str(files.path), dtype=torch.float32).eval()
    cfg = AutoConfig.for_model(**dict(engine.loaded.hf_config))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)   # tiny: init cost is nil
    state = load_hf_state_dict(files, torch.device("cpu"), torch.float32, seed=engine.config.seed)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    # Never stop early (like our ignore_eos): an EOS id no token can have. Clearing the EOS does not
    # work (transformers falls back to the model config), and min_new_tokens *suppresses* EOS.
    never = model.config.vocab_size + 1
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=[never], pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()
