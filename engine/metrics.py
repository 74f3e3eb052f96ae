"""Per-request metrics and the engine snapshot, under the stable names that the UI, `--json`
and the server's /metrics share.

A value that cannot be measured is None (JSON null, shown as "n/a"), never a made-up number.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .sequence import Sequence
from .telemetry import achieved_bandwidth, peak_bandwidth

if TYPE_CHECKING:                      # only for the annotation: engine.py imports this module
    from .engine import Engine
    from .scheduler import StepPlan


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (b - a) * 1000.0


@dataclass
class RequestMetrics:
    queue_ms: float | None = None
    ttft_ms: float | None = None
    prefill_ms: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_tok_s: float | None = None
    output_tokens: int = 0
    decode_ms: float | None = None
    tpot_ms: float | None = None
    decode_tok_s: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    spec_method: str | None = None
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0                  # verify forwards
    spec_acceptance: float | None = None  # accepted / drafted
    spec_mean_accepted: float | None = None   # accepted draft tokens per verify step
    preemptions: int = 0
    finish_reason: str | None = None
    # disaggregated (--disaggregate): the K/V the prefill worker handed over, and from the end of
    # its forward to the K/V in this engine's pool (null when the prompt was prefilled here)
    kv_transfer_bytes: int | None = None
    kv_transfer_ms: float | None = None

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        times = seq.token_times
        cached = seq.num_cached_prompt_tokens or 0
        prefill_ms = _ms(seq.t_first_scheduled, seq.t_first_token)
        computed = seq.num_prompt_tokens - cached
        decode_ms = _ms(times[0], times[-1]) if len(times) > 1 else None
        steps = len(times) - 1
        return cls(
            queue_ms=_ms(seq.t_submit, seq.t_first_scheduled),
            ttft_ms=_ms(seq.t_submit, seq.t_first_token),
            prefill_ms=prefill_ms,
            prompt_tokens=seq.num_prompt_tokens,
            cached_prompt_tokens=cached,
            prefill_tok_s=computed / (prefill_ms / 1000) if prefill_ms else None,
            output_tokens=seq.num_output_tokens,
            decode_ms=decode_ms,
            tpot_ms=decode_ms / steps if decode_ms is not None else None,
            decode_tok_s=steps / (decode_ms / 1000) if decode_ms else None,
            itl_ms=[(b - a) * 1000.0 for a, b in zip(times, times[1:])],
            spec_method=seq.spec_method,
            spec_drafted=seq.spec_drafted,
            spec_accepted=seq.spec_accepted,
            spec_steps=seq.spec_steps,
            spec_acceptance=seq.spec_accepted / seq.spec_drafted if seq.spec_drafted else None,
            spec_mean_accepted=seq.spec_accepted / seq.spec_steps if seq.spec_steps else None,
            preemptions=seq.preemptions,
            finish_reason=seq.finish_reason,
            kv_transfer_bytes=seq.kv_transfer_bytes,
            kv_transfer_ms=_ms(seq.t_prefilled, seq.t_kv_arrived),
        )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineStats:
    model: str = ""
    kv_block_size: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_bytes_per_token: int = 0
    kv_bytes_used: int = 0
    kv_bytes_total: int = 0
    running: int = 0
    waiting: int = 0
    step_ms: float | None = None
    step_prefill_tokens: int = 0
    sliced_step_planned_ms: float | None = None   # the last step sized by the time budget: predicted
    sliced_step_ms: float | None = None           # ... and measured
    step_decode_tokens: int = 0
    prefix_hit_rate: float | None = None
    device: str = "cpu"
    device_name: str | None = None
    device_util_pct: float | None = None
    device_mem_used: int | None = None
    device_mem_total: int | None = None
    device_power_w: float | None = None
    sm_clock_mhz: float | None = None
    cpu_util_pct: float | None = None         # the whole machine, % of all its logical CPUs
    process_cpu_pct: float | None = None      # this process (all threads), on the same scale
    rss_bytes: int | None = None
    weight_bytes: int = 0             # weight bytes one decode step reads (int8 when active)
    model_bytes: int = 0              # what the model holds in memory (int8 copies included)
    quant: str = "none"
    kernels: str = "torch"            # the kernel backend in use: torch | triton | cpu
    spec: str = "off"
    spec_tokens: int = 0
    achieved_bandwidth: float | None = None   # bytes/s: (weights + K/V read) x decode steps/s
    peak_bandwidth: float | None = None       # the device's datasheet peak, when known
    # toggles in force, so a UI can show them next to the numbers
    prefix_cache: bool = True
    kv_cache: bool = True
    chunk_size: int | str | None = None     # "auto": sized by the step budget
    step_budget: float = 0.0
    max_num_seqs: int = 0
    cuda_graphs: bool = True                 # the setting in force
    # what decode steps get: "on", "off", "failed: why", or why no graphs exist here
    graph_state: str = "off"
    graph_replays: int = 0                   # decode steps run from a graph so far
    graph_rows: int | None = None            # the last replay: the batch's rows ...
    graph_size: int | None = None            # ... in the graph of this size (the rest padding)
    # disaggregation (--disaggregate): the setting, the prefill worker's state (off, starting, idle,
    # busy, "failed: why"), the prompts sent to it and not back yet, each side's cores, the link and
    # its simulated bandwidth and latency, the hand-offs so far (count, bytes) and the last one's
    # bytes and time (RequestMetrics has each reply's as kv_transfer_bytes and kv_transfer_ms)
    disaggregate: bool = False
    prefill_worker: str = "off"
    prefill_queue: int = 0
    prefill_cores: str | None = None
    decode_cores: str | None = None
    kv_link: str = "shm"
    kv_link_gbps: float | None = None
    kv_link_ms: float = 0.0
    kv_transfers: int = 0
    kv_transferred_bytes: int = 0
    last_kv_transfer_bytes: int | None = None
    last_kv_transfer_ms: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def graphs_state(engine: "Engine", graphs: Any) -> str:
    if graphs is not None:
        return graphs.state
    if not engine.config.cuda_graphs:
        return "off"
    return "n/a on cpu" if engine.device.type != "cuda" else f"n/a with the {engine.ops.name} kernels"


class StepMeter:
    """The last step's time and tokens, and the memory bandwidth a decode-only step implies
    (every weight and the K/V attended over, read once)."""

    def __init__(self, kv_bytes_per_token: int):
        self.kv_bytes_per_token = kv_bytes_per_token
        self.step_ms: float | None = None
        # The last step a time budget sized: its predicted and its measured time.
        self.sliced_planned_ms: float | None = None
        self.sliced_ms: float | None = None
        self.prefill_tokens = 0
        self.decode_tokens = 0                 # draft tokens verified included
        self.bandwidth: float | None = None    # bytes/s, from the last decode-only step

    def record(self, plan: "StepPlan", draft_tokens: int, step_s: float, weight_read_bytes: int) -> None:
        self.step_ms = step_s * 1000
        self.prefill_tokens = plan.prompt_tokens
        self.decode_tokens = plan.num_decode_tokens + draft_tokens
        if plan.planned_s is not None:
            self.sliced_planned_ms, self.sliced_ms = plan.planned_s * 1000, self.step_ms
        if not plan.prompt_tokens:
            kv_read = sum(len(i.seq.token_ids) for i in plan.items) * self.kv_bytes_per_token
            self.bandwidth = achieved_bandwidth(weight_read_bytes, kv_read, 1 / step_s)


def collect_stats(engine: "Engine") -> EngineStats:
    """The engine's snapshot: pool, queues, last step, settings in force and device telemetry."""
    b, cfg, meter = engine.blocks, engine.config, engine.meter
    graphs = getattr(engine.runner, "graphs", None)      # the runner is gone once closed
    bpt, bs = engine.kv_bytes_per_token, b.block_size
    st = EngineStats(
        model=cfg.model, kv_block_size=bs, kv_blocks_total=b.num_blocks, kv_blocks_used=b.num_used,
        kv_blocks_cached=b.num_cached_free, kv_bytes_per_token=bpt, kv_bytes_used=b.num_used * bs * bpt,
        kv_bytes_total=b.num_blocks * bs * bpt, running=len(engine.scheduler.running),
        waiting=len(engine.scheduler.waiting), step_ms=meter.step_ms, step_prefill_tokens=meter.prefill_tokens,
        sliced_step_planned_ms=meter.sliced_planned_ms, sliced_step_ms=meter.sliced_ms,
        step_decode_tokens=meter.decode_tokens, prefix_hit_rate=b.hit_rate, device=str(engine.device),
        weight_bytes=engine.precision.read_bytes, model_bytes=engine.precision.resident_bytes,
        quant=cfg.quant, kernels=engine.ops.name,
        prefix_cache=cfg.prefix_cache, kv_cache=cfg.kv_cache, chunk_size=cfg.chunk_size, step_budget=cfg.step_budget,
        max_num_seqs=cfg.max_num_seqs, spec=cfg.spec, spec_tokens=cfg.spec_tokens,
        achieved_bandwidth=meter.bandwidth, cuda_graphs=cfg.cuda_graphs,
        graph_state=graphs_state(engine, graphs),
    )
    d = engine.disagg
    st.disaggregate, st.prefill_worker, st.prefill_queue = cfg.disaggregate, d.worker_state(), len(d.at_worker)
    st.kv_link, st.kv_link_gbps, st.kv_link_ms = cfg.kv_link, cfg.kv_link_gbps, cfg.kv_link_ms
    if d.state != "off":
        st.prefill_cores, st.decode_cores = (",".join(map(str, c)) for c in d.cores)
    st.kv_transfers, st.kv_transferred_bytes = d.transfers, d.transfer_bytes
    st.last_kv_transfer_bytes, st.last_kv_transfer_ms = d.last_transfer_bytes, d.last_transfer_ms
    if graphs is not None:
        st.graph_replays = graphs.replays
        st.graph_rows, st.graph_size = graphs.last or (None, None)
    if engine.monitor is not None:
        snap = engine.monitor.snapshot()
        for name in ("device_name", "device_util_pct", "device_mem_used", "device_mem_total",
                     "device_power_w", "sm_clock_mhz", "cpu_util_pct", "process_cpu_pct", "rss_bytes"):
            setattr(st, name, getattr(snap, name))
        st.peak_bandwidth = peak_bandwidth(snap.device_name) if engine.device.type == "cuda" else None
    return st
