"""How the server reports a request the engine ended badly: an engine fault is a 500 (or, on a
stream, a final error event), a request that outgrows the whole KV pool is the client's 400, a
request cut by the engine shutting down is a 503; and how the remote backend shows each."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from pdchat.chatapp.backends.base import Done, Settings, Token
from pdchat.chatapp.backends.remote import RemoteBackend
from pdchat.chatapp.serve.app import create_app
from pdchat.chatapp.serve.errors import completion_error, submit_error
from pdchat.engine import (Completion, ContextTooLong, Engine, EngineClosed, InvalidRequest, KVCacheTooSmall,
                           SamplingFailed)
from pdchat.engine.metrics import RequestMetrics

from .loopback import MODEL, running, wait_until

CHAT = "/v1/chat/completions"


@pytest.fixture
def http(engine):
    """A client of an app of its own over the module's engine: each test builds the error handlers
    it exercises (`make mutation` maps a mutant to the tests that run its function; a module-wide
    app would be built, and so counted, in the first test only)."""
    with running(create_app(engine)) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def ask(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, **kw}


def test_an_engine_fault_is_a_500_and_others_are_served(http, poisoned_sampling):
    r = http.post(CHAT, json=ask(temperature=poisoned_sampling))
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "non-finite" in err["message"]
    ok = http.post(CHAT, json=ask(temperature=0))
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_an_engine_fault_mid_stream_ends_the_stream_with_an_error_event(http, poisoned_sampling):
    with http.stream("POST", CHAT, json=ask(temperature=poisoned_sampling, stream=True)) as r:
        assert r.status_code == 200                     # the stream had begun: the error is its last event
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "non-finite" in err["message"]
    assert all("error" not in json.loads(e) for e in events[:-2])


def test_a_request_cut_by_the_engine_shutting_down_is_a_503():
    eng = Engine(model=MODEL, device="cpu", telemetry=False, kv_cache_mb=16)
    try:
        with running(create_app(eng)) as url, httpx.Client(base_url=url, timeout=60) as http:
            answer: list[httpx.Response] = []
            long = ask(max_tokens=100000, ignore_eos=True, temperature=0)
            t = threading.Thread(target=lambda: answer.append(http.post(CHAT, json=long)))
            t.start()
            wait_until(lambda: eng.stats().running == 1, what="the request to run")
            eng.close()
            t.join(30)
        assert answer and answer[0].status_code == 503
        err = answer[0].json()["error"]
        assert err["type"] == "server_error" and "shut down" in err["message"]
        assert answer[0].headers.get("retry-after") == "1"
    finally:
        eng.close()


# ---- the mapping itself ------------------------------------------------------------------------
def ended(reason: str, error: str | None = None, exception=None) -> Completion:
    return Completion("partial", [1, 2], reason, RequestMetrics(), error=error, exception=exception)


@pytest.mark.parametrize("completion, closing, status, type_, code, message", [
    (ended("error", "needs more KV", KVCacheTooSmall("needs more KV")), False, 400, "invalid_request_error", None,
     "needs more KV"),
    (ended("error", None, InvalidRequest("x")), False, 400, "invalid_request_error", None, "invalid request"),
    (ended("error", "non-finite logits", SamplingFailed("non-finite logits")), False, 500, "server_error", None,
     "non-finite logits"),
    (ended("error"), False, 500, "server_error", None, "generation failed"),
    (ended("cancelled", "engine shut down", EngineClosed("engine shut down")), False, 503, "server_error", None,
     "engine shut down"),
    (ended("cancelled"), False, 503, "server_error", None, "the request was cancelled"),
    (ended("cancelled", "engine shut down"), True, 503, "server_error", "server_shutting_down",
     "server shutting down"),
])
def test_each_bad_ending_has_its_status(completion, closing, status, type_, code, message):
    e = completion_error(completion, closing=closing)
    assert (e.status, e.type, e.code, e.message) == (status, type_, code, message)
    assert e.body() == {"error": {"message": message, "type": type_, "param": None, "code": code}}


@pytest.mark.parametrize("reason", ["stop", "length"])
@pytest.mark.parametrize("closing", [False, True])
def test_a_normal_finish_is_no_error_even_while_closing(reason, closing):
    assert completion_error(ended(reason), closing=closing) is None


def test_submit_errors_name_the_field_and_whose_fault():
    long = ContextTooLong(5000, 4096)
    chat, plain = submit_error(long, "/v1/chat/completions"), submit_error(long, "/v1/completions")
    assert (chat.status, chat.param, chat.code, chat.message) == (400, "messages", "context_length_exceeded", str(long))
    assert (plain.param, plain.code) == ("prompt", "context_length_exceeded")
    bad = submit_error(InvalidRequest("empty prompt"), "/v1/chat/completions")
    assert (bad.status, bad.type, bad.param, bad.code, bad.message) == \
        (400, "invalid_request_error", None, None, "empty prompt")
    closed = submit_error(EngineClosed("engine shut down"), "/v1/completions")
    assert (closed.status, closed.type, closed.message) == (503, "server_error", "engine shut down")


# ---- what the engine refuses at submit time, and routes that do not exist --------------------------
COMPLETIONS = "/v1/completions"


def test_a_prompt_the_engine_refuses_is_a_400_that_says_why(http):
    r = http.post(COMPLETIONS, json={"model": MODEL, "prompt": [5, 10**9], "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"].startswith("token id 1000000000 is outside the vocabulary (0..")
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, None)


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": [5] * 4096}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 4000}]}, "messages"),
])
def test_a_prompt_past_the_context_window_names_its_field(http, path, body, param):
    r = http.post(path, json={"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, "context_length_exceeded")
    assert "context window is 4096 tokens" in err["message"]


def test_a_request_to_a_closed_engine_is_a_503():
    eng = Engine(model=MODEL, device="cpu", telemetry=False, kv_cache_mb=16)
    with running(create_app(eng)) as url, httpx.Client(base_url=url, timeout=30) as http:
        eng.close()
        r = http.post(CHAT, json=ask())
    assert r.status_code == 503 and r.headers.get("retry-after") == "1"
    assert r.json()["error"] == {"message": "the engine is shut down", "type": "server_error", "param": None,
                                 "code": None}


@pytest.mark.parametrize("method, path, status, detail", [
    ("GET", "/v1/nowhere", 404, "Not Found"),
    ("GET", CHAT, 405, "Method Not Allowed"),
])
def test_a_route_that_is_not_there_is_an_error_object(http, method, path, status, detail):
    r = http.request(method, path)
    assert r.status_code == status
    assert r.json()["error"] == {"message": f"{method} {path}: {detail}", "type": "invalid_request_error",
                                 "param": None, "code": None}


# ---- a request that outgrows the KV pool while it generates ----------------------------------
@pytest.fixture(scope="module")
def small_pool():
    """A server whose KV pool holds 48 tokens: a chat prompt (24 tokens) fits, 200 more do not."""
    eng = Engine(model=MODEL, device="cpu", telemetry=False, num_kv_blocks=3)
    try:
        with running(create_app(eng)) as url, httpx.Client(base_url=url, timeout=60) as http:
            yield http, eng
    finally:
        eng.close()


def test_outgrowing_the_kv_pool_is_the_clients_400_and_frees_the_pool(small_pool):
    http, eng = small_pool
    r = http.post(CHAT, json=ask(max_tokens=200, ignore_eos=True, temperature=0))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "KV pool" in err["message"] and "--kv-cache-mb" in err["message"]
    wait_until(lambda: eng.stats().kv_blocks_used == 0, what="the blocks to come back")
    ok = http.post(CHAT, json=ask(max_tokens=8, ignore_eos=True, temperature=0))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


def test_outgrowing_the_kv_pool_mid_stream_ends_it_with_a_400_error_event(small_pool):
    http, _ = small_pool
    with http.stream("POST", CHAT, json=ask(max_tokens=200, ignore_eos=True, temperature=0, stream=True)) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "invalid_request_error" and "KV pool" in err["message"]
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    assert text                                  # what streamed before the pool ran out was sent


# ---- what the remote backend makes of them -----------------------------------------------------
def test_the_remote_backend_ends_a_reply_broken_mid_stream_with_the_servers_message(small_pool):
    http, _ = small_pool
    backend = RemoteBackend(str(http.base_url), poll_s=0.05)
    backend.load(lambda line: None)
    try:
        items = list(backend.stream([{"role": "user", "content": "hello"}],
                                    Settings(max_tokens=200, temperature=0.0)))
    finally:
        backend.close()
    tokens, done = [i for i in items if isinstance(i, Token)], items[-1]
    assert isinstance(done, Done) and done.finish_reason == "error"
    assert "failed mid-stream" in done.error and "KV pool" in done.error
    assert tokens and done.text == "".join(t.text for t in tokens)     # the text so far is kept
