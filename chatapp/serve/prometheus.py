"""`GET /metrics`: Prometheus text with pdchat's stable metric names under the `pdchat:` prefix.

Per-request latencies are histograms (`pdchat:ttft_ms`, `pdchat:tpot_ms`, `pdchat:e2e_ms`,
`pdchat:queue_ms`, and with --disaggregate `pdchat:kv_transfer_ms`), token, byte and request totals
are counters, and the engine snapshot (EngineStats) is read at scrape time: every numeric field
becomes the gauge `pdchat:<field>` (booleans 0/1), the text fields (model, device, spec method,
prefill worker state, ...) the labels of `pdchat:engine_info`. A field the engine cannot measure
(None) is left out, never sent as 0. `pdchat:kv_usage` and `pdchat:spec_acceptance_rate` are the
two ratios dashboards want; `pdchat:prefill_worker_busy` (0/1, while a prefill worker exists) says
whether prompts sent to it are not back yet.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from pdchat.engine import EngineStats, RequestMetrics

PREFIX = "pdchat:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
TPOT_BUCKETS = (1, 2, 5, 10, 20, 40, 60, 80, 100, 150, 200, 300, 500, 1000, 2500)
E2E_BUCKETS = (10, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000, 300000)
KV_TRANSFER_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000)


class _Snapshot(Collector):
    """Engine snapshot gauges, read from Engine.stats() at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats], spec_totals: Callable[[], tuple[int, int]]):
        self._stats = stats
        self._spec_totals = spec_totals

    def collect(self) -> Iterator[Any]:
        st = self._stats()
        values = {f.name: getattr(st, f.name) for f in fields(st)}
        yield InfoMetricFamily(f"{PREFIX}engine", "the engine's model, device and settings",
                               value={k: v for k, v in values.items() if isinstance(v, str)})
        for name, value in values.items():
            if value is not None and not isinstance(value, str):
                yield GaugeMetricFamily(f"{PREFIX}{name}", f"engine snapshot: {name}", value=float(value))
        if st.kv_blocks_total:
            yield GaugeMetricFamily(f"{PREFIX}kv_usage", "KV blocks in use / KV blocks in the pool",
                                    value=st.kv_blocks_used / st.kv_blocks_total)
        if st.prefill_worker != "off":
            yield GaugeMetricFamily(f"{PREFIX}prefill_worker_busy", "1 while prompts sent to the prefill worker are not back",
                                    value=float(st.prefill_worker == "busy"))
        drafted, accepted = self._spec_totals()
        if drafted:
            yield GaugeMetricFamily(f"{PREFIX}spec_acceptance_rate",
                                    "accepted / drafted speculative tokens since start", value=accepted / drafted)


class ServerMetrics:
    """One registry per server (not the process-global one), so several can live in one process."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}ttft_ms", "time to first token (ms)", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}tpot_ms", "time per output token after the first (ms)",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_ms", "request latency, arrival to last token (ms)",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram(f"{PREFIX}queue_ms", "time waiting before the first step (ms)",
                               buckets=TTFT_BUCKETS, registry=r)
        self.kv_transfer = Histogram(f"{PREFIX}kv_transfer_ms", "a prompt prefilled by the worker process: its K/V's "
                                     "hand-off, end of the forward to the decode pool (ms)",
                                     buckets=KV_TRANSFER_BUCKETS, registry=r)
        self.kv_transfer_bytes = Counter(f"{PREFIX}kv_transfer_bytes", "K/V bytes handed over by the prefill worker",
                                         registry=r)
        self.requests = Counter(f"{PREFIX}requests", "finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter(f"{PREFIX}cached_prompt_tokens",
                                            "prompt tokens taken from the prefix cache", registry=r)
        self.output_tokens = Counter(f"{PREFIX}output_tokens", "generated tokens", registry=r)
        self.spec_drafted = Counter(f"{PREFIX}spec_drafted", "speculative tokens proposed", registry=r)
        self.spec_accepted = Counter(f"{PREFIX}spec_accepted", "speculative tokens accepted", registry=r)
        self.preemptions = Counter(f"{PREFIX}preemptions", "requests preempted (recomputed)", registry=r)
        self.rejected = Counter(f"{PREFIX}rejected_requests", "requests refused before reaching the engine",
                                ["status"], registry=r)
        self._spec = [0, 0]          # drafted, accepted: counters cannot be read back publicly
        r.register(_Snapshot(stats, lambda: (self._spec[0], self._spec[1])))

    def observe(self, m: RequestMetrics, e2e_ms: float) -> None:
        self.requests.labels(m.finish_reason or "error").inc()
        for hist, value in ((self.ttft, m.ttft_ms), (self.tpot, m.tpot_ms), (self.queue, m.queue_ms),
                            (self.kv_transfer, m.kv_transfer_ms)):
            if value is not None:
                hist.observe(value)
        if m.kv_transfer_bytes is not None:
            self.kv_transfer_bytes.inc(m.kv_transfer_bytes)
        if m.finish_reason in ("stop", "length"):
            self.e2e.observe(e2e_ms)
        self.prompt_tokens.inc(m.prompt_tokens)
        self.cached_prompt_tokens.inc(m.cached_prompt_tokens)
        self.output_tokens.inc(m.output_tokens)
        self.spec_drafted.inc(m.spec_drafted)
        self.spec_accepted.inc(m.spec_accepted)
        self._spec[0] += m.spec_drafted
        self._spec[1] += m.spec_accepted
        self.preemptions.inc(m.preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
