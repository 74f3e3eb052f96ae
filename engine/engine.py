"""The Engine: the one object a caller holds. It wires the parts together and offers the request
API (submit, generate, prompt_logits), runtime settings (update), a snapshot (stats) and close.

One step, on the loop thread (step_loop.py): schedule (scheduler.py) -> propose draft tokens
(speculative.py) -> run the model once over every scheduled token (model_runner.py) -> sample
(sampler.py) -> post-process: append, verify, finish, emit events (output_processor.py).
Set-up choices (kernels, pool and chunk sizes) are in resources.py; the weights' precision at
run time in precision.py. With --disaggregate a new prompt goes to a prefill worker process
instead of the scheduler, and its K/V come back into the pool at a step's start (disaggregation/).
"""
from __future__ import annotations

import atexit
import itertools
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Iterable

import torch

from . import settings
from .block_manager import BlockManager
from .config import EngineConfig, SamplingParams
from .disaggregation.coordinator import Disaggregation
from .errors import ContextTooLong, EngineClosed, KVCacheTooSmall
from .loader import load, pick_device, pick_dtype
from .memory import release_freed_memory
from .metrics import EngineStats, StepMeter, collect_stats
from .model_runner import ModelRunner, StepLogits, Work
from .model_source import resolve
from .output_processor import OutputProcessor
from .precision import WeightPrecision, unsupported
from .runtime_settings import RuntimeSettings
from .prompt import Prompt, encode_prompt
from .resources import kernel_backend, kv_pool_blocks
from .sampler import NO_TOKEN, sample
from .scheduler import Scheduler, StepPlan
from .sequence import Sequence
from .spec import Draft
from .speculative import SpeculativeDecoder
from .step_cost import StepCost, pair_flops_ratio
from .step_loop import StepLoop
from .stream import Completion, ProgressEvent, RequestStream

# What update() may change while the engine runs (declared in settings.py); the rest is fixed.
RUNTIME_SETTINGS = settings.RUNTIME


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Engine:
    """The façade (see the module's docstring). It runs past 200 lines (about 240) because it is
    where the parts are wired (the constructor, the step thread's handlers), the public API's home
    and the step's outline; each part's logic is in its own module."""

    def __init__(self, config: EngineConfig | None = None, *, say: Callable[[str], None] = _stderr,
                 **overrides: Any):
        cfg = replace(config or EngineConfig(), **overrides)
        self.device = pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        notices: list[str] = []
        self.ops = kernel_backend(cfg.kernels, self.device, self.dtype, notices)
        self.files = resolve(cfg.model, say)
        say(f"loading {cfg.model} on {self.device} ({str(self.dtype).removeprefix('torch.')})…")
        # Quantized weights are made as the checkpoint is read (RuntimeSettings says why not, if not).
        quant_mode = cfg.quant if unsupported(cfg.quant, self.ops, self.device) is None else "none"
        self.loaded = load(self.files, self.device, self.dtype, seed=cfg.seed, ops=self.ops, quant_mode=quant_mode)
        self.tokenizer = self.loaded.tokenizer
        self.model_config = mc = self.loaded.config
        self.max_model_len = min(cfg.max_model_len or mc.max_position, mc.max_position)
        self.kv_bytes_per_token = mc.kv_bytes_per_token(self.dtype)
        self.precision = WeightPrecision(self.loaded, self.device, self.dtype)
        self.speculative = SpeculativeDecoder(
            self.loaded, self.precision, target_name=cfg.model, spec_tokens=cfg.spec_tokens,
            draft_model=cfg.draft_model, load_draft_now=cfg.spec == "draft", seed=cfg.seed, say=say)
        pool_bytes = self.kv_bytes_per_token + self.speculative.kv_bytes_per_token(cfg.spec)
        num_blocks = kv_pool_blocks(cfg, self.device, pool_bytes, self.max_model_len)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.prefix_cache)
        self.scheduler = Scheduler(self.blocks, StepCost(pair_flops_ratio(mc), self.ops.fast_rows),
                                   max_num_seqs=cfg.max_num_seqs, chunk_size=cfg.chunk_size,
                                   step_budget=cfg.step_budget, kv_cache=cfg.kv_cache)
        self.runner = ModelRunner(self.loaded.model, mc, self.device, self.dtype, num_blocks, cfg.block_size,
                                  self.max_model_len)
        if self.device.type == "cuda" and self.ops.name == "triton":
            graphs = self.runner.use_graphs(notices, reserve=self.blocks.ensure_capacity)
            self.scheduler.cost.fixed = graphs.mixed_step_extra
        # Prompts prefilled by a worker process (--disaggregate); started once the step loop runs.
        self.disagg = Disaggregation(self.runner, self.blocks, self.scheduler, self.kv_bytes_per_token,
                                     fail=lambda seqs, e: self.outputs.fail(seqs, e),
                                     post=lambda kind, arg: self.loop.post(kind, arg), notices=notices)
        self.settings = RuntimeSettings(cfg, notices, self.scheduler, self.blocks, self.speculative,
                                        self.precision, self.runner, self.disagg)
        # Layer-by-layer prefill reports on a CPU only: a GPU queues the layers in microseconds.
        self.outputs = OutputProcessor(self.tokenizer, self.loaded.eos_token_ids, self.max_model_len,
                                       self.scheduler, self.blocks, self.speculative,
                                       layers=mc.num_layers if self.device.type == "cpu" else 0)
        self.monitor = None
        if cfg.telemetry:
            from .telemetry import DeviceMonitor
            self.monitor = DeviceMonitor(self.device)
            self.monitor.start()
        self._ids = itertools.count()
        self._closed = False
        self.meter = StepMeter(self.kv_bytes_per_token)
        self._generator = torch.Generator(device=self.device).manual_seed(torch.seed() % 2**63)
        self.runner.warm_up()
        self._start(cfg)

    def _start(self, cfg: EngineConfig) -> None:
        """The step thread, then a prefill worker if asked for (its messages go to that thread)."""
        self.loop = StepLoop(step=self.step, has_work=lambda: self.scheduler.has_work or bool(self.disagg.arrived),
                             handlers={"add": self._admit, "cancel": self._cancel, "disagg": self.disagg.on_message},
                             on_step_error=lambda e: self.outputs.fail(list(self.scheduler.running), e),
                             on_stop=lambda: self.outputs.finish_all("cancelled", EngineClosed("engine shut down")))
        self.loop.start()
        self.disagg.apply(cfg)
        if cfg.disaggregate:
            self.disagg.wait_ready()          # (a worker that fails to start leaves a notice)
        # A script that never closes the engine would otherwise exit with the step thread still
        # inside torch, which aborts the process ("terminate called without an active exception").
        atexit.register(self.close)

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
        stream = RequestStream(rid, lambda request_id: self.loop.post("cancel", request_id))
        seq = Sequence(rid, ids, params, namespace=namespace, sink=stream)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        stream.put(ProgressEvent("queued", 0, len(ids), 0, seq.t_submit))
        self.loop.post("add", seq)
        return stream

    def _admit(self, seq: Sequence) -> None:
        """On the loop thread: a new request is tracked, then prefilled by the worker or here."""
        self.outputs.admit(seq)
        if not self.disagg.route(seq):
            self.scheduler.add(seq)

    def _cancel(self, request_id: str) -> None:
        self.disagg.cancel(request_id)
        self.outputs.cancel(request_id)

    def generate(self, prompts: Iterable[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 *, system: str | None = None) -> list[Completion]:
        """Run prompts together (continuous batching inside); completions in input order. They are
        posted while the loop is held, so it admits them in one go: posted one by one, the loop
        could start on the first before the others came, and a run's steps (and, in floating
        point, a row's logits) then depended on thread timing."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        with self.loop.lock:
            streams = [self.submit(p, sp, system=system) for p, sp in zip(prompts, plist)]
        return [s.result() for s in streams]

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits at every position of token_ids ([len, vocab]), through the paged path.

        For scoring (perplexity) and for checking against a reference implementation.
        """
        self._check_open()
        with self.loop.lock:
            seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=1))
            if not self.blocks.ensure_capacity(seq, len(token_ids)):
                raise KVCacheTooSmall(f"{len(token_ids)} tokens do not fit the free KV blocks now")
            try:
                return self.runner.forward([Work.of(seq, len(token_ids))], [list(range(len(token_ids)))])
            finally:
                self.blocks.free_seq(seq)

    @property
    def config(self) -> EngineConfig:
        """The settings in force (runtime_settings.py changes them)."""
        return self.settings.config

    @property
    def notices(self) -> list[str]:
        return self.settings.notices

    def take_notices(self) -> list[str]:
        """The notices not taken yet, each once: fallbacks at load, and settings the engine
        changed itself at run time (speculation that did not pay, a self-draft refused beside new
        weights), in words for the user."""
        return self.settings.take_notices()

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> StepPlan:
        """One step on the loop thread: schedule -> propose -> run -> sample -> post-process.
        A fault in one request's sampling, detokenizing or stop handling ends that request alone;
        the forward itself failing ends the requests that took part in it."""
        t0 = time.perf_counter()
        self.disagg.take_arrivals()                  # prompts the prefill worker handed over
        plan = self.scheduler.schedule()
        if plan.failed:
            self.outputs.fail(plan.failed, KVCacheTooSmall(
                f"the KV pool ({self.blocks.num_blocks * self.blocks.block_size} tokens) cannot hold "
                f"this request; raise --kv-cache-mb"))
        if not plan.items:
            return plan
        self.outputs.prefill_starting(plan)
        decoding = plan.decode_only              # a step whose time says how fast decoding is (payoff.py)
        probe = decoding and self.speculative.probe_now()     # plain decoding, to compare drafts with
        drafts, reserved = ({}, []) if probe or not self.scheduler.kv_cache else \
            self.speculative.propose(plan.items, self.blocks, self.max_model_len)
        try:
            out = self.runner.run_step(plan.items, {i: d.tokens for i, d in drafts.items()},
                                       self.outputs.layer_progress(plan))
        except Exception as e:
            self.outputs.fail([item.seq for item in plan.items], e)
            return plan
        counting = decoding and self.speculative.weighing
        made_before = sum(item.seq.num_output_tokens for item in plan.items) if counting else 0
        sampled = self._sample(plan, out, drafts)
        self.outputs.process(plan, out, drafts, reserved, sampled, self._generator)
        seconds = time.perf_counter() - t0
        self.meter.record(plan, sum(len(d.tokens) for d in drafts.values()), seconds, self.precision.read_bytes)
        self.scheduler.record(plan, seconds, drafted=bool(drafts), tile_seconds=out.tile_seconds)
        if decoding:
            made = sum(item.seq.num_output_tokens for item in plan.items) - made_before if counting else 0
            self.settings.weigh(len(plan.items), bool(drafts), made, seconds)
        return plan

    def _sample(self, plan: StepPlan, out: StepLogits, drafts: dict[int, Draft]) -> dict[int, list[int]]:
        """One token for each item that samples without a draft; NO_TOKEN rows are left out
        (their request then fails alone)."""
        plain = [idx for idx, item in enumerate(plan.items) if item.samples and idx not in drafts]
        if not plain:
            return {}
        seqs = [plan.items[i].seq for i in plain]
        tokens = sample(out.first_rows(plain), [s.params for s in seqs], [s.generator or self._generator for s in seqs],
                        argmax=out.greedy, greedy_rows=self.ops.greedy)
        # every row decodes again next, speculation off: the runner may queue that step first
        goes_on = plan.items if len(plain) == len(plan.items) and self.speculative.proposer is None else None
        tokens = self.runner.tokens_to_host(tokens, goes_on)
        return {idx: [t] for idx, t in zip(plain, tokens) if t != NO_TOKEN}

    # ---- runtime settings -----------------------------------------------------------------
    def update(self, **changes: Any) -> None:
        """Change runtime settings (RUNTIME_SETTINGS); they apply from the next step."""
        self._check_open()
        with self.loop.lock:
            self.settings.update(changes)

    # ---- snapshot and shutdown ------------------------------------------------------------
    def stats(self) -> EngineStats:
        return collect_stats(self)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("the engine is shut down")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.loop.stop(timeout=30)
        self.disagg.stop()
        if self.monitor is not None:
            self.monitor.stop()
        # Weights and the KV pool are nearly all of the engine's memory: let them go even while a
        # caller still holds this object, and return the pages (a model switch must not keep both).
        # The model goes before the KV pool: the other order left glibc a vocabulary-sized hole.
        self.speculative.close()
        self.precision.release()
        self.runner.close()
        self.loaded = self.runner = None
        release_freed_memory(self.device)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
