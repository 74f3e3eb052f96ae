"""`pdchat serve` against hostile clients and web pages: Host, Origin and content-type checks, API
keys (flag, $PDCHAT_API_KEY, keys file) guarding /metrics too, prefix-cache isolation, hostile
JSON answered with OpenAI error objects, ASCII-only SSE, and the last-resort JSON 500."""
from __future__ import annotations

import json

import httpx
import pytest

from pdchat.chatapp.serve import app as serve_app, protocol
from pdchat.chatapp.serve.app import MAX_CHARS_PER_TOKEN, create_app
from pdchat.chatapp.serve.auth import load_keys
from pdchat.chatapp.serve.options import ServeError, ServeOptions

from .loopback import MODEL, running

HELLO = [{"role": "user", "content": "Say hello."}]
CHAT = "/v1/chat/completions"
JSON_CT = {"Content-Type": "application/json"}


def ask(max_tokens: int = 2, **extra) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": max_tokens, **extra}


def error_of(r: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a response that must have this status."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    return r.json()["error"]


# ---- web pages: content type, Host, Origin ---------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_post_that_does_not_say_json_is_415(http, content_type):
    # what a page can send without a CORS preflight (None: fetch with a bare body)
    headers = {"Content-Type": content_type} if content_type else {}
    err = error_of(http.post(CHAT, content=json.dumps(ask()), headers=headers), 415)
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]


def test_json_with_a_charset_is_accepted(http):
    r = http.post(CHAT, content=json.dumps(ask()), headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


@pytest.mark.parametrize("host, ok", [
    ("127.0.0.1:8000", True), ("localhost:8000", True), ("[::1]:8000", True), ("192.168.1.20", True),
    ("attacker.example:8000", False), ("127.0.0.1.attacker.example", False), ("localhost.attacker.example", False),
])
def test_host_must_name_this_server(http, host, ok):
    # a DNS-rebinding page sends its own domain name as Host
    for r in (http.get("/v1/models", headers={"Host": host}), http.post(CHAT, json=ask(), headers={"Host": host})):
        if ok:
            assert r.status_code == 200
        else:
            err = error_of(r, 403)
            assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"]


def test_allowed_hosts_adds_names(engine):
    for allowed, host, status in ((("box.lan",), "box.lan:8000", 200), (("box.lan",), "other.lan", 403),
                                  (("*",), "anything.example", 200)):
        with running(create_app(engine, options=ServeOptions(allowed_hosts=allowed))) as url:
            assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == status


def test_requests_from_web_pages_are_refused_by_default(http):
    err = error_of(http.post(CHAT, json=ask(), headers={"Origin": "https://attacker.example"}), 403)
    assert err["code"] == "origin_not_allowed" and "--allowed-origins" in err["message"]
    preflight = http.options(CHAT, headers={"Origin": "https://attacker.example",
                                            "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


@pytest.mark.parametrize("configured", ["http://localhost:3000", "HTTP://LocalHost:3000/"])
def test_allowed_origins_get_cors(engine, configured):
    page = "http://localhost:3000"              # as a browser sends it
    with running(create_app(engine, options=ServeOptions(allowed_origins=(configured,)))) as url:
        preflight = httpx.options(url + CHAT, headers={"Origin": page, "Access-Control-Request-Method": "POST",
                                                       "Access-Control-Request-Headers": "content-type,authorization"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == page
        r = httpx.post(url + CHAT, json=ask(), headers={"Origin": page})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert httpx.post(url + CHAT, json=ask(), headers={"Origin": "http://localhost:4000"}).status_code == 403


# ---- API keys ----------------------------------------------------------------------------------

def test_keys_come_from_the_flag_else_the_environment_plus_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("PDCHAT_API_KEY", raising=False)
    assert load_keys(None, None) == ()
    monkeypatch.setenv("PDCHAT_API_KEY", "from-env")
    assert load_keys(None, None) == ("from-env",)
    assert load_keys("from-flag", None) == ("from-flag",)
    keys = tmp_path / "keys"
    keys.write_text("# team A\nkey-a\n\n  key-b  \nkey-a\n")
    assert load_keys(None, str(keys)) == ("from-env", "key-a", "key-b")


@pytest.mark.parametrize("content, words", [(None, "cannot read"), ("# only a comment\n\n", "holds no key"),
                                            ("has space\n", "printable ASCII")])
def test_a_bad_keys_file_is_one_error(tmp_path, monkeypatch, content, words):
    monkeypatch.delenv("PDCHAT_API_KEY", raising=False)
    path = tmp_path / "keys"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ServeError, match=words):
        load_keys(None, str(path))


def test_every_key_is_accepted_and_metrics_need_one(engine):
    app = create_app(engine, api_key="flag-key", options=ServeOptions(api_keys=("file-key",)))
    with running(app) as url:
        assert httpx.get(url + "/health").status_code == 200          # liveness stays open
        for path in ("/metrics", "/v1/models"):
            assert error_of(httpx.get(url + path), 401)["code"] == "invalid_api_key"
            assert httpx.get(url + path, headers={"Authorization": "Bearer guess"}).status_code == 401
            for key in ("flag-key", "file-key"):
                assert httpx.get(url + path, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer file-key"}).text
        assert "pdchat:engine_info" in metrics


# ---- prefix-cache isolation -----------------------------------------------------------------------

def cached(url: str, content: str, key: str | None = None, **extra) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + CHAT, json={**ask(1), "messages": [{"role": "user", "content": content}], **extra},
                   headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_separates_prefix_caches(server):
    url = server[0]
    text = "A secret prompt that some other client sent a moment ago, long enough for blocks."
    assert cached(url, text, cache_salt="tenant-a") == 0
    assert cached(url, text, cache_salt="tenant-b") == 0          # another salt learns nothing
    assert cached(url, text) == 0                                 # nor does a request without one
    assert cached(url, text, cache_salt="tenant-a") >= 32         # the same salt hits its blocks


def test_api_keys_are_tenants_unless_the_cache_is_shared(engine):
    text = "Each tenant has its own prefix cache unless the operator shares it on purpose, so here."
    keys = ServeOptions(api_keys=("key-a", "key-b"))
    with running(create_app(engine, options=keys)) as url:
        assert cached(url, text, "key-a") == 0
        assert cached(url, text, "key-b") == 0
        assert cached(url, text, "key-a") >= 32
    shared = ServeOptions(api_keys=("key-c", "key-d"), shared_prefix_cache=True)
    with running(create_app(engine, options=shared)) as url:
        text = text.upper()
        assert cached(url, text, "key-c") == 0
        assert cached(url, text, "key-d") >= 32


@pytest.mark.parametrize("salt", ["", "s" * 257, 7])
def test_bad_cache_salt_is_400(http, salt):
    assert error_of(http.post(CHAT, json=ask(cache_salt=salt)), 400)["param"] == "cache_salt"


# ---- hostile JSON: every answer is an error object with a 4xx -------------------------------------

def body(**fields) -> bytes:
    return json.dumps(ask(**fields)).encode()


HOSTILE = {
    "seed 2**64": (body(seed=2**64), "seed", "less than"),
    "seed below int64": (body(seed=-(2**63) - 1), "seed", "greater than"),
    "lone surrogate in content": (json.dumps({**ask(), "messages": [{"role": "user", "content": "a\ud800b"}]}).encode(),
                                  "messages.0.content", "lone surrogate"),
    "lone surrogate in the model": (json.dumps({**ask(), "model": "\udfff"}).encode(), "model", "lone surrogate"),
    "lone surrogate in a field name": (json.dumps({**ask(), "\ud800": 1}).encode(), None, "lone surrogate"),
    "100k-deep nesting": (b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested too deeply"),
    "5,000-digit integer": (b'{"model": "x", "max_tokens": ' + b"9" * 5000 + b"}", None, "5000 digits"),
    "100-digit integer": (body(max_tokens=10**99), None, "100 digits (at most 40)"),     # no field needs one
    "NaN": (body()[:-1] + b', "temperature": NaN}', None, "NaN"),
    "20,000 stop strings": (body(stop=[f"s{i}" for i in range(20_000)]), "stop", "at most 16 stop sequences"),
    "a long stop string": (body(stop="x" * 1000), "stop", "at most 256 characters"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_json_is_a_400_error_object(http, name):
    raw, param, words = HOSTILE[name]
    err = error_of(http.post(CHAT, content=raw, headers=JSON_CT), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"]


def test_a_lone_surrogate_in_the_model_name_is_refused_before_it_is_quoted(http):
    # the "not served here" message quotes the model name: it must never be what fails
    r = http.post(CHAT, content=json.dumps({**ask(), "model": "gpt-\ud83d"}), headers=JSON_CT)
    assert "lone surrogate" in error_of(r, 400)["message"]


def test_a_prompt_no_context_can_hold_is_refused_untokenized(http, engine, monkeypatch):
    calls = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **kw: calls.append(1) or encode(*a, **kw))
    huge = "word " * (engine.max_model_len * MAX_CHARS_PER_TOKEN // 5 + 1)
    for path, payload, param in ((CHAT, {**ask(), "messages": [{"role": "user", "content": huge}]}, "messages"),
                                 ("/v1/completions", {"model": MODEL, "prompt": huge}, "prompt")):
        err = error_of(http.post(path, json=payload), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == param
        assert f"{len(huge):,} characters" in err["message"]
    assert calls == []


# ---- SSE framing and the last resort ------------------------------------------------------------

def test_sse_events_are_ascii_so_no_client_splits_them():
    line = protocol.sse({"text": "a\u0085b\u2028c\u2029d é"})
    assert line.isascii() and line.count("\n") == 2
    assert json.loads(line[len("data: "):])["text"] == "a\u0085b\u2028c\u2029d é"


def test_a_stream_of_non_ascii_text_is_sent_as_ascii(http):
    payload = {"model": MODEL, "prompt": "Once upon", "max_tokens": 48, "temperature": 1.0, "seed": 3,
               "ignore_eos": True}
    whole = http.post("/v1/completions", json=payload).json()["choices"][0]["text"]
    assert not whole.isascii()                       # random:tiny speaks in arbitrary bytes
    with http.stream("POST", "/v1/completions", json={**payload, "stream": True}) as r:
        raw = r.read()
    assert raw.isascii()
    events = [json.loads(e[len(b"data: "):]) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == whole


def test_an_unexpected_error_is_a_json_500_and_the_server_carries_on(server, http, monkeypatch):
    def broken(model):
        raise RuntimeError("a bug")
    monkeypatch.setattr(server[1], "_check_model", broken)
    err = error_of(http.post(CHAT, json=ask()), 500)
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]
    monkeypatch.undo()
    assert http.post(CHAT, json=ask()).status_code == 200


def test_an_unexpected_error_mid_stream_ends_it_with_an_error_event(server, http, monkeypatch):
    def broken(completion, closing):
        raise RuntimeError("a bug")
    monkeypatch.setattr(serve_app, "completion_error", broken)           # runs once the request has finished
    with http.stream("POST", CHAT, json=ask(3, stream=True)) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]
    assert "choices" in json.loads(events[0])                      # the stream had begun
    monkeypatch.undo()
    assert http.post(CHAT, json=ask()).status_code == 200
