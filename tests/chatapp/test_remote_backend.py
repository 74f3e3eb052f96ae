"""RemoteBackend (and `pdchat run --backend`) against `pdchat serve` over loopback."""
from __future__ import annotations

import json

import httpx
import pytest

from pdchat.chatapp.backends.base import Done, Phase, Settings, Token
from pdchat.chatapp.cli.main import main
from pdchat.chatapp.backends.metrics_parsers import Samples
from pdchat.chatapp.backends.openai_client import Endpoint, RemoteError
from pdchat.chatapp.backends.remote import RemoteBackend
from pdchat.chatapp.serve.app import create_app
from pdchat.engine import SamplingParams

from .loopback import MODEL, free_port, running, wait_until

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def url(engine):
    with running(create_app(engine)) as base:
        yield base


@pytest.fixture
def backend(url, monkeypatch):
    monkeypatch.delenv("PDCHAT_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    b = RemoteBackend(url, poll_s=0.05)
    b.load(lambda line: None)
    yield b
    b.close()


def events(generation) -> list:
    return list(generation)


def test_load_picks_the_served_model_and_offers_no_toggles(backend):
    assert backend.model == MODEL
    assert not any(backend.capabilities.values())
    with pytest.raises(RuntimeError, match="set on the remote server"):
        backend.update(prefix_cache=False)


def test_reply_streams_like_the_local_engine(backend, engine):
    settings = Settings(max_tokens=10, temperature=0, system="Be brief.")
    evs = events(backend.stream(HELLO, settings))
    assert isinstance(evs[0], Phase) and isinstance(evs[-1], Done)
    tokens = [e for e in evs if isinstance(e, Token)]
    done = evs[-1]
    local = engine.submit(HELLO, SamplingParams(max_tokens=10, temperature=0), system="Be brief.").result()
    assert "".join(t.text for t in tokens) == done.text == local.text
    assert done.finish_reason == local.finish_reason
    assert [t.index for t in tokens] == list(range(len(tokens)))
    m = done.metrics
    assert m["output_tokens"] == len(local.token_ids)
    assert m["prompt_tokens"] == local.metrics.prompt_tokens          # from the server's usage
    assert m["ttft_ms"] > 0 and len(m["itl_ms"]) == len(tokens) - 1
    assert m["queue_ms"] is None and m["prefill_ms"] is None          # only the server knows: n/a


def test_server_refusal_is_a_done_error(backend):
    done = events(backend.stream([{"role": "user", "content": "x" * 5000}], Settings(max_tokens=4)))[-1]
    assert done.finish_reason == "error"
    assert "HTTP 400" in done.error and "context window is 4096" in done.error


def cancelled_on_server(url: str) -> float:
    rows = Samples(httpx.get(url + "/metrics").text).by_name.get("pdchat:requests_total", [])
    return sum(v for labels, v in rows if labels["finish_reason"] == "cancelled")


def test_cancel_stops_the_server_request_and_frees_blocks(backend, engine, url):
    before = cancelled_on_server(url)
    prompt = [{"role": "user", "content": "Tell me a long story."}]
    # precondition: greedy output of this prompt does not end early by itself
    assert engine.submit(prompt, SamplingParams(max_tokens=200, temperature=0)).result().finish_reason == "length"
    gen = backend.stream(prompt, Settings(max_tokens=4000, temperature=0))
    it = iter(gen)
    while not isinstance(next(it), Token):
        pass
    gen.cancel()
    done = [e for e in it if isinstance(e, Done)][0]
    assert done.finish_reason == "cancelled"
    wait_until(lambda: cancelled_on_server(url) == before + 1, what="the server to see the disconnect")
    wait_until(lambda: engine.stats().running == 0 and engine.stats().kv_blocks_used == 0,
               what="the server to cancel the request")


def test_stats_come_from_the_servers_metrics_without_blocking(backend, engine):
    events(backend.stream(HELLO, Settings(max_tokens=3)))
    wait_until(lambda: backend.stats().get("server") == "pdchat", what="a metrics snapshot")
    snap = backend.stats()
    st = engine.stats()
    assert (snap["kv_blocks_total"], snap["kv_block_size"], snap["model"]) == (st.kv_blocks_total, st.kv_block_size,
                                                                              MODEL)
    assert snap["running"] == 0 and snap["kv_blocks_used"] == 0


def test_load_errors_are_readable(url, monkeypatch):
    monkeypatch.delenv("PDCHAT_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(RemoteError, match="does not serve 'gpt-4'.*random:tiny"):
        RemoteBackend(url, model="gpt-4").load(lambda line: None)
    with pytest.raises(RemoteError, match="cannot reach"):
        RemoteBackend(f"http://127.0.0.1:{free_port()}").load(lambda line: None)
    with pytest.raises(RemoteError, match="http"):
        RemoteBackend("localhost:8000").load(lambda line: None)


def test_api_key_comes_from_the_environment(engine, monkeypatch):
    with running(create_app(engine, api_key="sekret")) as base:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        monkeypatch.delenv("PDCHAT_API_KEY", raising=False)
        with pytest.raises(RemoteError, match="HTTP 401"):
            RemoteBackend(base).load(lambda line: None)
        monkeypatch.setenv("OPENAI_API_KEY", "sekret")
        b = RemoteBackend(base + "/v1/")                  # the /v1 base works as well as the root
        b.load(lambda line: None)
        assert events(b.stream(HELLO, Settings(max_tokens=2)))[-1].finish_reason in ("length", "stop")
        b.close()


def test_endpoint_parsing():
    e = Endpoint.parse("http://gpu-box:8000/v1/", api_key="k")
    assert (e.root, e.v1, e.headers()) == ("http://gpu-box:8000", "http://gpu-box:8000/v1", {"Authorization": "Bearer k"})
    assert Endpoint.parse("https://host/api/").root == "https://host/api"


def test_run_with_backend_prints_json(url, engine, capsys, monkeypatch):
    monkeypatch.delenv("PDCHAT_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    code = main(["run", "--backend", url, "Say hello.", "--json", "--max-tokens", "6", "--temperature", "0"])
    out = json.loads(capsys.readouterr().out)
    local = engine.submit("Say hello.", SamplingParams(max_tokens=6, temperature=0)).result()
    assert code == 0
    assert out["text"] == local.text and out["token_ids"] is None
    assert out["metrics"]["output_tokens"] == len(local.token_ids)


def test_run_with_unreachable_backend_is_one_line(capsys):
    code = main(["run", "--backend", f"http://127.0.0.1:{free_port()}", "hi"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("pdchat: error: cannot reach") and "Traceback" not in err


def test_app_picks_the_remote_backend_for_a_url():
    from pdchat.chatapp.tui.app import make_backend
    from pdchat.chatapp.backends.local import LocalBackend
    from pdchat.chatapp.backends.remote import RemoteBackend
    remote = make_backend({"model": "m", "threads": 1}, "http://127.0.0.1:9")
    assert isinstance(remote, RemoteBackend) and remote.url == "http://127.0.0.1:9" and remote.model == "m"
    remote.close()
    local = make_backend({"model": "random:tiny", "threads": 1})
    assert isinstance(local, LocalBackend) and (local.model, local.engine_options) == ("random:tiny", {"threads": 1})
