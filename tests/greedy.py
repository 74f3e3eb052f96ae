"""Whether two engines agree on greedy decoding, where rounding may break near-ties differently.

Comparing two generated token lists fails on the first near-tie rounding flips (bf16 on a GPU, a
different reduction order): one flip and the continuations diverge. So a run is checked teacher-
forced: the other engine scores the very tokens the first one chose, and at every generated
position the chosen token must be its likeliest, or within `tie` of it (plus `rel` of the
likeliest logit: bf16 logits are stepped by 2^-8 of their magnitude, 0.5 at 64 to 128).
"""
from __future__ import annotations

import torch


def disagreements(prompt: list[int], tokens: list[int], logits: torch.Tensor, tie: float,
                  rel: float = 0.0) -> list[str]:
    """Positions where `tokens` (greedy after `prompt`) is not the likeliest token of `logits`
    (another engine's logits over prompt + tokens, one row per position) nor within
    tie + rel * |likeliest logit| of it."""
    out = []
    for i, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + i].float()
        best = int(row.argmax())
        gap = float(row[best] - row[token])
        if token != best and gap > tie + rel * abs(float(row[best])):
            out.append(f"token {i}: chose {token}, the other engine's likeliest is {best} by {gap:.4f}")
    return out
