"""`pdchat bench quant`: what quantized weights cost in quality, against the load dtype on the same
model: perplexity on a fixed evaluation text (bench/data/eval_text.txt, our own, about 800
tokens of plain English prose) and the share of greedy tokens that match over fixed prompts.

A greedy divergence changes every later token, so the match rate is a strict measure; the count
of identical outputs says how often nothing changed at all. Random presets give no meaningful
quality figures (their text is noise), so the suite refuses them.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pdchat.engine.config import EngineConfig, SamplingParams
from pdchat.engine.engine import Engine
from pdchat.engine.errors import InvalidRequest
from pdchat.bench import Progress

EVAL_TEXT = Path(__file__).with_name("data") / "eval_text.txt"
PROMPTS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?",
           "Write a haiku about the sea.", "Explain what a CPU does in one sentence.",
           "Give me a tip for learning a language.", "Who wrote Romeo and Juliet?",
           "Describe a cat to someone who has never seen one."]
MODES = ("int8", "int4")


def run(config: EngineConfig, *, quick: bool, progress: Progress) -> dict[str, Any]:
    if config.model.startswith("random:"):
        raise InvalidRequest("bench quant measures quality: random weights have none (use a real model)")
    tokens = 16 if quick else 32
    prompts = PROMPTS[:3] if quick else PROMPTS
    engine = Engine(replace(config, telemetry=False, prefix_cache=False, spec="off", quant="none"),
                    say=lambda m: None)
    try:
        ids = engine.encode(EVAL_TEXT.read_text())[:engine.max_model_len]
        greedy = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        progress("full precision", 0.0)
        base_ppl = perplexity(engine, ids)
        base_out = [c.token_ids for c in engine.generate(prompts, greedy)]
        rows = [_row(engine, "none", base_ppl, base_ppl, base_out, base_out)]
        for i, mode in enumerate(MODES):
            progress(mode, (i + 1) / (len(MODES) + 1))
            reason = engine.precision.supported(mode)
            if reason is not None:
                rows.append({"weights": mode, "reason": reason})
                continue
            engine.update(quant=mode)
            rows.append(_row(engine, mode, base_ppl, perplexity(engine, ids), base_out,
                             [c.token_ids for c in engine.generate(prompts, greedy)]))
        progress("done", 1.0)
        return {"model": config.model, "device": str(engine.device),
                "inputs": {"eval_text_tokens": len(ids), "prompts": len(prompts), "greedy_tokens": tokens},
                "quality": {"rows": rows}}
    finally:
        engine.close()


def perplexity(engine: Engine, ids: list[int]) -> float:
    logits = engine.prompt_logits(ids)[:-1]
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).exp().item()


def _row(engine: Engine, mode: str, base_ppl: float, ppl: float, base: list[list[int]],
         out: list[list[int]]) -> dict[str, Any]:
    same = sum(a == b for x, y in zip(base, out) for a, b in zip(x, y))
    return {"weights": engine.precision.label(mode),
            "model_mb": engine.precision.resident_bytes / 1e6, "perplexity": ppl,
            "perplexity_vs_first": ppl / base_ppl, "greedy_match": same / sum(map(len, base)),
            "identical_outputs": f"{sum(x == y for x, y in zip(base, out))} of {len(base)}"}
