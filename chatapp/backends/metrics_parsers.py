"""Server telemetry onto pdchat's names: `/metrics` of vLLM, SGLang, llama.cpp and pdchat itself,
and llama.cpp's per-response `timings`.

`parse_metrics` returns an engine snapshot dict keyed like EngineStats (plus the extras below), so
the telemetry panel reads a remote server the way it reads the local engine. What a server does
not expose stays None ("n/a"); nothing is estimated. Servers that count KV cache in tokens rather
than blocks (SGLang, llama.cpp) are reported as blocks of one token. Only pdchat's own server
reports the CPU figures of its machine and process (`cpu_util_pct`, `process_cpu_pct`, `rss_bytes`).

Extras, beyond EngineStats: `server` (which dialect was read), `kv_usage` (fraction of the KV pool
in use, the one figure every server exposes), `spec_drafted` / `spec_accepted` (speculative tokens
since the server started), `spec_acceptance_rate` (accepted / drafted), `spec_accept_length`
(SGLang: mean tokens per verify step), `prefill_worker_busy` (pdchat with --disaggregate: 1
while prompts sent to its prefill worker are not back) and, for the prefill/decode split of
vLLM (its NIXL connector) and SGLang (`--disaggregation-mode`), `kv_transfer_mean_ms` (vLLM: the mean hand-off
since start), `kv_transfer_gbps` (SGLang: the recent transfer speed) and `kv_transfer_queue`
(SGLang's decode side: requests whose K/V are arriving). There, `disaggregate` is 1 when the server
exports such metrics, `kv_transfers`/`kv_transferred_bytes` come from vLLM's histograms,
`last_kv_transfer_ms` is SGLang's recent transfer latency and `prefill_queue` its prefill side's
requests still sending K/V.

Metric names come from each project's documentation: vLLM "Production Metrics" (v0 and v1
names), SGLang "Production Metrics", llama.cpp server README (`--metrics`).
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client.parser import text_string_to_metric_families

SNAPSHOT_KEYS = ("model", "device", "kv_block_size", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached",
                 "kv_bytes_per_token", "kv_bytes_used", "kv_bytes_total", "running", "waiting", "step_ms",
                 "prefix_hit_rate", "cpu_util_pct", "process_cpu_pct", "rss_bytes", "disaggregate",
                 "prefill_queue", "kv_transfers", "kv_transferred_bytes", "last_kv_transfer_ms")
EXTRA_KEYS = ("server", "kv_usage", "spec_drafted", "spec_accepted", "spec_acceptance_rate", "spec_accept_length",
              "prefill_worker_busy", "kv_transfer_mean_ms", "kv_transfer_gbps", "kv_transfer_queue")


class Samples:
    """The samples of one /metrics text by sample name; several label sets (engines, ranks) add up."""

    def __init__(self, text: str):
        self.by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        self.gauges: set[str] = set()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.by_name.setdefault(s.name, []).append((s.labels, s.value))
                if family.type == "gauge":
                    self.gauges.add(s.name)

    def has_prefix(self, prefix: str) -> bool:
        return any(name.startswith(prefix) for name in self.by_name)

    def sum(self, *names: str) -> float | None:
        """The first of `names` that is present, summed over its label sets."""
        for name in names:
            if name in self.by_name:
                return sum(v for _, v in self.by_name[name])
        return None

    def mean(self, *names: str) -> float | None:
        for name in names:
            if name in self.by_name:
                values = [v for _, v in self.by_name[name]]
                return sum(values) / len(values)
        return None

    def label(self, name: str, key: str) -> str | None:
        for labels, _ in self.by_name.get(name, []):
            if key in labels:
                return labels[key]
        return None

    def any_label(self, key: str) -> str | None:
        for rows in self.by_name.values():
            for labels, _ in rows:
                if key in labels:
                    return labels[key]
        return None


def _int(value: float | str | None) -> int | None:
    return None if value is None else int(float(value))


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _spec(snap: dict[str, Any], drafted: float | None, accepted: float | None) -> None:
    snap["spec_drafted"], snap["spec_accepted"] = _int(drafted), _int(accepted)
    if snap["spec_acceptance_rate"] is None:
        snap["spec_acceptance_rate"] = _ratio(accepted, drafted)


def _vllm(s: Samples, snap: dict[str, Any]) -> None:
    snap["model"] = s.any_label("model_name")
    snap["running"] = _int(s.sum("vllm:num_requests_running"))
    snap["waiting"] = _int(s.sum("vllm:num_requests_waiting"))
    # v1 name first, then v0's
    snap["kv_usage"] = s.mean("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    snap["kv_block_size"] = _int(s.label("vllm:cache_config_info", "block_size"))
    snap["kv_blocks_total"] = _int(s.label("vllm:cache_config_info", "num_gpu_blocks"))
    if snap["kv_usage"] is not None and snap["kv_blocks_total"]:
        snap["kv_blocks_used"] = round(snap["kv_usage"] * snap["kv_blocks_total"])
    hits, queries = s.sum("vllm:prefix_cache_hits_total"), s.sum("vllm:prefix_cache_queries_total")
    snap["prefix_hit_rate"] = _ratio(hits, queries) if queries else s.mean("vllm:gpu_prefix_cache_hit_rate")
    snap["spec_acceptance_rate"] = s.mean("vllm:spec_decode_draft_acceptance_rate")
    _spec(snap, s.sum("vllm:spec_decode_num_draft_tokens_total"), s.sum("vllm:spec_decode_num_accepted_tokens_total"))
    # Prefill/decode disaggregation through the NIXL connector: one histogram sample per transfer.
    count, seconds = s.sum("vllm:nixl_xfer_time_seconds_count"), s.sum("vllm:nixl_xfer_time_seconds_sum")
    if count is not None:
        snap["disaggregate"], snap["kv_transfers"] = 1, _int(count)
        snap["kv_transferred_bytes"] = _int(s.sum("vllm:nixl_bytes_transferred_sum"))
        snap["kv_transfer_mean_ms"] = None if not count or seconds is None else seconds / count * 1000


def _sglang(s: Samples, snap: dict[str, Any]) -> None:
    snap["model"] = s.any_label("model_name")
    snap["running"] = _int(s.sum("sglang:num_running_reqs"))
    snap["waiting"] = _int(s.sum("sglang:num_queue_reqs"))
    snap["kv_usage"] = s.mean("sglang:token_usage")
    used = s.sum("sglang:num_used_tokens")
    if used is not None:
        snap["kv_block_size"], snap["kv_blocks_used"] = 1, int(used)
    snap["prefix_hit_rate"] = s.mean("sglang:cache_hit_rate")
    snap["spec_accept_length"] = s.mean("sglang:spec_accept_length")
    # Prefill/decode disaggregation (--disaggregation-mode prefill|decode): queues and the recent
    # transfer, each exported by the side it concerns.
    if s.has_prefix("sglang:kv_transfer_") or s.has_prefix("sglang:num_decode_transfer_queue_reqs") \
            or s.has_prefix("sglang:num_prefill_inflight_queue_reqs"):
        snap["disaggregate"] = 1
        snap["prefill_queue"] = _int(s.sum("sglang:num_prefill_inflight_queue_reqs"))
        snap["kv_transfer_queue"] = _int(s.sum("sglang:num_decode_transfer_queue_reqs"))
        snap["last_kv_transfer_ms"] = s.mean("sglang:kv_transfer_latency_ms")
        snap["kv_transfer_gbps"] = s.mean("sglang:kv_transfer_speed_gb_s")


def _llamacpp(s: Samples, snap: dict[str, Any]) -> None:
    snap["running"] = _int(s.sum("llamacpp:requests_processing"))
    snap["waiting"] = _int(s.sum("llamacpp:requests_deferred"))
    snap["kv_usage"] = s.mean("llamacpp:kv_cache_usage_ratio")
    tokens = s.sum("llamacpp:kv_cache_tokens")
    if tokens is not None:
        snap["kv_block_size"], snap["kv_blocks_used"] = 1, int(tokens)


def _pdchat(s: Samples, snap: dict[str, Any]) -> None:
    # Our own server exports every EngineStats field as an unlabelled gauge of the same name.
    for name in s.gauges:
        rows = s.by_name[name]
        if name.startswith("pdchat:") and len(rows) == 1 and not rows[0][0]:
            value = rows[0][1]
            snap[name.removeprefix("pdchat:")] = int(value) if value.is_integer() else value
    snap.update(next((labels for labels, _ in s.by_name.get("pdchat:engine_info", [])), {}))
    _spec(snap, s.sum("pdchat:spec_drafted_total"), s.sum("pdchat:spec_accepted_total"))


READERS: tuple[tuple[str, str, Callable[[Samples, dict[str, Any]], None]], ...] = (
    ("pdchat", "pdchat:", _pdchat), ("vllm", "vllm:", _vllm), ("sglang", "sglang:", _sglang),
    ("llama.cpp", "llamacpp:", _llamacpp),
)


def parse_metrics(text: str) -> dict[str, Any]:
    """An engine snapshot dict from a /metrics text; every key None when the dialect is unknown."""
    snap: dict[str, Any] = dict.fromkeys(SNAPSHOT_KEYS + EXTRA_KEYS)
    samples = Samples(text)
    for server, prefix, read in READERS:
        if samples.has_prefix(prefix):
            snap["server"] = server
            read(samples, snap)
            break
    return snap


def llamacpp_timings(timings: dict[str, Any]) -> dict[str, Any]:
    """RequestMetrics fields from llama.cpp's per-response `timings` (server-measured).

    llama.cpp's prompt_n counts the prompt tokens it computed; cache_n those it reused.
    """
    out: dict[str, Any] = {}
    cache_n, prompt_n = timings.get("cache_n"), timings.get("prompt_n")
    if cache_n is not None:
        out["cached_prompt_tokens"] = cache_n
        if prompt_n is not None:
            out["prompt_tokens"] = prompt_n + cache_n
    if timings.get("prompt_ms") is not None:
        out["prefill_ms"] = timings["prompt_ms"]
    if timings.get("prompt_per_second") is not None:
        out["prefill_tok_s"] = timings["prompt_per_second"]
    drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
    if drafted is not None:
        out["spec_drafted"], out["spec_accepted"] = drafted, accepted
        out["spec_acceptance"] = _ratio(accepted, drafted)
    return out
