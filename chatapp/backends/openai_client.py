"""The client half of the OpenAI API, shared by the remote backend and `pdchat bench serve`: where
the server is, its API key, request bodies, the SSE stream, and the client-side clock of a reply.

Timing follows vLLM's serving benchmark so figures are comparable: TTFT is request sent to the
first chunk carrying text, ITL the gaps between text chunks, TPOT the time after the first token
divided by the remaining output tokens (counted by the server's `usage` when it reports one).
"""
from __future__ import annotations

import codecs
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from pdchat.chatapp.backends.metrics_parsers import llamacpp_timings

API_KEY_ENV = ("PDCHAT_API_KEY", "OPENAI_API_KEY")
# Connecting fails fast; a reply may take long between chunks (a long prefill, a full queue).
TIMEOUT = httpx.Timeout(connect=10.0, read=600.0, write=60.0, pool=600.0)


class RemoteError(Exception):
    """The server is unreachable or refused the request; the message is fit for a user."""


def api_key_from_env() -> str | None:
    return next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)


@dataclass
class Endpoint:
    root: str                       # http(s)://host:port, where /metrics and /health live
    api_key: str | None = None

    @classmethod
    def parse(cls, url: str, api_key: str | None = None) -> "Endpoint":
        """Accepts the server root or its /v1 base, as users copy either."""
        wanted = f"--backend wants an http(s) URL like http://127.0.0.1:8000, got {url!r}"
        try:
            parts = urlsplit(url.strip())
            root = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix('/v1')}"
            parts.port                               # raises for a port that is no number, or out of range
            httpx.URL(root)                          # what httpx would refuse later, with a traceback
        except (ValueError, httpx.InvalidURL) as e:
            raise RemoteError(f"{wanted} ({e})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RemoteError(wanted)
        return cls(root, api_key if api_key is not None else api_key_from_env())

    @property
    def v1(self) -> str:
        return f"{self.root}/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def error_message(status: int, body: bytes) -> str:
    """OpenAI's error object (or whatever the server sent) as one line."""
    try:
        data = json.loads(body)
        message = data["error"]["message"] if isinstance(data.get("error"), dict) else data.get("error") or data
    except (ValueError, AttributeError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()[:300] or "no details"
    return f"HTTP {status}: {message}"


def model_ids(endpoint: Endpoint, body: bytes) -> list[str]:
    """The ids in a /v1/models reply."""
    try:
        return [str(m["id"]) for m in json.loads(body).get("data") or []]
    except (ValueError, AttributeError, KeyError, TypeError):
        raise RemoteError(f"{endpoint.root}/v1/models did not answer with a model list: "
                          f"is it an OpenAI-compatible server?") from None


def connect_error(endpoint: Endpoint, e: httpx.HTTPError) -> RemoteError:
    return RemoteError(f"cannot reach {endpoint.root}: {e or type(e).__name__}")


def request_body(model: str, *, chat: bool, prompt: str | list[dict[str, str]], max_tokens: int,
                 temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 seed: int | None = None, ignore_eos: bool = False) -> dict[str, Any]:
    """A streaming request asking for usage at the end. Non-standard fields (top_k, min_p, ignore_eos;
    vLLM, SGLang and llama.cpp take them) are sent only when set, so OpenAI itself accepts the rest."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                            "top_p": top_p, "stream": True, "stream_options": {"include_usage": True}}
    body["messages" if chat else "prompt"] = prompt
    if seed is not None:
        body["seed"] = seed
    if top_k:
        body["top_k"] = top_k
    if min_p:
        body["min_p"] = min_p
    if ignore_eos:
        body["ignore_eos"] = True
    return body


_LINE_END = re.compile("\r\n|\r|\n")


class SSEDecoder:
    """Server-sent events from the raw bytes of a stream, as the WHATWG spec reads them.

    Lines end at CR, LF or CRLF and nowhere else: U+0085 and U+2028, which Python's splitlines()
    and httpx's iter_lines() also break at, are text inside a `data:` value (a server writing
    JSON with ensure_ascii=False sends them raw). An event is its `data:` lines joined by "\n",
    dispatched at a blank line; comments (`:`), other fields and an unfinished last event are
    dropped, as a browser's EventSource does."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8-sig")("replace")   # -sig: a leading BOM is dropped
        self._tail = ""              # text after the last line end
        self._after_cr = False       # the last chunk ended with CR: an LF starting the next is its pair
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The data of each event this chunk completes."""
        text = self._utf8.decode(chunk)
        if not text:
            return []                # a chunk that ends inside a UTF-8 sequence may decode to nothing
        if self._after_cr and text.startswith("\n"):
            text = text[1:]
        self._after_cr = text.endswith("\r")
        *lines, self._tail = _LINE_END.split(self._tail + text)
        return [data for line in lines if (data := self._line(line)) is not None]

    def _line(self, line: str) -> str | None:
        if not line:
            data, self._data = self._data, []
            return "\n".join(data) if data else None
        name, _, value = line.partition(":")
        if name == "data":           # also drops comments: their name is ""
            self._data.append(value.removeprefix(" "))
        return None


def event_payload(data: str) -> dict[str, Any] | None:
    """The JSON object an OpenAI stream event carries; None for the final [DONE] and empty events."""
    if data.strip() in ("", "[DONE]"):
        return None
    try:
        event = json.loads(data)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise RemoteError(f"the server sent a malformed stream event: {data[:200]!r}")
    return event


def stream_events(sse: SSEDecoder, chunk: bytes) -> list[dict[str, Any]]:
    """The JSON objects of the events `chunk` completes, for a client reading the raw bytes."""
    return [event for data in sse.feed(chunk) if (event := event_payload(data)) is not None]


def _dict_or(value: Any, default: dict[str, Any] | None) -> dict[str, Any] | None:
    return value if isinstance(value, dict) and value else default


@dataclass
class Reply:
    """One streamed reply as the client saw it, on the perf_counter clock."""
    t_start: float
    chunk_times: list[float] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    t_end: float | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None      # llama.cpp's server-side timings

    def feed(self, event: dict[str, Any], t: float) -> str:
        """Take one stream event; returns the text it adds."""
        if "error" in event:
            err = event["error"]
            raise RemoteError(f"the server failed mid-stream: {err.get('message') if isinstance(err, dict) else err}")
        text = ""
        try:
            for choice in event.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except (AttributeError, TypeError):     # off the OpenAI schema: end the reply, not the reader thread
            raise RemoteError(f"the server sent a stream event pdchat cannot read: {json.dumps(event)[:200]}") from None
        self.usage = _dict_or(event.get("usage"), self.usage)
        self.timings = _dict_or(event.get("timings"), self.timings)
        if text:
            self.chunk_times.append(t)
            self.parts.append(text)
        return text

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def output_tokens(self) -> int:
        # Without usage, a chunk per token is the best count there is (servers stream one each).
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        return len(self.chunk_times)

    @property
    def ttft_ms(self) -> float | None:
        return (self.chunk_times[0] - self.t_start) * 1000 if self.chunk_times else None

    @property
    def itl_ms(self) -> list[float]:
        return [(b - a) * 1000 for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def e2e_ms(self) -> float | None:
        return None if self.t_end is None else (self.t_end - self.t_start) * 1000

    def metrics(self) -> dict[str, Any]:
        """RequestMetrics fields, measured client-side; what only the server knows is None
        unless it reported it (usage, llama.cpp timings)."""
        n = self.output_tokens
        times = self.chunk_times
        decode_ms = (times[-1] - times[0]) * 1000 if len(times) > 1 else None
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        m: dict[str, Any] = {
            "queue_ms": None, "ttft_ms": self.ttft_ms, "prefill_ms": None,
            "prompt_tokens": usage.get("prompt_tokens"), "cached_prompt_tokens": details.get("cached_tokens"),
            "prefill_tok_s": None, "output_tokens": n, "decode_ms": decode_ms,
            "tpot_ms": decode_ms / (n - 1) if decode_ms is not None and n > 1 else None,
            "decode_tok_s": (n - 1) / (decode_ms / 1000) if decode_ms and n > 1 else None,
            "itl_ms": self.itl_ms, "spec_method": None, "spec_drafted": None, "spec_accepted": None,
            "spec_steps": None, "spec_acceptance": None, "spec_mean_accepted": None,
            "preemptions": None, "finish_reason": self.finish_reason,
        }
        if self.timings:
            m.update(llamacpp_timings(self.timings))
        return m
