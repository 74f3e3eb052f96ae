"""`pdchat serve` bounds what a client can make it do, run as `pdchat serve` runs it (listen.py's
protocol and shutdown, not plain uvicorn): body size and read deadlines, idle and half-sent
connections, a connection cap, a taken port, shutdown with open streams, requests the KV pool can
never hold, and a 16-stream load that a hostile client cannot disturb."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from contextlib import contextmanager
from http.client import HTTPResponse
from typing import Iterator

import httpx
import pytest

from pdchat.chatapp.cli.main import main
from pdchat.chatapp.serve.app import create_app
from pdchat.chatapp.serve.listen import Server, bind, http_server
from pdchat.chatapp.serve.options import Limits, ServeOptions
from pdchat.engine import Engine, SamplingParams

from .loopback import MODEL, wait_until

HELLO = [{"role": "user", "content": "Say hello."}]
CHAT = "/v1/chat/completions"
JSON_CT = {"Content-Type": "application/json"}


@contextmanager
def serving(engine: Engine, limits: Limits = Limits()) -> Iterator[tuple[str, Server]]:
    """The engine's API behind the HTTP server `pdchat serve` runs, with these limits for both (as
    serve() sets them), on a free port, in a thread."""
    app = create_app(engine, options=ServeOptions(limits=limits))
    sock = bind("127.0.0.1", 0)
    server = http_server(app, limits, app.state.server.shut_down)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), what="the server to start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(15)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def raw(url: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port_of(url)))
    sock.settimeout(10)
    return sock


def answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and the JSON body of the server's answer on a raw connection."""
    r = HTTPResponse(sock)
    r.begin()
    return r.status, json.loads(r.read())


def head(path: str = CHAT, length: int | None = None, method: str = "POST") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{size}\r\n").encode()


def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes the connection within `seconds`, while we send a byte of
    `trickle` every 0.2 s (a slowloris keeps its connection busy that way)."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.2)
    for i in range(10**6):
        if time.monotonic() > deadline:
            return False
        try:
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            if i < len(trickle):
                sock.sendall(trickle[i:i + 1])
        except ConnectionResetError:
            return True
    return False


def idle(engine: Engine) -> bool:
    st = engine.stats()
    return st.running == 0 and st.waiting == 0 and st.kv_blocks_used == 0


# ---- the body ----------------------------------------------------------------------------------

def test_a_declared_oversize_body_is_413_before_it_is_read(engine):
    with serving(engine, Limits(max_body_bytes=1000)) as (url, _):
        with raw(url) as sock:
            sock.sendall(head(length=1001))             # and not one byte of the body
            status, body = answer(sock)
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert "1,000 bytes" in body["error"]["message"]
        # not even JSON: the size is refused before any parsing
        assert httpx.post(url + CHAT, content=b"x" * 1001, headers=JSON_CT).status_code == 413
        ok = httpx.post(url + CHAT, json={"model": MODEL, "messages": HELLO, "max_tokens": 1})
        assert ok.status_code == 200


def test_a_10_mb_body_is_refused_within_a_second_untokenized(engine, monkeypatch):
    calls = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **kw: calls.append(1))
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 2_000_000}]}).encode()
    with serving(engine) as (url, _), httpx.Client(timeout=30) as http:
        for content in (big, (big[i:i + 65536] for i in range(0, len(big), 65536))):   # sized, then chunked
            t0 = time.perf_counter()
            r = http.post(url + CHAT, content=content, headers=JSON_CT)
            assert r.status_code == 413, r.text
            assert time.perf_counter() - t0 < 1.0       # tokenizing it took 19 s
    assert calls == []


def test_a_body_that_does_not_arrive_in_time_is_408(engine):
    with serving(engine, Limits(read_timeout_s=1)) as (url, _), raw(url) as sock:
        sock.sendall(head(length=100) + b'{"model": ')
        status, body = answer(sock)
    assert status == 408 and body["error"]["code"] == "request_timeout"


# ---- connections -------------------------------------------------------------------------------

def test_idle_and_half_sent_heads_are_closed(engine):
    with serving(engine, Limits(read_timeout_s=1)) as (url, _):
        with raw(url) as silent:
            assert closed_within(silent, 5)
        with raw(url) as slowloris:
            slowloris.sendall(b"GET /health HTTP/1.1\r\n")
            assert closed_within(slowloris, 5, trickle=b"X-Padding: " + b"a" * 100)
        with raw(url) as after_an_answer:               # an answered connection then trickles a new head
            after_an_answer.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert after_an_answer.recv(4096).startswith(b"HTTP/1.1 200")
            assert closed_within(after_an_answer, 5, trickle=b"GET /health HTTP/1.1\r\nX-Padding: " + b"a" * 100)


def test_connections_past_the_limit_get_a_json_503(engine):
    with serving(engine, Limits(max_connections=2)) as (url, server):
        holders = [raw(url), raw(url)]
        wait_until(lambda: len(server.server_state.connections) == 2, what="both connections to be accepted")
        with raw(url) as third:
            third.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, body = answer(third)
        assert status == 503 and body["error"]["code"] == "server_busy"
        for h in holders:
            h.close()
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, what="room for a connection")


def test_malformed_http_is_a_json_400(engine):
    with serving(engine) as (url, _), raw(url) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, body = answer(sock)
    assert status == 400 and "malformed HTTP" in body["error"]["message"]


def test_a_taken_port_is_one_error_line_before_loading(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", MODEL, "--device", "cpu", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"pdchat: error: cannot listen on 127.0.0.1:{port}: Address already in use "
                                f"(another program is listening there; pick another --port)"]


# ---- shutdown ----------------------------------------------------------------------------------

@contextmanager
def errors_logged() -> Iterator[list[logging.LogRecord]]:
    """The errors the server logs meanwhile. Enter it once the server runs: uvicorn's Config
    replaces the handlers of its loggers."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "asyncio")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def test_shutdown_ends_open_streams_with_an_error_event(engine):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with serving(engine) as (url, server), errors_logged() as errors, httpx.Client(timeout=30) as http:
        with http.stream("POST", url + CHAT, json=body) as r:
            lines = r.iter_lines()
            data = [line for _, line in zip(range(8), lines)]
            server.should_exit = True                   # what Ctrl+C does
            data += list(lines)
        wait_until(lambda: not server.server_state.tasks, what="the server to stop")
    events = [line[len("data: "):] for line in data if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["message"] == "server shutting down" and err["code"] == "server_shutting_down"
    assert errors == []                                  # no CancelledError traceback
    wait_until(lambda: idle(engine), what="the stream's KV blocks to be freed")


def test_a_client_that_leaves_mid_body_is_no_error(engine):
    with serving(engine) as (url, server), errors_logged() as errors:
        with raw(url) as sock:
            sock.sendall(head(length=100) + b'{"model": ')
            wait_until(lambda: server.server_state.tasks, what="the request to be read")
        wait_until(lambda: not server.server_state.tasks, what="the request to end")
        assert httpx.get(url + "/health").status_code == 200
    assert [r.getMessage() for r in errors] == []


# ---- the KV pool -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_pool():
    """Eight 16-token blocks: far less than the 4096-token context."""
    eng = Engine(model=MODEL, device="cpu", telemetry=False, kv_cache_mb=0.0625)
    yield eng
    eng.close()


def test_requests_the_kv_pool_can_never_hold_are_400(small_pool):
    with serving(small_pool) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
        at_submit = http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 200}]})
        assert at_submit.status_code == 400 and "KV pool" in at_submit.json()["error"]["message"]
        grows = {"model": MODEL, "prompt": "x" * 60, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        later = http.post("/v1/completions", json=grows)
        err = later.json()["error"]
        assert later.status_code == 400 and "KV pool" in err["message"] and err["type"] == "invalid_request_error"
        with http.stream("POST", "/v1/completions", json={**grows, "stream": True}) as r:
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "invalid_request_error"
        wait_until(lambda: idle(small_pool), what="the pool to be free")


# ---- a hostile client beside a 16-stream load ----------------------------------------------------

VICTIMS = 16
VICTIM_TOKENS = 64
POOL_TOKENS = 3072          # 192 blocks: the victims take 128 of them


@pytest.fixture(scope="module")
def victims_pool():
    """Room for the 16 victims, but less than the 4096-token context: a long prompt fits the
    context and never the pool."""
    eng = Engine(model=MODEL, device="cpu", telemetry=False, kv_cache_mb=1.5)
    assert eng.stats().kv_blocks_total * eng.stats().kv_block_size == POOL_TOKENS < eng.max_model_len
    yield eng
    eng.close()


def _hostile_set(url: str) -> dict[str, tuple[int, int, dict]]:
    """Every hostile input of the issue, one after another: {name: (status wanted, status got, body)}."""
    base = {"model": MODEL, "messages": HELLO, "max_tokens": 8, "ignore_eos": True}
    oversize = json.dumps({**base, "messages": [{"role": "user", "content": "a" * 10_000_000}]}).encode()
    cases = [
        ("temperature 1e-40", 200, CHAT, json.dumps({**base, "temperature": 1e-40}).encode(), JSON_CT),
        ("seed 2**64", 400, CHAT, json.dumps({**base, "seed": 2**64}).encode(), JSON_CT),
        ("lone surrogate", 400, CHAT,
         json.dumps({**base, "messages": [{"role": "user", "content": "\ud800"}]}).encode(), JSON_CT),
        ("surrogate model", 400, CHAT, json.dumps({**base, "model": "\udc00"}).encode(), JSON_CT),
        ("deep JSON", 400, CHAT, b"[" * 100_000 + b"]" * 100_000, JSON_CT),
        ("huge integer", 400, CHAT, b'{"model": "x", "seed": ' + b"7" * 5000 + b"}", JSON_CT),
        ("text/plain", 415, CHAT, json.dumps(base).encode(), {"Content-Type": "text/plain"}),
        ("bad Host", 403, CHAT, json.dumps(base).encode(), {**JSON_CT, "Host": "rebound.attacker.example"}),
        ("web page", 403, CHAT, json.dumps(base).encode(), {**JSON_CT, "Origin": "https://attacker.example"}),
        ("10 MB body", 413, CHAT, oversize, JSON_CT),
        ("10 MB chunked body", 413, CHAT, (oversize[i:i + 65536] for i in range(0, len(oversize), 65536)),
         JSON_CT),
        ("20,000 stops", 400, CHAT, json.dumps({**base, "stop": [f"stop{i}" for i in range(20_000)]}).encode(),
         JSON_CT),
        ("never fits the KV pool", 400, "/v1/completions",
         json.dumps({"model": MODEL, "prompt": [7] * (POOL_TOKENS + 16), "max_tokens": 1}).encode(), JSON_CT),
    ]
    got = {}
    with httpx.Client(timeout=30) as http:
        for name, wanted, path, content, headers in cases:
            r = http.post(url + path, content=content, headers=headers)
            got[name] = (wanted, r.status_code, r.json())      # always JSON
    return got


def _stream(url: str, prompt: list[dict[str, str]]) -> tuple[str, str | None]:
    body = {"model": MODEL, "messages": prompt, "max_tokens": VICTIM_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, finish = [], None
    with httpx.stream("POST", url + CHAT, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                text.append(event["choices"][0]["delta"].get("content") or "")
                finish = event["choices"][0]["finish_reason"] or finish
    return "".join(text), finish


def test_a_hostile_client_does_not_disturb_16_streams(victims_pool):
    engine = victims_pool
    prompts = [[{"role": "user", "content": f"Victim number {i} asks a question."}] for i in range(VICTIMS)]
    solo = [engine.generate([p], SamplingParams(max_tokens=VICTIM_TOKENS, temperature=0, ignore_eos=True))[0].text
            for p in prompts]
    greedy = engine.generate([HELLO], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
    got: dict[int, tuple[str, str | None]] = {}
    hostile: dict[str, tuple[int, int, dict]] = {}
    t0 = time.monotonic()
    with serving(engine) as (url, _):
        victims = [threading.Thread(target=lambda i=i: got.__setitem__(i, _stream(url, prompts[i])))
                   for i in range(VICTIMS)]
        for t in victims:
            t.start()
        wait_until(lambda: engine.stats().running >= VICTIMS // 2, what="the victims to be generating")
        attacker = threading.Thread(target=lambda: hostile.update(_hostile_set(url)))
        attacker.start()
        for t in victims + [attacker]:
            t.join(60)
    assert time.monotonic() - t0 < 60                      # a generous bound: about 5 s on 2 cores
    assert len(hostile) == 13
    assert {name: got_ for name, (wanted, got_, _) in hostile.items() if got_ != wanted} == {}
    assert all(set(body) == {"error"} for wanted, _, body in hostile.values() if wanted != 200)
    assert hostile["temperature 1e-40"][2]["choices"][0]["message"]["content"] == greedy
    assert "KV pool" in hostile["never fits the KV pool"][2]["error"]["message"]
    assert [got.get(i) for i in range(VICTIMS)] == [(text, "length") for text in solo]
    wait_until(lambda: idle(engine), what="every KV block to be free")
    assert engine.stats().kv_blocks_used == 0
