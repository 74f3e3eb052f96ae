"""The engine's speculative decoder: which proposer drafts (off, n-gram, a draft model, or the
int8 copies of the target's weights), the draft model and its KV pool (a self-draft has none: it
reads and writes the target's), proposing for a step's decodes with blocks reserved, verifying a
draft against the target's logits, and the adaptive draft length.

The algorithms (proposers, rejection sampling) are in spec.py; this module is their lifecycle.
"""
from __future__ import annotations

from typing import Callable

import torch

from .block_manager import BlockManager
from .errors import InvalidRequest
from .loader import LoadedModel, load
from .model_runner import ModelRunner
from .model_source import resolve
from .precision import WeightPrecision
from .scheduler import ScheduledSeq
from .sequence import Sequence
from .spec import AdaptiveK, Draft, DraftProposer, NgramProposer, Proposer, verify
from .payoff import SpecPayoff


class SpeculativeDecoder:
    def __init__(self, target: LoadedModel, precision: WeightPrecision, *, target_name: str, spec_tokens: int,
                 draft_model: str | None, load_draft_now: bool, seed: int, say: Callable[[str], None]):
        self.target = target
        self.target_name = target_name
        self.precision = precision
        self.draft_model = draft_model
        self.adaptive = AdaptiveK(spec_tokens)
        self.payoff: SpecPayoff | None = SpecPayoff()     # None: speculation is kept on whatever it costs
        self.proposer: Proposer | None = None
        self._draft_runner: ModelRunner | None = None
        self._seed, self._say = seed, say
        # A separate draft model is loaded with the target when speculation starts on, so the KV
        # pool is sized for both; else when speculation is first turned to it.
        self._draft = self._load_draft() if load_draft_now else None

    def _load_draft(self) -> LoadedModel | None:
        spec = self.draft_model
        if spec in (None, "self"):
            return None                            # self-draft: the target's own int8 weights
        draft = load(resolve(spec, self._say), self.precision.device, self.precision.dtype, seed=self._seed,
                     ops=self.target.quant.ops)
        if draft.tokenizer.get_vocab() != self.target.tokenizer.get_vocab():
            raise InvalidRequest(f"draft model {spec!r} has a different tokenizer from {self.target_name!r}")
        return draft

    def kv_bytes_per_token(self, mode: str) -> int:
        """The draft's K/V bytes per token when `mode` drafts with a separate model (for sizing the
        pool); a self-draft's K/V are the target's."""
        if mode != "draft" or self._draft is None:
            return 0
        return self._draft.config.kv_bytes_per_token(self.precision.dtype)

    def set_mode(self, mode: str, blocks: BlockManager, target: ModelRunner) -> None:
        """off | ngram | draft. A draft model's KV pool shares the target's block tables, so it has
        as many blocks as `blocks`; a self-draft runs on the target's runner (`target`)."""
        proposer: Proposer | None = None
        if mode == "ngram":
            proposer = NgramProposer()
        elif mode == "draft":
            proposer = self._draft_proposer(blocks, target)
        if self._self_drafting(self.proposer) and not self._self_drafting(proposer):
            self.precision.drop_draft_copies()
        self.proposer = proposer
        if self.payoff is not None:
            self.payoff.reset()

    @staticmethod
    def _self_drafting(proposer: Proposer | None) -> bool:
        return isinstance(proposer, DraftProposer) and proposer.switch is not None

    def _draft_proposer(self, blocks: BlockManager, target: ModelRunner) -> DraftProposer:
        if self._draft is None:
            self._draft = self._load_draft()       # a --draft-model not loaded at start-up
        if self._draft is None:
            refusal = self.precision.self_draft_refusal()
            if refusal is not None:
                raise InvalidRequest(f"{refusal}; pass --draft-model, or turn quantization off")
            return DraftProposer("self-draft", target, switch=self.precision.switch)
        if self._draft_runner is None:
            draft = self._draft
            try:
                self._draft_runner = ModelRunner(draft.model, draft.config, self.precision.device,
                                                 self.precision.dtype, blocks.num_blocks, blocks.block_size,
                                                 draft.config.max_position)
            except torch.OutOfMemoryError:
                # The pool was sized without a draft; at start-up it is sized for both.
                raise InvalidRequest("not enough memory for the draft's KV cache now; "
                                     "start with --spec draft instead") from None
        return DraftProposer(f"draft:{self.draft_model}", self._draft_runner)

    def set_tokens(self, k: int) -> None:
        """The initial draft length of new requests (each then adapts its own)."""
        self.adaptive = AdaptiveK(k)
        if self.payoff is not None:
            self.payoff.reset()

    def weigh(self, on: bool) -> None:
        """Whether speculation is measured against plain decoding and stopped where it does not pay."""
        self.payoff = SpecPayoff() if on else None

    @property
    def weighing(self) -> bool:
        """Speculation runs and is being measured (payoff.py)."""
        return self.proposer is not None and self.payoff is not None

    def probe_now(self) -> bool:
        """Whether the next decode-only step runs without drafts, to measure plain decoding."""
        return self.weighing and self.payoff.probe_now()

    def propose(self, items: list[ScheduledSeq], blocks: BlockManager,
                max_model_len: int) -> tuple[dict[int, Draft], list[int]]:
        """Drafts for this step's running decodes, by item index, with blocks reserved for them;
        also every index that reserved blocks (a verify may leave them to roll back)."""
        if self.proposer is None:
            return {}, []
        candidates, ks = [], []
        for idx, item in enumerate(items):
            seq = item.seq
            if item.num_tokens != 1 or not item.samples or seq.t_first_token is None:
                continue
            room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - len(seq.token_ids)) - 1
            k = min(self.adaptive.next_k(seq), room)
            if k > 0 and blocks.ensure_capacity(seq, len(seq.token_ids) + k):
                candidates.append(idx)
                ks.append(k)
        if not candidates:
            return {}, []
        drafts = self.proposer.propose([items[i].seq for i in candidates], ks)
        return {i: d for i, d in zip(candidates, drafts) if d.tokens}, candidates

    def measured(self, requests: int, drafted: bool, tokens: int, seconds: float) -> str | None:
        """After a decode-only step of `requests` that made `tokens` tokens: why speculation
        should stop because it measurably does not pay here (payoff.py), or None."""
        if not self.weighing:
            return None
        return self.payoff.record(requests, tokens, seconds, drafted, self.proposer.name)

    def verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor,
               generator: torch.Generator) -> list[int]:
        """The tokens a verify yields (accepted drafts plus one from the target); counts them."""
        tokens, accepted = verify(logits, draft, seq, seq.generator or generator)
        seq.num_computed_tokens += accepted          # accepted drafts' K/V are now valid
        seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)
        seq.spec_method = self.proposer.name
        seq.spec_drafted += len(draft.tokens)
        seq.spec_accepted += accepted
        seq.spec_steps += 1
        self.adaptive.update(seq, len(draft.tokens), accepted)
        return tokens

    def close(self) -> None:
        """Drop every model and KV pool reference (the engine is closing)."""
        self.target = self.precision = self._draft = self._draft_runner = self.proposer = None
