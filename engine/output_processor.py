"""After the forward: each request's new tokens, their text, stop checks, finishes, and every
event its stream sees (progress, tokens, the completion).

It owns the requests in flight (by id) and their text state (incremental detokenizer and stop
strings). A fault while processing one request ends that request alone.
"""
from __future__ import annotations

import sys
import time
import traceback
from typing import Any, Callable

from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer, TextOutput
from .errors import EngineError, SamplingFailed
from .metrics import RequestMetrics
from .model_runner import StepLogits
from .scheduler import ScheduledSeq, Scheduler, StepPlan
from .sequence import Sequence, Status
from .speculative import SpeculativeDecoder
from .spec import Draft
from .stream import Completion, FinishEvent, ProgressEvent, TokenEvent

# A prefill forward of this many prompt tokens reports its layers (about half a second on a
# 2-core CPU with the default model; shorter forwards end before a panel would show it).
LAYER_PROGRESS_TOKENS = 256


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], max_model_len: int,
                 scheduler: Scheduler, blocks: BlockManager, speculative: SpeculativeDecoder, layers: int = 0):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.blocks = blocks
        self.speculative = speculative
        self.layers = layers                 # the model's, to report a long prefill by; 0: never
        self.live: dict[str, Sequence] = {}
        self._text: dict[str, TextOutput] = {}

    # ---- requests arriving and leaving ----------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """Track a new request (the engine then queues it, here or at a prefill worker)."""
        self.live[seq.request_id] = seq
        self._text[seq.request_id] = TextOutput(IncrementalDetokenizer(self.tokenizer, seq.prompt_ids),
                                                seq.params.stop)

    def cancel(self, request_id: str) -> None:
        if request_id in self.live:
            self.finish(self.live[request_id], "cancelled")

    def fail(self, seqs: list[Sequence], e: Exception) -> None:
        """End these requests with finish_reason "error"; an engine bug is also printed in full."""
        if not isinstance(e, EngineError):
            traceback.print_exc(file=sys.stderr)
        for seq in seqs:
            self.finish(seq, "error", e)

    def finish_all(self, reason: str, error: Exception) -> None:
        for seq in list(self.live.values()):
            self.finish(seq, reason, error)

    def finish(self, seq: Sequence, reason: str, error: Exception | None = None) -> None:
        if seq.finished:
            return
        self.scheduler.remove(seq)
        self.live.pop(seq.request_id, None)
        out = self._text.pop(seq.request_id)
        try:
            out.finish()          # completion.text may extend the streamed deltas (EOS, cancel)
        except Exception as e:    # the detokenizer failing must still end the request
            reason, error = "error", error or e
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if error is not None:
            seq.error = str(error) if isinstance(error, EngineError) else f"{type(error).__name__}: {error}"
        completion = Completion(out.text, seq.output_ids, reason, RequestMetrics.of(seq), seq.error,
                                prompt_token_ids=seq.prompt_ids,
                                exception=error if isinstance(error, EngineError) else None)
        seq.sink.put(FinishEvent(completion))

    # ---- one step's results ---------------------------------------------------------------
    def prefill_starting(self, plan: StepPlan) -> None:
        """The prefill pause is visible from its first step: tell each request starting one, with
        the step's tokens and predicted time (a UI moves the bar by them until the first report)."""
        for item in plan.items:
            seq = item.seq
            if seq.t_first_token is None and seq.num_computed_tokens == (seq.num_cached_prompt_tokens or 0):
                seq.sink.put(ProgressEvent("prefill", seq.num_computed_tokens, seq.num_prompt_tokens,
                                           seq.num_cached_prompt_tokens or 0, time.perf_counter(),
                                           layers=self.layers if item.num_tokens >= LAYER_PROGRESS_TOKENS else 0,
                                           step_tokens=item.num_tokens, step_s=plan.predicted_s))

    def layer_progress(self, plan: StepPlan) -> Callable[[int], None] | None:
        """A forward that prefills LAYER_PROGRESS_TOKENS or more of a prompt takes seconds on a CPU:
        a callback that reports its way through the layers to those requests (None: none such)."""
        long = [i for i in plan.items if i.seq.in_prefill and i.num_tokens >= LAYER_PROGRESS_TOKENS]
        if not long or not self.layers:
            return None

        def on_layer(done: int) -> None:
            now = time.perf_counter()
            for item in long:
                seq = item.seq
                seq.sink.put(ProgressEvent("prefill", seq.num_computed_tokens, seq.num_prompt_tokens,
                                           seq.num_cached_prompt_tokens or 0, now, layers_done=done,
                                           layers=self.layers, step_tokens=item.num_tokens,
                                           step_s=plan.predicted_s))
        return on_layer

    def process(self, plan: StepPlan, out: StepLogits, drafts: dict[int, Draft], reserved: list[int],
                sampled: dict[int, list[int]], generator: Any) -> None:
        """Every item of the step, each on its own: a fault ends only that item's request."""
        now = time.perf_counter()
        for idx, item in enumerate(plan.items):
            draft = drafts.get(idx)
            try:
                rows = out.rows(idx) if draft else None       # a verify reads all of its rows
                self._process_item(item, draft, rows, sampled.get(idx), now, generator,
                                   rollback=idx in reserved)
            except Exception as e:
                self.fail([item.seq], e)

    def _process_item(self, item: ScheduledSeq, draft: Draft | None, rows: Any, sampled: list[int] | None,
                      now: float, generator: Any, rollback: bool) -> None:
        """For one item: its computed count, the verify of its draft, block commits, its new
        tokens, and the release of blocks that held rejected drafts."""
        seq = item.seq
        samples = item.samples                       # read before the count moves
        seq.num_computed_tokens += item.num_tokens
        tokens = self.speculative.verify(seq, draft, rows, generator) if draft else sampled
        if self.scheduler.kv_cache:
            self.blocks.commit(seq, seq.num_computed_tokens)   # verified tokens only
        if not samples:
            self.progress(seq, "prefill", seq.num_computed_tokens)
            return
        if tokens is None:
            raise SamplingFailed("the model's output has no usable distribution to sample from "
                                 "(non-finite logits)")
        for token in tokens:
            if seq.finished:
                break
            self._append(seq, token, now)
        if rollback and not seq.finished:
            self.blocks.truncate(seq, len(seq.token_ids))

    def progress(self, seq: Sequence, phase: str, computed: int) -> None:
        seq.sink.put(ProgressEvent(phase, min(computed, seq.num_prompt_tokens), seq.num_prompt_tokens,
                                   seq.num_cached_prompt_tokens or 0, time.perf_counter()))

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        first = seq.t_first_token is None
        seq.token_ids.append(token)
        seq.token_times.append(now)
        if first:
            seq.t_first_token = now
            self.progress(seq, "decode", seq.num_prompt_tokens)
        params = seq.params
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.token_ids.pop()                      # EOS ends the output; it is not part of it
            seq.token_times.pop()
            self.finish(seq, "stop")
            return
        out = self._text[seq.request_id]
        text = out.add(token)
        reason = None
        if out.stopped:
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason:
            text += out.finish()                     # the last token carries any held-back text
        seq.sink.put(TokenEvent(token, text, now, seq.num_output_tokens - 1))
        if reason:
            self.finish(seq, reason)
