"""The Engine: loads a model, owns the KV pool, and runs the step loop on a background thread.

submit() is thread-safe and returns a RequestStream at once; the loop admits, schedules, runs one
mixed forward per step, samples, detokenizes and publishes events. All scheduler and block
state is touched by the loop thread only; other threads talk to it through an inbox.
"""
from __future__ import annotations

import atexit
import itertools
import queue
import sys
import threading
import time
import traceback
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, Iterable

import torch

from pdchat import kernels
from pdchat.kernels.cpu import KernelsUnavailable

from . import quant
from .block_manager import BlockManager
from .config import EngineConfig, SamplingParams
from .detokenizer import IncrementalDetokenizer, TextOutput
from .errors import ContextTooLong, EngineClosed, EngineError, InvalidRequest, KVCacheTooSmall, SamplingFailed
from .loader import load, pick_device, pick_dtype
from .memory import release_freed_memory
from .metrics import EngineStats, RequestMetrics
from .model_runner import ModelRunner, Work
from .model_source import resolve
from .paths import cache_dir
from .prompt import Prompt, encode_prompt
from .sampler import NO_TOKEN, sample
from .scheduler import ScheduledSeq, Scheduler, StepPlan
from .sequence import Sequence, Status
from .spec import AdaptiveK, Draft, DraftProposer, NgramProposer, verify
from .stream import Completion, FinishEvent, ProgressEvent, RequestStream, TokenEvent
from .telemetry import achieved_bandwidth, peak_bandwidth

CPU_KV_MB = 512
# Default prefill chunk sizes. CPU: the largest size whose worst stall of a running stream stays
# within 5x its TPOT in `pdchat bench toggles` (2026-11-22, 2-core EPYC: 32 -> 3.7x, 64 -> 6.0x).
# GPU: a common serving default, not yet measured here (no GPU was at hand).
CPU_CHUNK = 32
GPU_CHUNK = 512


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, say: Callable[[str], None] = _stderr,
                 **overrides: Any):
        cfg = replace(config or EngineConfig(), **overrides)
        self.device = pick_device(cfg.device)
        cfg = replace(cfg, chunk_size=self._chunk(cfg.chunk_size))
        self.config = cfg
        self.dtype = pick_dtype(cfg.dtype, self.device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.notices: list[str] = []             # things a UI should tell the user once
        self.ops = self._kernels(cfg.kernels)
        self.files = resolve(cfg.model, say)
        say(f"loading {cfg.model} on {self.device} ({str(self.dtype).removeprefix('torch.')})…")
        self.loaded = load(self.files, self.device, self.dtype, seed=cfg.seed, ops=self.ops)
        self.tokenizer = self.loaded.tokenizer
        mc = self.loaded.config
        self.model_config = mc
        self.max_model_len = min(cfg.max_model_len or mc.max_position, mc.max_position)
        self.kv_bytes_per_token = mc.kv_bytes_per_token(self.dtype)
        self.proposer = None
        self.adaptive = AdaptiveK(cfg.spec_tokens)
        self._draft_runner: ModelRunner | None = None
        self._draft = self._load_draft(cfg.draft_model, say) if cfg.spec == "draft" else None
        num_blocks = self._pool_blocks()
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.prefix_cache)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=cfg.max_num_seqs, chunk_size=cfg.chunk_size,
                                   kv_cache=cfg.kv_cache)
        self.runner = ModelRunner(self.loaded.model, mc, self.device, self.dtype, num_blocks, cfg.block_size)
        self._set_quant(cfg.quant)
        self._set_spec(cfg.spec)
        self.monitor = None
        if cfg.telemetry:
            from .telemetry import DeviceMonitor
            self.monitor = DeviceMonitor(self.device)
            self.monitor.start()
        self._seqs: dict[str, Sequence] = {}
        self._outputs: dict[str, TextOutput] = {}
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.RLock()           # one step, or one toggle change, at a time
        self._closed = False
        self._last_step = (None, 0, 0)           # (ms, prefill tokens, decode tokens)
        self._bandwidth: float | None = None     # bytes/s implied by the last decode-only step
        self._generator = torch.Generator(device=self.device).manual_seed(torch.seed() % 2**63)
        self._thread = threading.Thread(target=self._loop, name="pdchat-engine", daemon=True)
        self._thread.start()
        # A script that never closes the engine would otherwise exit with the step thread still
        # inside torch, which aborts the process ("terminate called without an active exception").
        atexit.register(self.close)

    # ---- sizing ---------------------------------------------------------------------------
    def _chunk(self, chunk_size: int | None | str) -> int | None:
        if chunk_size == "auto":
            return GPU_CHUNK if self.device.type == "cuda" else CPU_CHUNK
        return chunk_size

    def _pool_blocks(self) -> int:
        cfg = self.config
        per_block = (self.kv_bytes_per_token + self._draft_kv_bytes_per_token()) * cfg.block_size
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_mb is not None:
            budget = int(cfg.kv_cache_mb * 2**20)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cfg.gpu_memory_fraction)
        else:
            budget = CPU_KV_MB * 2**20
        useful = cfg.max_num_seqs * (-(-self.max_model_len // cfg.block_size))   # more is never used
        blocks = min(budget // per_block, useful)
        if blocks < 1:
            raise KVCacheTooSmall(f"a KV budget of {budget / 2**20:.1f} MB holds no block of "
                                  f"{per_block / 2**20:.2f} MB")
        return int(blocks)

    def _kernels(self, name: str) -> SimpleNamespace:
        """The kernel backend; an automatic choice that cannot be built falls back to PyTorch's ops
        with a notice, an explicit one is an error."""
        try:
            chosen = kernels.choose(name, self.device.type, self.dtype == torch.float32)
            return kernels.load(chosen, cache_dir())
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        except (ImportError, KernelsUnavailable) as e:
            if name != "auto":
                raise InvalidRequest(f"{chosen} kernels unavailable: {e}") from None
            self.notices.append(f"{chosen} kernels unavailable ({e}); running PyTorch's ops")
            return kernels.load("torch")

    # ---- quantization ---------------------------------------------------------------------
    def _prepare_int8(self) -> bool:
        """Make the int8 weight copies (from the cache when possible); False if unsupported here."""
        if not self.ops.int8_supported(self.device):
            return False
        model = self.loaded.model
        cache = quant.cache_file(self.files)
        if cache is None or not cache.is_file() or not quant.load(model, cache):
            quant.prepare(model)
            if cache is not None:
                quant.save(model, cache)
        return True

    def _set_quant(self, mode: str) -> None:
        if mode == "int8" and not self._prepare_int8():
            self.notices.append(f"int8 weights are not supported on {self.device} by this torch build; "
                                f"running {str(self.dtype).removeprefix('torch.')}")
            mode = "none"
        self.loaded.quant.int8 = mode == "int8"
        self._weight_read_bytes = quant.decode_read_bytes(self.loaded.model, self.loaded.quant)
        self.config = replace(self.config, quant=mode)

    # ---- speculative decoding -------------------------------------------------------------
    def _load_draft(self, spec: str | None, say: Callable[[str], None]):
        if spec in (None, "self"):
            return None                            # self-draft: the target's own int8 weights
        draft = load(resolve(spec, say), self.device, self.dtype, seed=self.config.seed, ops=self.ops)
        if draft.tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise InvalidRequest(f"draft model {spec!r} has a different tokenizer from {self.config.model!r}")
        return draft

    def _draft_kv_bytes_per_token(self) -> int:
        if self.config.spec != "draft":
            return 0
        cfg = self._draft.config if self._draft is not None else self.model_config
        return cfg.kv_bytes_per_token(self.dtype)

    def _set_spec(self, mode: str) -> None:
        self.proposer = None
        if mode == "ngram":
            self.proposer = NgramProposer()
        elif mode == "draft":
            if self._draft is None and not self._prepare_int8():
                raise InvalidRequest(f"self-draft needs int8 weights, which this torch build lacks on "
                                     f"{self.device}; pass --draft-model")
            if self._draft_runner is None:
                loaded = self._draft or self.loaded
                try:
                    self._draft_runner = ModelRunner(loaded.model, loaded.config, self.device, self.dtype,
                                                     self.blocks.num_blocks, self.blocks.block_size)
                except torch.OutOfMemoryError:
                    # The pool was sized without a draft; at start-up it is sized for both.
                    raise InvalidRequest("not enough memory for the draft's KV cache now; "
                                         "start with --spec draft instead") from None
            if self._draft is None:
                self.proposer = DraftProposer("self-draft", self._draft_runner, int8_switch=self.loaded.quant)
            else:
                self.proposer = DraftProposer(f"draft:{self.config.draft_model}", self._draft_runner)
        self.config = replace(self.config, spec=mode)

    # ---- requests -------------------------------------------------------------------------
    def encode(self, prompt: Prompt, system: str | None = None) -> list[int]:
        """Token ids for a prompt: text (as one user turn), chat messages, or ids as they are."""
        return encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt, system)

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, system: str | None = None,
               namespace: Any = None) -> RequestStream:
        """Queue a request; returns its stream at once. Raises InvalidRequest / ContextTooLong."""
        self._check_open()
        params = params or SamplingParams()
        ids = self.encode(prompt, system)
        if len(ids) >= self.max_model_len:
            raise ContextTooLong(len(ids), self.max_model_len)
        if self.blocks.blocks_for(len(ids) + 1) > self.blocks.num_blocks:
            raise KVCacheTooSmall(
                f"prompt of {len(ids)} tokens needs more than the whole KV pool "
                f"({self.blocks.num_blocks * self.blocks.block_size} tokens); raise --kv-cache-mb")
        rid = f"req-{next(self._ids)}"
        stream = RequestStream(rid, self._request_cancel)
        seq = Sequence(rid, ids, params, namespace=namespace, sink=stream)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        stream.put(ProgressEvent("queued", 0, len(ids), 0, seq.t_submit))
        self._inbox.put(("add", seq))
        self._wake.set()
        return stream

    def generate(self, prompts: Iterable[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 *, system: str | None = None) -> list[Completion]:
        """Run prompts together (continuous batching inside); completions in input order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        streams = [self.submit(p, sp, system=system) for p, sp in zip(prompts, plist)]
        return [s.result() for s in streams]

    def _request_cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits at every position of token_ids ([len, vocab]), through the paged path.

        For scoring (perplexity) and for checking against a reference implementation.
        """
        self._check_open()
        with self._lock:
            seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=1))
            if not self.blocks.ensure_capacity(seq, len(token_ids)):
                raise KVCacheTooSmall(f"{len(token_ids)} tokens do not fit the free KV blocks now")
            try:
                return self.runner.forward([Work.of(seq, len(token_ids))], [list(range(len(token_ids)))])
            finally:
                self.blocks.free_seq(seq)

    # ---- toggles & stats ------------------------------------------------------------------
    def update(self, **changes: Any) -> None:
        """Runtime settings: prefix_cache, kv_cache, chunk_size, max_num_seqs, quant, spec,
        spec_tokens. Apply to new steps."""
        self._check_open()
        with self._lock:
            unknown = set(changes) - {"prefix_cache", "kv_cache", "chunk_size", "max_num_seqs", "quant",
                                      "spec", "spec_tokens"}
            if unknown:
                raise InvalidRequest(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
            if "chunk_size" in changes:
                changes["chunk_size"] = self._chunk(changes["chunk_size"])
            self.config = replace(self.config, **changes)     # validates
            if "prefix_cache" in changes:
                self.blocks.set_prefix_cache(changes["prefix_cache"] and self.config.kv_cache)
            if "kv_cache" in changes:
                self.scheduler.kv_cache = changes["kv_cache"]
                self.blocks.set_prefix_cache(self.config.prefix_cache and changes["kv_cache"])
            if "chunk_size" in changes:
                self.scheduler.chunk_size = changes["chunk_size"]
            if "max_num_seqs" in changes:
                self.scheduler.max_num_seqs = changes["max_num_seqs"]
            if "spec_tokens" in changes:
                self.adaptive = AdaptiveK(changes["spec_tokens"])
            if "spec" in changes:
                self._set_spec(changes["spec"])
            if "quant" in changes:
                self._set_quant(changes["quant"])
                # K/V computed with other weights must not be reused as a prefix.
                self.blocks.set_prefix_cache(False)
                self.blocks.set_prefix_cache(self.config.prefix_cache and self.config.kv_cache)

    def stats(self) -> EngineStats:
        b = self.blocks
        ms, pre, dec = self._last_step
        bpt, bs = self.kv_bytes_per_token, b.block_size
        st = EngineStats(
            model=self.config.model, kv_block_size=bs, kv_blocks_total=b.num_blocks, kv_blocks_used=b.num_used,
            kv_blocks_cached=b.num_cached_free, kv_bytes_per_token=bpt, kv_bytes_used=b.num_used * bs * bpt,
            kv_bytes_total=b.num_blocks * bs * bpt, running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting), step_ms=ms, step_prefill_tokens=pre, step_decode_tokens=dec,
            prefix_hit_rate=b.hit_rate, device=str(self.device),
            weight_bytes=self._weight_read_bytes, quant=self.config.quant, kernels=self.ops.name,
            prefix_cache=self.config.prefix_cache, kv_cache=self.config.kv_cache,
            chunk_size=self.config.chunk_size, max_num_seqs=self.config.max_num_seqs,
            spec=self.config.spec, spec_tokens=self.config.spec_tokens,
            achieved_bandwidth=self._bandwidth,
        )
        if self.monitor is not None:
            snap = self.monitor.snapshot()
            for name in ("device_name", "device_util_pct", "device_mem_used", "device_mem_total",
                         "device_power_w", "cpu_util_pct", "rss_bytes"):
                setattr(st, name, getattr(snap, name))
            st.peak_bandwidth = peak_bandwidth(snap.device_name) if self.device.type == "cuda" else None
        return st

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("the engine is shut down")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._wake.set()
        self._thread.join(timeout=30)
        if self.monitor is not None:
            self.monitor.stop()
        # Weights and the KV pool are nearly all of the engine's memory: let them go even while a
        # caller still holds this object, and return the pages (a model switch must not keep both).
        self.loaded = self.runner = self._draft = self._draft_runner = self.proposer = None
        release_freed_memory(self.device)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- the loop -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._drain_inbox()
            if self._closed:
                for seq in list(self._seqs.values()):
                    self._finish(seq, "cancelled", EngineClosed("engine shut down"))
                return
            if not self.scheduler.has_work:
                self._wake.wait()
                self._wake.clear()
                continue
            with self._lock:
                try:
                    self.step()
                except Exception as e:   # a failed step must not kill the engine
                    self._fail(list(self.scheduler.running), e)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._seqs[arg.request_id] = arg
                self._outputs[arg.request_id] = TextOutput(
                    IncrementalDetokenizer(self.tokenizer, arg.prompt_ids), arg.params.stop)
                self.scheduler.add(arg)
            elif kind == "cancel" and arg in self._seqs:
                self._finish(self._seqs[arg], "cancelled")

    def step(self) -> StepPlan:
        """One scheduling step and one forward: schedule -> run -> postprocess. Runs on the loop
        thread. A fault in one request's sampling, detokenizing or stop handling ends that request
        alone; the forward itself failing ends the requests that took part in it."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        for seq in plan.failed:
            self._finish(seq, "error", KVCacheTooSmall(
                f"the KV pool ({self.blocks.num_blocks * self.blocks.block_size} tokens) cannot hold "
                f"this request; raise --kv-cache-mb"))
        if not plan.items:
            return plan
        try:
            logits, starts, drafts, candidates = self._run(plan)
        except Exception as e:
            self._fail([item.seq for item in plan.items], e)
            return plan
        sampled = self._sample(plan, logits, starts, drafts)
        now = time.perf_counter()
        decode_tokens = plan.num_decode_tokens
        for idx, item in enumerate(plan.items):
            draft = drafts.get(idx)
            decode_tokens += len(draft.tokens) if draft else 0
            try:
                rows = logits[starts[idx]:starts[idx + 1]] if draft else None    # a verify's rows only
                self._postprocess(item, draft, rows, sampled.get(idx), now, rollback=idx in candidates)
            except Exception as e:
                self._fail([item.seq], e)
        step_s = time.perf_counter() - t0
        self._last_step = (step_s * 1000, plan.num_prefill_tokens, decode_tokens)
        if not plan.num_prefill_tokens:    # decode-only: memory traffic = weights + the K/V attended over
            kv_read = sum(len(i.seq.token_ids) for i in plan.items) * self.kv_bytes_per_token
            self._bandwidth = achieved_bandwidth(self._weight_read_bytes, kv_read, 1 / step_s)
        return plan

    def _run(self, plan: StepPlan) -> tuple[torch.Tensor, list[int], dict[int, Draft], list[int]]:
        """Drafts (if speculating) and the one forward of the step: logits of the rows that sample,
        with each item's first row in `starts`."""
        for item in plan.items:
            seq = item.seq
            if seq.t_first_token is None and seq.num_computed_tokens == (seq.num_cached_prompt_tokens or 0):
                self._progress(seq, "prefill", seq.num_computed_tokens)
        drafts, candidates = self._propose(plan.items)
        work, rows = [], []
        for idx, item in enumerate(plan.items):
            w = Work.of(item.seq, item.num_tokens)
            if idx in drafts:                      # verify: the last token plus k draft tokens
                w.tokens = w.tokens + drafts[idx].tokens
                rows.append(list(range(len(w.tokens))))
            else:
                rows.append([item.num_tokens - 1] if item.samples else [])
            work.append(w)
        logits = self.runner.forward(work, rows)
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + len(r))
        return logits, starts, drafts, candidates

    def _sample(self, plan: StepPlan, logits: torch.Tensor, starts: list[int],
                drafts: dict[int, Draft]) -> dict[int, list[int]]:
        """One token for each item that samples without a draft; NO_TOKEN rows are left out
        (their request then fails alone)."""
        plain = [idx for idx, item in enumerate(plan.items) if item.samples and idx not in drafts]
        if not plain:
            return {}
        seqs = [plan.items[i].seq for i in plain]
        tokens = sample(logits[[starts[i] for i in plain]], [s.params for s in seqs],
                        [s.generator or self._generator for s in seqs]).tolist()
        return {idx: [t] for idx, t in zip(plain, tokens) if t != NO_TOKEN}

    def _verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor) -> list[int]:
        tokens, accepted = verify(logits, draft, seq, seq.generator or self._generator)
        seq.num_computed_tokens += accepted          # accepted drafts' K/V are now valid
        seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)
        seq.spec_method = self.proposer.name
        seq.spec_drafted += len(draft.tokens)
        seq.spec_accepted += accepted
        seq.spec_steps += 1
        self.adaptive.update(seq, len(draft.tokens), accepted)
        return tokens

    def _postprocess(self, item: ScheduledSeq, draft: Draft | None, logits: torch.Tensor | None,
                     sampled: list[int] | None, now: float, rollback: bool) -> None:
        """After the forward, for one item: its computed count, the verify of its draft, block
        commits, its new tokens, and the release of blocks that held rejected drafts."""
        seq = item.seq
        samples = item.samples                       # read before the count moves
        seq.num_computed_tokens += item.num_tokens
        tokens = self._verify(seq, draft, logits) if draft else sampled
        if self.scheduler.kv_cache:
            self.blocks.commit(seq, seq.num_computed_tokens)   # verified tokens only
        if not samples:
            self._progress(seq, "prefill", seq.num_computed_tokens)
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

    def _propose(self, items: list) -> tuple[dict[int, Draft], list[int]]:
        """Draft tokens for running decodes (speculative decoding), with blocks reserved for them."""
        if self.proposer is None or not self.scheduler.kv_cache:
            return {}, []
        candidates, ks = [], []
        for idx, item in enumerate(items):
            seq = item.seq
            if item.num_tokens != 1 or not item.samples or seq.t_first_token is None:
                continue
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids)) - 1
            k = min(self.adaptive.next_k(seq), room)
            if k > 0 and self.blocks.ensure_capacity(seq, len(seq.token_ids) + k):
                candidates.append(idx)
                ks.append(k)
        if not candidates:
            return {}, []
        drafts = self.proposer.propose([items[i].seq for i in candidates], ks)
        return {i: d for i, d in zip(candidates, drafts) if d.tokens}, candidates

    def _progress(self, seq: Sequence, phase: str, computed: int) -> None:
        seq.sink.put(ProgressEvent(phase, min(computed, seq.num_prompt_tokens), seq.num_prompt_tokens,
                                   seq.num_cached_prompt_tokens or 0, time.perf_counter()))

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        first = seq.t_first_token is None
        seq.token_ids.append(token)
        seq.token_times.append(now)
        if first:
            seq.t_first_token = now
            self._progress(seq, "decode", seq.num_prompt_tokens)
        params = seq.params
        if token in self.loaded.eos_token_ids and not params.ignore_eos:
            seq.token_ids.pop()                      # EOS ends the output; it is not part of it
            seq.token_times.pop()
            self._finish(seq, "stop")
            return
        out = self._outputs[seq.request_id]
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
            self._finish(seq, reason)

    def _fail(self, seqs: list[Sequence], e: Exception) -> None:
        """End these requests with finish_reason "error"; an engine bug is also printed in full."""
        if not isinstance(e, EngineError):
            traceback.print_exc(file=sys.stderr)
        for seq in seqs:
            self._finish(seq, "error", e)

    def _finish(self, seq: Sequence, reason: str, error: Exception | None = None) -> None:
        if seq.finished:
            return
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)
        out = self._outputs.pop(seq.request_id)
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
