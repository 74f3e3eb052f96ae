"""`pdchat bench spec`: decode speed with speculative decoding off vs each method, on a grounded
workload (rewrite a given text: the answer quotes its context) and on open-ended questions."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from pdchat.engine.config import EngineConfig, SamplingParams
from pdchat.engine.engine import Engine
from pdchat.engine import payoff
from pdchat.engine.errors import InvalidRequest
from pdchat.bench import Progress, median, ratio

GROUNDED_TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, white paint peeling in long strips. "
    "Every evening at dusk the keeper climbed the one hundred and twelve steps, wound the clockwork, "
    "trimmed the wick and lit the great lamp. Its beam swept the water every ten seconds, and ships "
    "far out at sea counted the flashes to know where they were. In winter the storms came from the "
    "north-west, throwing spray over the gallery rail, and the keeper wrote each one in the log: the "
    "date, the wind, the height of the waves, and whether any vessel had passed. In forty years the "
    "light never once went dark. When the automatic lamp was installed, the keeper locked the door, "
    "left the key with the harbour master, and walked back along the rock without looking behind him. "
    "The log books went to the museum in town, where they sit in a glass case beside his brass telescope."
)
GROUNDED = [
    f"Rewrite the following text, correcting nothing and changing nothing, word for word:\n\n{GROUNDED_TEXT}",
    f"Here is a story:\n\n{GROUNDED_TEXT}\n\nCopy the story out again exactly as written.",
]
OPEN_ENDED = ["What are three good habits for staying healthy?", "Why is the sky blue?",
              "Give me some ideas for a weekend trip."]
METHODS = [("ngram", None), ("draft", "self")]
SAMPLED_METHODS = [("draft", "self")]     # sampled: the self-draft alone (the suite's minutes)
SEED = 1                                  # so a sampled row's tokens and acceptance repeat


def run(config: EngineConfig, *, quick: bool, progress: Progress) -> dict[str, Any]:
    max_tokens = 48 if quick else 160
    # spec_always: the bench measures each method as it is; the engine's own verdict is `pays_here`
    engine = Engine(replace(config, telemetry=False, prefix_cache=False, spec="off", spec_always=True),
                    say=lambda m: None)
    try:
        workloads = {"grounded": GROUNDED[:1] if quick else GROUNDED, "open-ended": OPEN_ENDED[:1] if quick else OPEN_ENDED}
        rows = measure(engine, workloads, max_tokens, progress)
        progress("done", 1.0)
        goals = {"ngram grounded": ">= 2.0x", "ngram open-ended": ">= 0.95x",
                 "self-draft grounded": ">= 1.5x", "self-draft open-ended": ">= 1.5x"}
        return {"model": config.model, "device": str(engine.device),
                "inputs": {"max_tokens": max_tokens, "sampled_seed": SEED, "grounded_prompts": len(workloads["grounded"]),
                           "open_ended_prompts": len(workloads["open-ended"])},
                "speculative_decoding": {"rows": rows, **goals}}
    finally:
        engine.close()


def measure(engine: Engine, workloads: dict[str, list[str]], max_tokens: int, progress: Progress) -> list[dict[str, Any]]:
    """Per workload: decode tok/s with speculation off, then with each method (batch 1); greedy,
    then the self-draft again at the chat's default temperature (seeded)."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0)
    sampled = SamplingParams(max_tokens=max_tokens, seed=SEED)
    passes = [("greedy", greedy, METHODS), (f"temperature {sampled.temperature:g}", sampled, SAMPLED_METHODS)]
    rows = []
    steps = len(workloads) * sum(1 + len(methods) for _, _, methods in passes)
    done = 0
    for sampling, params, methods in passes:
        for name, prompts in workloads.items():
            engine.update(spec="off")
            base = _decode_rate(engine, prompts, params)
            done += 1
            for method, draft in methods:
                progress(f"{name}, {sampling}: {method}", done / steps)
                try:
                    engine.update(spec=method)
                except InvalidRequest as e:          # e.g. no int8 kernel for self-draft here
                    rows.append({"workload": name, "sampling": sampling, "method": method, "error": str(e)})
                    continue
                rate, accept, mean_len = _decode_rate(engine, prompts, params, spec=True)
                rows.append({"workload": name, "sampling": sampling,
                             "method": "self-draft (int8)" if method == "draft" else method,
                             "tok_s_off": base[0], "tok_s_on": rate, "speedup": ratio(rate, base[0]),
                             "acceptance": accept, "accepted_per_step": mean_len,
                             # what the engine decides by default (payoff.py): off below 0.95x
                             "pays_here": rate >= payoff.LOSS * base[0]})
                done += 1
    engine.update(spec="off")
    return rows


def _decode_rate(engine: Engine, prompts: list[str], params: SamplingParams, spec: bool = False):
    """Median decode tok/s over the prompts (one at a time: batch 1), plus acceptance figures."""
    results = [engine.submit(p, params).result() for p in prompts]
    rate = median([r.metrics.decode_tok_s for r in results if r.metrics.decode_tok_s])
    if not spec:
        return rate, None, None
    drafted = sum(r.metrics.spec_drafted for r in results)
    accepted = sum(r.metrics.spec_accepted for r in results)
    steps = sum(r.metrics.spec_steps for r in results)
    return rate, (accepted / drafted if drafted else None), (accepted / steps if steps else None)
