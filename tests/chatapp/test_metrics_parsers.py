"""/metrics of vLLM, SGLang, llama.cpp and pdchat onto pdchat's snapshot names, from sample texts
written with the names each project documents; and llama.cpp's per-response timings."""
from __future__ import annotations

from dataclasses import fields

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdchat.chatapp.backends.metrics_parsers import EXTRA_KEYS, Samples, llamacpp_timings, parse_metrics
from pdchat.chatapp.backends.openai_client import Reply
from pdchat.chatapp.serve.prometheus import ServerMetrics
from pdchat.engine import EngineStats, RequestMetrics

STATS_FIELDS = {f.name for f in fields(EngineStats)}

VLLM_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.75
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 250.0
# HELP vllm:spec_decode_num_draft_tokens Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
# HELP vllm:spec_decode_num_accepted_tokens Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 300.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="2000"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.5
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 80.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
"""

VLLM_V0 = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="facebook/opt-125m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="facebook/opt-125m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="facebook/opt-125m"} 0.5
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{model_name="facebook/opt-125m"} 0.125
# TYPE vllm:spec_decode_draft_acceptance_rate gauge
vllm:spec_decode_draft_acceptance_rate{model_name="facebook/opt-125m"} 0.6
"""

SGLANG = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP sglang:num_used_tokens The number of used tokens
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 123765.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.5
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6886
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 3469
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.5
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 2048
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


def test_vllm_v1():
    s = parse_metrics(VLLM_V1)
    assert s["server"] == "vllm" and s["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert (s["running"], s["waiting"]) == (5, 4)                 # summed over engines
    assert s["kv_usage"] == pytest.approx(0.5)                    # averaged over engines
    assert (s["kv_block_size"], s["kv_blocks_total"], s["kv_blocks_used"]) == (16, 2000, 1000)
    assert s["prefix_hit_rate"] == pytest.approx(0.25)
    assert (s["spec_drafted"], s["spec_accepted"]) == (400, 300)
    assert s["spec_acceptance_rate"] == pytest.approx(0.75)
    assert s["step_ms"] is None and s["kv_blocks_cached"] is None   # not exposed: n/a


def test_vllm_v0_names():
    s = parse_metrics(VLLM_V0)
    assert s["server"] == "vllm" and (s["running"], s["waiting"]) == (1, 0)
    assert s["kv_usage"] == 0.5 and s["prefix_hit_rate"] == 0.125 and s["spec_acceptance_rate"] == 0.6
    assert s["kv_blocks_total"] is None and s["kv_blocks_used"] is None   # no cache_config_info


def test_sglang():
    s = parse_metrics(SGLANG)
    assert s["server"] == "sglang" and s["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert (s["running"], s["waiting"]) == (7, 3)
    assert s["kv_usage"] == 0.28 and (s["kv_block_size"], s["kv_blocks_used"]) == (1, 123765)
    assert s["kv_blocks_total"] is None
    assert s["prefix_hit_rate"] == 0.0075 and s["spec_accept_length"] == 2.5
    assert s["spec_acceptance_rate"] is None


def test_llamacpp():
    s = parse_metrics(LLAMACPP)
    assert s["server"] == "llama.cpp"
    assert (s["running"], s["waiting"]) == (2, 1)
    assert s["kv_usage"] == 0.5 and (s["kv_block_size"], s["kv_blocks_used"]) == (1, 2048)
    assert s["prefix_hit_rate"] is None and s["model"] is None


def test_pdchat_round_trip():
    stats = EngineStats(model="random:tiny", kv_block_size=16, kv_blocks_total=100, kv_blocks_used=25,
                        kv_blocks_cached=5, kv_bytes_total=10**6, running=2, waiting=1, step_ms=3.5,
                        prefix_hit_rate=0.4, device="cuda:0", device_name="NVIDIA H100", spec="ngram")
    metrics = ServerMetrics(lambda: stats)
    metrics.observe(RequestMetrics(ttft_ms=12.0, tpot_ms=3.0, output_tokens=8, prompt_tokens=20,
                                   spec_drafted=10, spec_accepted=6, finish_reason="stop"), 40.0)
    s = parse_metrics(metrics.render().decode())
    assert s["server"] == "pdchat"
    for name in ("model", "kv_block_size", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "kv_bytes_total",
                 "running", "waiting", "step_ms", "prefix_hit_rate", "device", "device_name", "spec"):
        assert s[name] == getattr(stats, name), name
    assert s.get("device_util_pct") is None                        # None on the server stays n/a
    assert s["kv_usage"] == 0.25
    assert (s["spec_drafted"], s["spec_accepted"], s["spec_acceptance_rate"]) == (10, 6, 0.6)


def metric_families(text: str) -> list[str]:
    """The metric names a /metrics text declares, as a parser reads them (a counter's without `_total`)."""
    return [family.name for family in text_string_to_metric_families(text)]


def disaggregated_metrics() -> ServerMetrics:
    """A server whose engine's prefill worker is busy, after one reply it prefilled and one it did not."""
    stats = EngineStats(model="random:tiny", kv_blocks_total=100, disaggregate=True, prefill_worker="busy",
                        prefill_queue=2, prefill_cores="0", decode_cores="1", kv_link="socket", kv_transfers=3,
                        kv_transferred_bytes=9000, last_kv_transfer_bytes=3000, last_kv_transfer_ms=2.5)
    metrics = ServerMetrics(lambda: stats)
    metrics.observe(RequestMetrics(ttft_ms=20.0, kv_transfer_bytes=4096, kv_transfer_ms=3.0, finish_reason="stop"),
                    40.0)
    metrics.observe(RequestMetrics(ttft_ms=20.0, finish_reason="stop"), 40.0)
    return metrics


def test_kv_transfers_are_a_histogram_and_a_counter_fed_per_request():
    samples = Samples(disaggregated_metrics().render().decode())
    assert samples.sum("pdchat:kv_transfer_ms_count") == 1 and samples.sum("pdchat:kv_transfer_ms_sum") == 3.0
    bucket = {labels["le"]: v for labels, v in samples.by_name["pdchat:kv_transfer_ms_bucket"]}
    assert (bucket["2.5"], bucket["5.0"]) == (0.0, 1.0)
    assert samples.sum("pdchat:kv_transfer_bytes_total") == 4096
    # the engine's prefill worker as gauges and engine_info labels
    assert samples.sum("pdchat:prefill_queue") == 2 and samples.sum("pdchat:prefill_worker_busy") == 1
    assert samples.sum("pdchat:disaggregate") == 1 and samples.sum("pdchat:kv_transfers") == 3
    info = samples.by_name["pdchat:engine_info"][0][0]
    assert (info["prefill_worker"], info["prefill_cores"], info["kv_link"]) == ("busy", "0", "socket")


@pytest.mark.parametrize("metrics", [disaggregated_metrics(), ServerMetrics(lambda: EngineStats())],
                         ids=["disaggregated", "colocated"])
def test_no_metric_name_is_declared_twice(metrics):
    # a scrape that declares a name twice is refused: the snapshot's hand-off fields are named
    # apart from the per-request metrics
    names = metric_families(metrics.render().decode())
    assert len(names) == len(set(names)) and "pdchat:kv_transfer_ms" in names


def test_an_engine_without_a_prefill_worker_has_no_busy_gauge():
    text = ServerMetrics(lambda: EngineStats()).render().decode()
    assert "pdchat:prefill_worker_busy" not in text and "pdchat:kv_transfer_ms_count 0.0" in text


def test_pdchat_round_trip_of_a_disaggregated_engine():
    s = parse_metrics(disaggregated_metrics().render().decode())
    assert (s["disaggregate"], s["prefill_worker"], s["prefill_queue"], s["prefill_worker_busy"]) == (1, "busy", 2, 1)
    assert (s["prefill_cores"], s["decode_cores"], s["kv_link"], s["kv_transfers"]) == ("0", "1", "socket", 3)
    assert (s["kv_transferred_bytes"], s["last_kv_transfer_bytes"], s["last_kv_transfer_ms"]) == (9000, 3000, 2.5)


@pytest.mark.parametrize("text", [VLLM_V1, VLLM_V0, SGLANG, LLAMACPP])
def test_every_snapshot_key_is_an_engine_stats_name(text):
    assert set(parse_metrics(text)) - set(EXTRA_KEYS) <= STATS_FIELDS


@pytest.mark.parametrize("text", ["", "# nothing here\n", "some_other_exporter_metric 1\n"])
def test_unknown_or_missing_metrics_are_all_none(text):
    s = parse_metrics(text)
    assert s["server"] is None and all(v is None for v in s.values())


def test_llamacpp_timings():
    timings = {"cache_n": 236, "prompt_n": 1, "prompt_ms": 30.958, "prompt_per_token_ms": 30.958,
               "prompt_per_second": 32.3, "predicted_n": 35, "predicted_ms": 661.064,
               "predicted_per_second": 52.9, "draft_n": 20, "draft_n_accepted": 15}
    assert llamacpp_timings(timings) == {"cached_prompt_tokens": 236, "prompt_tokens": 237, "prefill_ms": 30.958,
                                         "prefill_tok_s": 32.3, "spec_drafted": 20, "spec_accepted": 15,
                                         "spec_acceptance": 0.75}
    assert llamacpp_timings({"predicted_n": 3}) == {}


def test_reply_metrics_from_a_llamacpp_stream():
    reply = Reply(t_start=10.0)
    reply.feed({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}, 10.1)
    for i, t in enumerate((10.2, 10.25, 10.35)):
        reply.feed({"choices": [{"delta": {"content": f"t{i}"}, "finish_reason": None}]}, t)
    reply.feed({"choices": [{"delta": {}, "finish_reason": "stop"}],
                "timings": {"cache_n": 8, "prompt_n": 4, "prompt_ms": 50.0, "prompt_per_second": 80.0}}, 10.36)
    reply.feed({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}}, 10.37)
    m = reply.metrics()
    assert set(m) <= {f.name for f in fields(RequestMetrics)}
    assert {"ttft_ms", "tpot_ms", "itl_ms", "decode_tok_s", "output_tokens", "finish_reason"} <= set(m)
    assert reply.text == "t0t1t2" and m["finish_reason"] == "stop"
    assert m["ttft_ms"] == pytest.approx(200) and m["itl_ms"] == pytest.approx([50, 100])
    assert m["decode_ms"] == pytest.approx(150) and m["tpot_ms"] == pytest.approx(75)
    assert m["decode_tok_s"] == pytest.approx(2 / 0.15)
    assert (m["prompt_tokens"], m["cached_prompt_tokens"], m["prefill_ms"]) == (12, 8, 50.0)
    assert m["queue_ms"] is None and m["spec_drafted"] is None         # not reported: n/a


VLLM_NIXL = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.01",model_name="m"} 3.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.05
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 4.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 8.0e+06
"""

SGLANG_DECODE = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 5.0
# TYPE sglang:num_decode_transfer_queue_reqs gauge
sglang:num_decode_transfer_queue_reqs{model_name="m"} 2.0
# TYPE sglang:kv_transfer_latency_ms gauge
sglang:kv_transfer_latency_ms{model_name="m"} 7.5
# TYPE sglang:kv_transfer_speed_gb_s gauge
sglang:kv_transfer_speed_gb_s{model_name="m"} 12.25
"""


def test_vllm_nixl_transfers_read_as_hand_offs():
    s = parse_metrics(VLLM_NIXL)
    assert (s["server"], s["disaggregate"], s["kv_transfers"], s["kv_transferred_bytes"]) == ("vllm", 1, 4, 8_000_000)
    assert s["kv_transfer_mean_ms"] == pytest.approx(12.5)
    assert s["last_kv_transfer_ms"] is None                 # vLLM exports no last transfer


def test_sglang_decode_side_reads_its_transfer_queue_and_speed():
    s = parse_metrics(SGLANG_DECODE)
    assert (s["server"], s["disaggregate"], s["kv_transfer_queue"]) == ("sglang", 1, 2)
    assert (s["last_kv_transfer_ms"], s["kv_transfer_gbps"], s["prefill_queue"]) == (7.5, 12.25, None)


@pytest.mark.parametrize("text", [VLLM_V1, SGLANG])
def test_servers_without_a_split_are_not_disaggregated(text):
    s = parse_metrics(text)
    assert s["disaggregate"] is None and s["kv_transfers"] is None and s["kv_transfer_queue"] is None
