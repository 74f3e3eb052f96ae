"""The engine's settings in force and how they change at run time: by the user (Engine.update)
or by the engine itself when a decode step measures that an optimization does not pay here
(payoff.py). Either way the parts that run them are reconfigured, and what the user should know
becomes a notice, handed out once."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from .block_manager import BlockManager
from .config import EngineConfig
from .disaggregation.coordinator import Disaggregation
from .errors import InvalidRequest
from .model_runner import ModelRunner
from .precision import WeightPrecision
from .scheduler import Scheduler
from .settings import RUNTIME as RUNTIME_SETTINGS
from .speculative import SpeculativeDecoder


class RuntimeSettings:
    def __init__(self, config: EngineConfig, notices: list[str], scheduler: Scheduler,
                 blocks: BlockManager, speculative: SpeculativeDecoder, precision: WeightPrecision,
                 runner: ModelRunner, disagg: Disaggregation):
        self.config = config
        self.notices = notices              # things a UI should tell the user once (take_notices)
        self._notices_taken = 0
        self.scheduler, self.blocks = scheduler, blocks
        self.speculative, self.precision, self.runner = speculative, precision, runner
        self.disagg = disagg                # applied by the engine once its loop runs, then on each update
        self._set_quant(config.quant)
        self._set_spec(config.spec)
        speculative.weigh(not config.spec_always)
        self._set_graphs()
        runner.prepare_graphs()             # at start, so the first reply does not wait for captures

    def take_notices(self) -> list[str]:
        """The notices not taken yet, each once."""
        taken = self.notices[self._notices_taken:]
        self._notices_taken += len(taken)
        return taken

    def update(self, changes: dict[str, Any]) -> None:
        """Apply runtime settings (RUNTIME_SETTINGS) from the next step; the caller holds the
        step loop's lock."""
        unknown = set(changes) - set(RUNTIME_SETTINGS)
        if unknown:
            raise InvalidRequest(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
        self.config = cfg = replace(self.config, **changes)     # validates
        self.scheduler.kv_cache = cfg.kv_cache
        self.scheduler.chunk_size = cfg.chunk_size
        self.scheduler.step_budget = cfg.step_budget
        self.scheduler.max_num_seqs = cfg.max_num_seqs
        if "spec_tokens" in changes:
            self.speculative.set_tokens(cfg.spec_tokens)
        if "spec_always" in changes:
            self.speculative.weigh(not cfg.spec_always)
        if "quant" in changes:
            self._set_quant(cfg.quant)
            # K/V computed with other weights must not be reused as a prefix.
            self.blocks.set_prefix_cache(False)
            if self.config.spec == "draft" and "spec" not in changes:
                self._recheck_draft()
        if "spec" in changes:
            self._set_spec(cfg.spec)
        if changes.keys() & {"cuda_graphs", "max_num_seqs"}:
            self._set_graphs()              # captured again at the next decode step
        if changes.keys() & {"prefix_cache", "kv_cache", "quant"}:
            self.blocks.set_prefix_cache(cfg.prefix_cache and cfg.kv_cache)
        self.disagg.apply(self.config)      # start/stop the prefill worker, pass weights and link on

    def weigh(self, requests: int, drafted: bool, made: int, seconds: float) -> None:
        """What a decode-only step says of the optimizations in force (payoff.py): speculation
        that does not pay here stops, quantized weights that are no faster here are explained."""
        reason = self.speculative.measured(requests, drafted, made, seconds)
        if reason is not None:
            self.notices.append(f"speculative decoding turned off: {reason}")
            self._set_spec("off")
        if not drafted:
            said = self.precision.measured(requests, seconds)
            if said is not None:
                self.notices.append(said)

    def _set_graphs(self) -> None:
        self.runner.max_batch = self.config.max_num_seqs
        if self.runner.graphs is not None:
            self.runner.graphs.set_enabled(self.config.cuda_graphs)

    def _set_quant(self, mode: str) -> None:
        self.config = replace(self.config, quant=self.precision.set(mode, self.notices))

    def _recheck_draft(self) -> None:
        """The weights changed under a running draft: a self-draft that no longer fits them stops,
        with a notice, rather than failing the change."""
        try:
            self._set_spec("draft")
        except InvalidRequest as e:
            self.notices.append(f"speculative decoding turned off: {e}")
            self._set_spec("off")

    def _set_spec(self, mode: str) -> None:
        self.speculative.set_mode(mode, self.blocks, self.runner)
        self.config = replace(self.config, spec=mode)
