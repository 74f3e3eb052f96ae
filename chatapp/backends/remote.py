"""A Backend for any OpenAI-compatible server (pdchat serve, vLLM, SGLang, llama.cpp, Ollama).

Replies stream over SSE and are timed here, on the client (TTFT, ITL, TPOT). The engine snapshot
comes from the server's /metrics, parsed by metrics_parsers; it is fetched in the background so
stats(), which the UI calls on its own thread several times a second, never waits on the network.
Toggles belong to the server: a remote backend offers none.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator

import httpx

from pdchat.chatapp.backends.base import CAPABILITIES, Backend, Done, Event, Generation, Phase, Progress, Settings, Token
from pdchat.chatapp.backends.metrics_parsers import parse_metrics
from pdchat.chatapp.backends.openai_client import (TIMEOUT, Endpoint, RemoteError, Reply, SSEDecoder, connect_error, error_message,
                            model_ids, request_body, stream_events)

_CANCEL = object()


class RemoteGeneration(Generation):
    """A reader thread consumes the HTTP stream, so cancel() takes effect at once even while the
    server has not sent a byte (a long prefill, a full queue); the reader then drops the
    connection, which is how an OpenAI server learns to stop."""

    def __init__(self, client: httpx.Client, endpoint: Endpoint, body: dict[str, Any]):
        self._client = client
        self._endpoint = endpoint
        self._body = body
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self.reply = Reply(time.perf_counter())

    def __iter__(self) -> Iterator[Event]:
        self.reply.t_start = time.perf_counter()
        if not self._cancelled.is_set():
            threading.Thread(target=self._read, name="pdchat-remote-reader", daemon=True).start()
        yield Phase("queued", 0, 0, 0, self.reply.t_start)
        while True:
            item = self._events.get()
            if item is _CANCEL:
                yield Done(self.reply.text, "cancelled", self.reply.metrics())
                return
            yield item
            if isinstance(item, Done):
                return

    def cancel(self) -> None:
        self._cancelled.set()
        self._events.put(_CANCEL)

    def _read(self) -> None:
        reply = self.reply
        try:
            with self._client.stream("POST", f"{self._endpoint.v1}/chat/completions", json=self._body,
                                     headers=self._endpoint.headers()) as r:
                if r.status_code != 200:
                    raise RemoteError(error_message(r.status_code, r.read()))
                sse = SSEDecoder()
                for chunk in r.iter_bytes():
                    if self._cancelled.is_set():
                        return                    # leaving the block closes the connection
                    for event in stream_events(sse, chunk):
                        t = time.perf_counter()
                        if text := reply.feed(event, t):
                            self._events.put(Token(text, t, len(reply.chunk_times) - 1))
            reply.t_end = time.perf_counter()
            if reply.finish_reason is None:
                raise RemoteError("the server ended the stream without a finish reason")
            self._events.put(Done(reply.text, reply.finish_reason, reply.metrics()))
        except httpx.HTTPError as e:
            self._events.put(Done(reply.text, "error", reply.metrics(), str(connect_error(self._endpoint, e))))
        except RemoteError as e:
            self._events.put(Done(reply.text, "error", reply.metrics(), str(e)))


class RemoteBackend(Backend):
    name = "remote"

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, poll_s: float = 1.0):
        self.url = url
        self.requested_model = model
        self.model = model or url
        self.api_key = api_key
        self.poll_s = poll_s
        self.endpoint: Endpoint | None = None
        self._client = httpx.Client(timeout=TIMEOUT)
        self._snapshot: dict[str, Any] = {}
        self._fetched_at = 0.0
        self._fetching = threading.Lock()

    def load(self, progress: Progress) -> None:
        self.endpoint = Endpoint.parse(self.url, self.api_key)
        progress(f"connecting to {self.endpoint.root}…")
        ids = self._model_ids()
        if self.requested_model and self.requested_model not in ids:
            raise RemoteError(f"{self.endpoint.root} does not serve {self.requested_model!r}; "
                              f"it serves: {', '.join(ids) or 'nothing'}")
        if not ids:
            raise RemoteError(f"{self.endpoint.root} lists no models")
        self.model = self.requested_model or ids[0]
        self._refresh()
        server = self._snapshot.get("server")
        progress(f"{self.model} at {self.endpoint.root} ({f'{server} metrics' if server else 'no /metrics'})")

    def models(self) -> list[str]:
        if self.endpoint is None:
            return super().models()
        try:
            return self._model_ids()
        except Exception:   # the list is a convenience: a server that will not say offers none
            return super().models()

    def _model_ids(self) -> list[str]:
        assert self.endpoint is not None
        try:
            r = self._client.get(self.endpoint.root + "/v1/models", headers=self.endpoint.headers())
        except httpx.HTTPError as e:
            raise connect_error(self.endpoint, e) from None
        if r.status_code != 200:
            raise RemoteError(f"/v1/models: {error_message(r.status_code, r.content)}")
        return model_ids(self.endpoint, r.content)

    @property
    def capabilities(self) -> dict[str, bool]:
        return dict.fromkeys(CAPABILITIES, False)

    def stream(self, messages: list[dict[str, str]], settings: Settings) -> RemoteGeneration:
        if self.endpoint is None:
            raise RuntimeError("not connected yet")
        if settings.system and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": settings.system}] + list(messages)
        body = request_body(self.model, chat=True, prompt=messages, max_tokens=settings.max_tokens,
                            temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                            min_p=settings.min_p, seed=settings.seed)
        return RemoteGeneration(self._client, self.endpoint, body)

    # ---- telemetry ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The latest snapshot at once; a fetch starts in the background when it is stale."""
        if (self.endpoint is not None and time.monotonic() - self._fetched_at > self.poll_s
                and not self._fetching.locked()):
            threading.Thread(target=self._refresh, name="pdchat-remote-metrics", daemon=True).start()
        return self._snapshot

    def _refresh(self) -> None:
        if not self._fetching.acquire(blocking=False):
            return                               # a fetch is already on its way
        try:
            assert self.endpoint is not None
            self._fetched_at = time.monotonic()
            try:
                r = self._client.get(f"{self.endpoint.root}/metrics", headers=self.endpoint.headers(), timeout=5.0)
                text = r.text if r.status_code == 200 else ""
            except httpx.HTTPError:
                text = ""                         # no /metrics (Ollama) or a hiccup: fields read n/a
            snap = parse_metrics(text)
            snap["model"] = snap.get("model") or self.model
            self._snapshot = snap
        finally:
            self._fetching.release()

    def update(self, **toggles: Any) -> None:
        raise RuntimeError("optimizations are set on the remote server; pdchat cannot change them")

    def close(self) -> None:
        self._client.close()
