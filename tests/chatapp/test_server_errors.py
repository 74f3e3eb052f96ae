"""How the server reports a request the engine ended badly: an engine fault is a 500 (or, on a
stream, a final error event), a request cut by the engine shutting down is a 503."""
from __future__ import annotations

import json
import threading

import httpx

from pdchat.chatapp.serve.app import create_app
from pdchat.engine import Engine

from .loopback import MODEL, running, wait_until

CHAT = "/v1/chat/completions"


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
