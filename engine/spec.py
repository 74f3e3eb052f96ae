"""Speculative decoding: proposers guess k tokens, the target checks them all in ONE forward.

Proposers:
- `NgramProposer` (prompt lookup): find the latest earlier occurrence of the sequence's last n
  tokens and propose what followed it. Free; shines when the answer quotes its context.
- `DraftProposer`: a smaller model with the same tokenizer, or the target's own weights in int8
  ("self-draft"). A draft model's K/V live in a pool of its own that shares the target's block
  tables, so the draft's cache follows the target's (allocation, rollback, preemption) without
  bookkeeping of its own beyond how many positions it has computed. A self-draft is the target's
  model and runner: it attends over the target's K/V, so it has no prompt of its own to catch up
  on, and writes its guesses' K/V only at positions the verify then writes with the target's.

`verify` is lossless: greedy accepts while the draft equals the target's argmax; sampling uses
rejection sampling (accept with min(1, p/q), else sample the normalised residual max(0, p - q),
plus a bonus token when all k are accepted), so outputs follow the target distribution exactly.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from .errors import SamplingFailed
from .model_runner import ModelRunner, Work
from .sampler import NO_TOKEN, draw, greedy, target_probs, usable
from .sequence import Sequence

# What verify raises with when the target's logits have no distribution to sample from
NO_DISTRIBUTION = "the model's output has no usable distribution to sample from (non-finite logits)"


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None     # [k, V] draft distribution per token; None = one-hot (n-gram)


class Proposer(Protocol):
    name: str

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]: ...


class NgramProposer:
    name = "ngram"

    # Single-token matches are mostly coincidences in free text: they cost a verify and miss.
    def __init__(self, max_n: int = 3, min_n: int = 2):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(self.lookup(s.token_ids, k), None) for s, k in zip(seqs, ks)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens that followed the latest earlier occurrence of the longest matching tail."""
        n_tokens = len(tokens)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            tail = tokens[n_tokens - n:]
            # Search backwards from the most recent candidate; the tail itself is excluded.
            for start in range(n_tokens - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow
        return []


class DraftProposer:
    """Runs a draft model over the target's block tables: with its own K/V pool, or (self-draft:
    `switch` given) on the target's runner and K/V."""

    def __init__(self, name: str, runner: ModelRunner, switch=None):
        self.name = name
        self.runner = runner
        self.switch = switch        # self-draft: the target's quant switch, flipped to its int8 copies

    def _context(self, seq: Sequence) -> int:
        """Positions whose K/V the draft attends over: the target's computed ones for a self-draft,
        else what the draft's own pool holds."""
        return seq.num_computed_tokens if self.switch is not None else seq.draft_computed

    def _mode(self):
        if self.switch is None:
            return contextlib.nullcontext()
        from .quant import precision_mode
        return precision_mode(self.switch, "int8")

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([], None) for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        # Step 0 feeds what the draft's context lacks up to the last known token (a self-draft: that
        # token alone); each later step feeds the previous draft token.
        pending = [(i, s.token_ids[self._context(s):], self._context(s)) for i, s in enumerate(seqs) if ks[i] > 0]
        with self._mode():
            while pending:
                work = [Work(tokens, start, seqs[i].block_table) for i, tokens, start in pending]
                logits = self.runner.forward(work, [[len(w.tokens) - 1] for w in work])
                chosen = _choose(logits, [seqs[i] for i, _, _ in pending])
                nxt = []
                for row, (i, tokens, start) in enumerate(pending):
                    seq = seqs[i]
                    seq.draft_computed = start + len(tokens)
                    if chosen[row] is None:
                        continue             # the draft has nothing to offer; the target decides
                    token, dist = chosen[row]
                    drafts[i].tokens.append(token)
                    if dist is not None:
                        probs[i].append(dist)
                    if len(drafts[i].tokens) < ks[i]:
                        nxt.append((i, [token], seq.draft_computed))
                pending = nxt
        for d, ps in zip(drafts, probs):
            d.probs = torch.stack(ps) if ps else None       # a greedy draft's stay None: one-hot
        return drafts


def _choose(logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, torch.Tensor | None] | None]:
    """Each row's draft token and the distribution it was drawn from; None for a row with nothing
    usable (a NaN logit, or no distribution to sample). A greedy row's token is its argmax and its
    distribution one-hot, so none is built for it: the sampling distribution over the default
    model's 49K vocabulary and its checks took ~1.4 ms of a ~13 ms int8 draft step."""
    top = greedy(logits).tolist()
    chosen: list[tuple[int, torch.Tensor | None] | None] = [
        (token, None) if token != NO_TOKEN else None for token in top]
    sampled = [r for r, seq in enumerate(seqs) if not seq.params.greedy]
    if sampled:
        p = target_probs(logits[sampled], [seqs[r].params for r in sampled])
        for r, row, ok in zip(sampled, p, usable(p).tolist()):
            chosen[r] = (draw(row, seqs[r].generator), row) if ok else None
    return chosen


def verify(target_logits: torch.Tensor, draft: Draft, seq: Sequence,
           generator: torch.Generator | None) -> tuple[list[int], int]:
    """target_logits [k+1, V] at the last known token and each draft token.

    Returns (tokens to append, number of draft tokens accepted); always at least one token.
    """
    k = len(draft.tokens)
    if seq.params.greedy:       # one-hot on the target's argmax: no distribution to build
        top = greedy(target_logits).tolist()
        if NO_TOKEN in top:
            raise SamplingFailed(NO_DISTRIBUTION)
        n = next((i for i, token in enumerate(draft.tokens) if token != top[i]), k)
        return draft.tokens[:n] + [top[n]], n
    p = target_probs(target_logits, [seq.params] * (k + 1))
    if not bool(usable(p).all()):
        raise SamplingFailed(NO_DISTRIBUTION)
    out: list[int] = []
    for i, token in enumerate(draft.tokens):
        q_tok = 1.0 if draft.probs is None else float(draft.probs[i, token])
        p_tok = float(p[i, token])
        accept = p_tok >= q_tok or float(torch.rand(1, generator=generator, device=p.device)) * q_tok < p_tok
        if accept:
            out.append(token)
            continue
        if draft.probs is None:
            residual = p[i].clone()
            residual[token] = 0
        else:
            residual = (p[i] - draft.probs[i]).clamp(min=0)
        total = residual.sum()
        residual = residual / total if float(total) > 0 else p[i]
        out.append(draw(residual, generator))
        return out, i
    out.append(draw(p[k], generator))               # all accepted: a bonus token from the target
    return out, k


class AdaptiveK:
    """Per-request draft length: +2 after a fully accepted draft, -1 otherwise, within [1, max_k];
    speculation stops for a request whose acceptance stays low (open-ended chat pays nothing)."""

    def __init__(self, k: int, max_k: int | None = None, min_rate: float = 0.3, window: int = 16):
        self.k0, self.max_k, self.min_rate, self.window = k, max_k or 2 * k, min_rate, window

    def next_k(self, seq: Sequence) -> int:
        if seq.spec_off:
            return 0
        return seq.spec_k or self.k0

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        k = seq.spec_k or self.k0
        seq.spec_k = min(k + 2, self.max_k) if accepted == drafted else max(k - 1, 1)
        seq.spec_recent.append((drafted, accepted))
        recent = seq.spec_recent[-self.window:]
        total = sum(d for d, _ in recent)
        if total >= self.window and sum(a for _, a in recent) / total < self.min_rate:
            seq.spec_off = True
