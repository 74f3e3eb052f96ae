"""The engine's side of disaggregated serving: it starts and stops the prefill worker, routes new
prompts to it, takes the K/V it hands back into the engine's own pool, and says how both sides are
doing (EngineStats). Everything here runs on the engine's loop thread, or under its lock (update):
the worker's own thread only posts what arrives (worker_process.py).

A request at the worker is not in the scheduler; once its K/V are in the pool it joins the running
batch with every prompt token but the last computed, so its next decode step samples its first
token. If the worker fails or is turned off, the prompts it held are prefilled here as before: no
request is lost.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..block_manager import BlockManager
from ..config import EngineConfig
from ..errors import EngineError
from ..model_runner import ModelRunner
from ..scheduler import Scheduler
from ..sequence import Sequence
from ..stream import ProgressEvent
from .cores import DecodeCores, split_cores
from .arrivals import Arrivals
from .link import KvReceiver, SimulatedLink
from .prefill_worker import log_file
from .worker_process import WorkerProcess

# How long `pdchat run --disaggregate` or a benchmark waits for the worker to load the model.
READY_TIMEOUT_S = 600


class Disaggregation:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, scheduler: Scheduler, kv_bytes_per_token: int,
                 fail: Callable[[list[Sequence], Exception], None], post: Callable[[str, Any], None],
                 notices: list[str]):
        self.runner, self.blocks, self.scheduler = runner, blocks, scheduler
        self.kv_bytes_per_token = kv_bytes_per_token
        self._fail, self._post, self.notices = fail, post, notices
        self.state = "off"                          # off | starting | ready | failed: why
        self.link = SimulatedLink()
        self.kind = "shm"
        self.cores: tuple[list[int], list[int]] = ([], [])
        self.at_worker: dict[str, Sequence] = {}    # sent, K/V not back yet (in order)
        self.arrived = Arrivals(runner, blocks, scheduler)     # K/V here, on their way into the pool
        self.transfers = 0
        self.transfer_bytes = 0
        self.last_transfer_ms: float | None = None
        self.last_transfer_bytes: int | None = None
        self.worker: WorkerProcess | None = None
        self.decode_side = DecodeCores()            # this process's cores and threads while disaggregated
        self._threads: int | None = None
        self._settings: tuple[str, bool] | None = None
        self.ready = threading.Event()

    # ---- settings -------------------------------------------------------------------------
    def apply(self, cfg: EngineConfig) -> None:
        """The settings in force (at start and after each update): start or stop the worker, pass
        weight precision and prefix caching on to it, and set the simulated link."""
        self.link.gbps, self.link.latency_ms = cfg.kv_link_gbps, cfg.kv_link_ms
        if cfg.disaggregate and self.state == "off":
            self.start(cfg)
        elif not cfg.disaggregate and self.state != "off":
            self.stop()
        if self.worker is not None and self._settings != (cfg.quant, cfg.prefix_cache):
            self._settings = (cfg.quant, cfg.prefix_cache)
            self._send(("settings", cfg.quant, cfg.prefix_cache))

    def start(self, cfg: EngineConfig) -> None:
        """Start the worker (it loads the model in the background; prompts are prefilled here
        until it says it is ready)."""
        self.kind, self._threads = cfg.kv_link, cfg.threads
        self.cores = split_cores(cfg.prefill_cores)
        staging = min(self.runner.max_model_len, self.blocks.num_blocks * self.blocks.block_size) * self.kv_bytes_per_token
        self._settings = (cfg.quant, cfg.prefix_cache)
        self.state = "starting"
        self.ready.clear()
        receiver = KvReceiver(cfg.kv_link, self.link, staging)
        self.worker = WorkerProcess(receiver, self._post)
        try:
            self.worker.start(cfg, self.cores[0])
        except OSError as e:                      # no interpreter to start: the staging file must go too
            receiver.close()
            self.worker = None
            self._lost(f"it could not be started: {e}")

    def stop(self) -> list[Sequence]:
        """Stop the worker; the prompts it held are prefilled here (the scheduler takes them)."""
        if self.state == "off":
            return []
        # A worker still loading reads no message before it is done: nothing to wait for.
        loading, self.state = self.state == "starting", "off"
        self.ready.set()                      # nobody waits for a worker that is gone
        if self.worker is not None:
            self.worker.stop(wait_s=0.0 if loading else 10.0)
            self.worker = None
        self.decode_side.unpin()
        return self._take_back()

    def _take_back(self) -> list[Sequence]:
        back = [s for s in self.at_worker.values() if not s.finished]
        self.at_worker.clear()
        self.arrived.clear()
        for seq in back:
            self.blocks.free_seq(seq)     # (the blocks of a hand-off half written into the pool)
            self.scheduler.add(seq)
        return back

    # ---- requests -------------------------------------------------------------------------
    def route(self, seq: Sequence) -> bool:
        """Send a new prompt to the worker; False: it is prefilled here (no ready worker, the KV
        cache off, or a one-token prompt with nothing to prefill)."""
        if self.state != "ready" or not self.scheduler.kv_cache or seq.num_prompt_tokens < 2:
            return False
        self.at_worker[seq.request_id] = seq
        self._send(("prefill", seq.request_id, seq.prompt_ids, seq.namespace))
        return True

    def cancel(self, request_id: str) -> None:
        if self.at_worker.pop(request_id, None) is not None:
            self._send(("cancel", request_id))

    def take_arrivals(self) -> None:
        """At a step's start, on the step thread: its thread count for the cores it has, then the
        hand-offs into the pool (arrivals.py: in order, when there is room, a few layers a step
        while streams decode); a request whose K/V are all in joins the batch."""
        self.decode_side.apply()
        for seq, handoff in self.arrived.take(self.at_worker):
            del self.at_worker[seq.request_id]
            now = time.perf_counter()
            seq.num_computed_tokens = handoff.kv.shape[2]
            seq.t_prefilled, seq.t_kv_arrived, seq.kv_transfer_bytes = handoff.t_prefilled, now, handoff.nbytes
            self.blocks.record_lookup(seq.num_prompt_tokens, handoff.cached)
            self.transfers += 1
            self.transfer_bytes += handoff.nbytes
            self.last_transfer_ms = (now - handoff.t_prefilled) * 1000
            self.last_transfer_bytes = handoff.nbytes
            self.scheduler.add_running(seq)
            # The hand-off is over: what is left of the pause is this engine computing the last
            # prompt token (its next step), as the end of any prefill.
            cached = seq.num_cached_prompt_tokens or 0
            seq.sink.put(ProgressEvent("prefill", seq.num_computed_tokens, seq.num_prompt_tokens, cached, now))

    # ---- what the worker says (posted by the receiver, handled on the loop thread) ------------
    def on_message(self, said: tuple[WorkerProcess, tuple]) -> None:
        source, message = said
        if source is not self.worker:         # a worker stopped since (its last words, "lost")
            if message[0] == "handoff":
                message[1].release()
            return
        kind = message[0]
        seq = self.at_worker.get(message[1]) if len(message) > 1 and isinstance(message[1], str) else None
        if kind == "ready":
            self._ready(message[1])
        elif kind == "started" and seq is not None:
            _, rid, cached, t = message
            seq.t_first_scheduled = seq.t_first_scheduled or t
            seq.num_cached_prompt_tokens = cached
            seq.sink.put(ProgressEvent("prefill", cached, seq.num_prompt_tokens, cached, t))
        elif kind == "layer" and seq is not None:
            _, rid, done, layers, t = message
            cached = seq.num_cached_prompt_tokens or 0
            seq.sink.put(ProgressEvent("prefill", cached, seq.num_prompt_tokens, cached, t, layers_done=done,
                                       layers=layers, step_tokens=seq.num_prompt_tokens - 1 - cached))
        elif kind == "transfer" and seq is not None:
            _, rid, t = message
            seq.sink.put(ProgressEvent("transfer", seq.num_prompt_tokens - 1, seq.num_prompt_tokens,
                                       seq.num_cached_prompt_tokens or 0, t))
        elif kind == "handoff":
            self.arrived.add(message[1])          # written at the next step's start (a step's budget once)
        elif kind == "failed" and self.at_worker.pop(message[1], None) is not None:
            self._fail([seq], EngineError(message[2]))
        elif kind in ("fatal", "lost"):
            self._lost(message[1])

    def _ready(self, worker_notices: list[str]) -> None:
        if self.state != "starting":
            return
        try:
            self.worker.receiver.connect()
        except OSError as e:                      # (a socket link the worker never connected)
            self._lost(f"its K/V link did not connect: {e}")
            return
        self.state = "ready"
        self.notices.extend(f"prefill worker: {n}" for n in worker_notices)
        prefill, decode = self.cores
        self.decode_side.pin(decode, self._threads)
        self.notices.append(f"disaggregated: prompts are prefilled on {_cores(prefill)}, streams decode on "
                            f"{_cores(decode)}; K/V cross by {self.kind}")
        self.ready.set()

    def _lost(self, why: str) -> None:
        if self.state == "off" or self.state.startswith("failed"):   # stopping, or already said
            return
        self.state = f"failed: {why}"
        self.notices.append(f"the prefill worker stopped ({why}; its log: {log_file()}); "
                            f"prompts are prefilled in this process again")
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        self.decode_side.unpin()
        self._take_back()
        self.ready.set()

    def _send(self, message: tuple) -> None:
        if self.worker is not None:
            self.worker.send(message)

    # ---- what the panel shows ---------------------------------------------------------------
    def worker_state(self) -> str:
        """off, starting, "failed: why", or once ready: busy while any prompt sent to it is not
        back in the pool yet, else idle."""
        if self.state == "ready":
            return "busy" if self.at_worker else "idle"
        return self.state

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Block until the worker is ready or failed; True when it is ready."""
        self.ready.wait(timeout)
        return self.state == "ready"


def _cores(cores: list[int]) -> str:
    return ("core " if len(cores) == 1 else "cores ") + ", ".join(map(str, cores))
