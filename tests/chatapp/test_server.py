"""`pdchat serve` over loopback with random:tiny: the OpenAI API with a real HTTP client and the
official `openai` client, every error case, concurrency, and cancellation on disconnect."""
from __future__ import annotations

import json
import socket
import threading
from typing import Iterator
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdchat.chatapp.cli.main import build_parser
from pdchat.chatapp.backends.metrics_parsers import Samples, parse_metrics
from pdchat.chatapp.serve.app import create_app
from pdchat.engine import SamplingParams

from .loopback import MODEL, running, wait_until

HELLO = [{"role": "user", "content": "Say hello."}]
LONG = {"max_tokens": 4000, "ignore_eos": True}      # runs for seconds unless cancelled


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def finished(server_state, reason: str) -> float:
    """pdchat:requests_total{finish_reason=reason} as the server counts it."""
    rows = Samples(server_state.metrics.render().decode()).by_name.get("pdchat:requests_total", [])
    return sum(v for labels, v in rows if labels["finish_reason"] == reason)


def idle(engine) -> bool:
    st = engine.stats()
    return st.running == 0 and st.waiting == 0 and st.kv_blocks_used == 0


def greedy(engine, prompt, n: int, **kw) -> str:
    return engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw))[0].text


def test_models_and_health(http):
    assert http.get("/health").json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_serve_binds_to_loopback_by_default():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)


def test_chat_non_streaming_matches_the_engine(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=9, temperature=0,
                                       extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == greedy(engine, HELLO, 9)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 9
    assert r.usage.prompt_tokens == len(engine.encode(HELLO))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 9


def test_chat_streaming_with_usage(client, engine):
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy(engine, HELLO, 12)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # the same prompt again: its full blocks now come from the prefix cache
    again = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, stream=True,
                                                stream_options={"include_usage": True}))
    assert again[-1].usage.prompt_tokens_details.cached_tokens >= 16


def test_streaming_without_usage_sends_none(http):
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 3,
                                                           "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in r.iter_lines() if l.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(l[5:]) for l in lines[:-1])


def test_completions_continue_raw_text(http, engine):
    prompt = "Once upon a time"
    ids = engine.tokenizer.encode(prompt)
    expected = greedy(engine, ids, 7)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body).json()
    assert r["object"] == "text_completion"
    assert r["choices"][0]["text"] == expected
    assert r["usage"]["prompt_tokens"] == len(ids)          # no chat template around it
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [json.loads(l[5:]) for l in s.iter_lines() if l.startswith("data:") and "[DONE]" not in l]
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    token_prompt = http.post("/v1/completions", json={**body, "prompt": ids}).json()
    assert token_prompt["choices"][0]["text"] == expected


def test_openai_client_completions_default_length(client):
    r = client.completions.create(model=MODEL, prompt="abc", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16                    # OpenAI's default max_tokens for completions


def test_seed_reproduces_sampling_and_stop_cuts(client, engine):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=1.0,
                                              top_p=0.9, seed=seed, extra_body={"ignore_eos": True})
    assert sample(7).choices[0].message.content == sample(7).choices[0].message.content
    full = greedy(engine, HELLO, 20)
    stop = full[5:8]
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]


def test_concurrent_requests_each_get_their_own_answer(server, engine):
    prompts = [[{"role": "user", "content": f"Question number {i}?"}] for i in range(8)]
    expected = [greedy(engine, p, 10) for p in prompts]
    got: dict[int, str] = {}

    def ask(i):
        c = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)
        got[i] = c.chat.completions.create(model=MODEL, messages=prompts[i], max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].message.content
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got.get(i) for i in range(8)] == expected
    assert idle(engine)


BAD = {"model": MODEL, "messages": HELLO}


@pytest.mark.parametrize("body, param, words", [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    ({**BAD, "frobnicate": 1}, "frobnicate", "unknown field"),
    ({"messages": HELLO}, "model", "missing"),
    ({**BAD, "temperature": 3}, "temperature", "less than or equal to 2"),
    ({**BAD, "temperature": "hot"}, "temperature", "number"),
    ({**BAD, "top_p": 0}, "top_p", "greater than 0"),
    ({**BAD, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({**BAD, "n": 2}, "n", "n=1"),
    ({**BAD, "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({**BAD, "logprobs": True}, "logprobs", "not supported"),
    ({**BAD, "stream": "yes"}, "stream", "boolean"),
    ({**BAD, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({**BAD, "messages": []}, "messages", "at least 1"),
    ({**BAD, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role", "Input should be"),
    ({**BAD, "messages": [{"role": "user"}]}, "messages.0.content", "missing"),
    ({**BAD, "max_tokens": 5, "max_completion_tokens": 5}, "max_tokens", "not both"),
])
def test_bad_chat_requests_are_400_with_openai_error_object(http, body, param, words):
    r = http.post("/v1/chat/completions", content=body if isinstance(body, bytes) else json.dumps(body),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert words in err["message"]


@pytest.mark.parametrize("body, words", [
    ({"model": MODEL, "prompt": ["a", "b"]}, "one prompt"),
    ({"model": MODEL, "prompt": "a", "echo": True}, "echo"),
    ({"model": MODEL, "prompt": "a", "logprobs": 2}, "not supported"),
    ({"model": MODEL, "prompt": [99999]}, "outside the vocabulary"),
    ({"model": MODEL, "prompt": ""}, "empty prompt"),
])
def test_bad_completion_requests_are_400(http, body, words):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400
    assert words in r.json()["error"]["message"]


def test_prompt_over_the_context_is_400_with_both_numbers(client, engine):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 5000}])
    err = e.value.body
    assert e.value.status_code == 400 and err["code"] == "context_length_exceeded"
    assert str(engine.max_model_len) in err["message"]
    assert str(len(engine.encode([{"role": "user", "content": "x" * 5000}]))) in err["message"]


def test_unknown_model_and_route_are_404(http):
    r = http.post("/v1/chat/completions", json={**BAD, "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert http.get("/v1/nothing").status_code == 404
    assert http.get("/v1/chat/completions").json()["error"]["message"].startswith("GET /v1/chat/completions")


def test_api_key_guards_the_api_but_not_health(engine):
    with running(create_app(engine, api_key="sekret")) as url:
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(url + "/v1/chat/completions", json={**BAD, "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert right.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).usage.completion_tokens <= 2


def _first_chunks(response: httpx.Response, n: int) -> Iterator[str]:
    """Reads until n content chunks have come; returns the rest of the lines. Keep it: a dropped
    line iterator closes the connection (httpcore closes it on GeneratorExit), which cancels."""
    lines = response.iter_lines()
    seen = 0
    for line in lines:
        if line.startswith("data:") and '"content"' in line:
            seen += 1
            if seen == n:
                break
    return lines


def test_busy_server_answers_503_then_recovers(engine):
    with running(create_app(engine, max_pending=1)) as url, httpx.Client(base_url=url, timeout=30) as http:
        body = {**BAD, **LONG, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as first:
            rest = _first_chunks(first, 2)
            r = http.post("/v1/chat/completions", json={**BAD, "max_tokens": 2})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "server_busy" and r.headers["retry-after"]
            rest.close()
        wait_until(lambda: idle(engine), what="the cancelled stream to be freed")
        assert http.post("/v1/chat/completions", json={**BAD, "max_tokens": 2}).status_code == 200


def test_disconnect_mid_stream_cancels_and_frees_kv_blocks(server, engine, http):
    url, state = server
    cancelled = finished(state, "cancelled")
    with http.stream("POST", "/v1/chat/completions", json={**BAD, **LONG, "stream": True}) as r:
        rest = _first_chunks(r, 3)
        assert engine.stats().kv_blocks_used > 0
        rest.close()
    # leaving the block closed the connection before the 4000 tokens were done
    wait_until(lambda: finished(state, "cancelled") == cancelled + 1, what="the request to be cancelled")
    wait_until(lambda: idle(engine), what="the KV blocks to be freed")
    assert state.in_flight == 0


def test_disconnect_while_waiting_for_a_whole_answer_cancels_too(server, engine):
    url, state = server
    cancelled = finished(state, "cancelled")
    body = json.dumps({**BAD, **LONG}).encode()
    host, port = urlsplit(url).hostname, urlsplit(url).port
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: engine.stats().running == 1, what="the request to start")
    wait_until(lambda: finished(state, "cancelled") == cancelled + 1, what="the request to be cancelled")
    wait_until(lambda: idle(engine), what="the KV blocks to be freed")


def test_metrics_exposes_our_names(client, http, engine):
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    text = http.get("/metrics").text
    for name in ("pdchat:ttft_ms_bucket", "pdchat:tpot_ms_bucket", "pdchat:e2e_ms_bucket", "pdchat:queue_ms_count",
                 "pdchat:kv_blocks_used", "pdchat:kv_blocks_total", "pdchat:kv_usage", "pdchat:prefix_hit_rate",
                 "pdchat:running", "pdchat:waiting", "pdchat:requests_total", "pdchat:output_tokens_total",
                 "pdchat:spec_accepted_total", "pdchat:engine_info", "pdchat:kv_transfer_ms_count",
                 "pdchat:kv_transfer_bytes_total", "pdchat:prefill_queue", "pdchat:disaggregate"):
        assert name in text, name
    families = [f.name for f in text_string_to_metric_families(text)]
    assert len(families) == len(set(families))                 # one name, one metric
    snap = parse_metrics(text)
    st = engine.stats()
    assert snap["server"] == "pdchat" and snap["model"] == MODEL
    assert (snap["kv_blocks_total"], snap["kv_block_size"], snap["running"]) == (st.kv_blocks_total, st.kv_block_size, 0)
    assert snap["prefix_hit_rate"] == pytest.approx(st.prefix_hit_rate)



def test_a_disaggregated_engine_feeds_the_kv_transfer_metrics(client, http, engine):
    def sample(name: str) -> float:
        return Samples(http.get("/metrics").text).sum(name) or 0.0
    count, sent = sample("pdchat:kv_transfer_ms_count"), sample("pdchat:kv_transfer_bytes_total")
    handed = engine.stats().kv_transferred_bytes
    engine.update(disaggregate=True)
    try:
        wait_until(lambda: engine.stats().prefill_worker == "idle", timeout=120, what="the prefill worker")
        assert sample("pdchat:prefill_worker_busy") == 0 and sample("pdchat:disaggregate") == 1
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 40}],
                                       max_tokens=2)
        wait_until(lambda: sample("pdchat:kv_transfer_ms_count") == count + 1, what="the request to be counted")
        assert sample("pdchat:kv_transfer_bytes_total") - sent == engine.stats().kv_transferred_bytes - handed > 0
    finally:
        engine.update(disaggregate=False)
    assert "pdchat:prefill_worker_busy" not in http.get("/metrics").text