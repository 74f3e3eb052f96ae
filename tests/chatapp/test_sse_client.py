"""The client reads SSE as the spec does: lines end at CR, LF or CRLF only, so U+0085 and U+2028
inside a `data:` value are text. Checked on the decoder with every chunking of a stream, and on
both client paths (`pdchat run --backend`, `pdchat bench serve`) against a server that writes
them raw, with CR and CRLF line ends and events cut at awkward places."""
from __future__ import annotations

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from pdchat.chatapp.cli.main import main
from pdchat.chatapp.backends.openai_client import RemoteError, Reply, SSEDecoder, event_payload

from .loopback import running

# Python's str.splitlines() (and httpx's iter_lines) break at all of these; SSE breaks at none.
ODD = "a\x85b\u2028c\u2029d\x0be\x0cf\x1cg"
TEXT = f"Hi {ODD} caf\u00e9 \U0001F600"


def decode(chunks: list[bytes]) -> list[str]:
    sse = SSEDecoder()
    return [data for chunk in chunks for data in sse.feed(chunk)]


def every_split(stream: bytes) -> list[list[bytes]]:
    """The stream in two chunks at every position, and one byte at a time."""
    return [[stream[:i], stream[i:]] for i in range(len(stream) + 1)] + [[bytes([b]) for b in stream]]


STREAM = ("\ufeff: a comment, then an event with two data lines\r\n"
          f"data: {ODD}\r\n"
          "data:second\r\n"
          "\r\n"
          "event: ignored\rid: 7\rretry: 10\rdata: cr ends\r\r"
          "data\n\n"                     # a field with no colon: empty data, still an event
          "data: lf ends \u00e9\n\n"
          "data: unfinished, dropped at the end").encode()
EVENTS = [f"{ODD}\nsecond", "cr ends", "", "lf ends \u00e9"]


@pytest.mark.parametrize("chunks", every_split(STREAM), ids=lambda c: f"{len(c[0])}|{len(c)}")
def test_decoder_gives_the_same_events_however_the_stream_is_cut(chunks):
    assert decode(chunks) == EVENTS


def test_cr_at_a_chunk_end_then_lf_is_one_line_end():
    # CR LF split across chunks must not read as CR, then an empty line (which would end the event).
    assert decode([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]) == ["a\nb"]
    assert decode([b"data: a\r", b"", b"\r"]) == ["a"]          # an empty chunk keeps the pending CR


def test_event_payload():
    assert event_payload('{"a": "\x85"}') == {"a": "\x85"}
    assert event_payload("[DONE]") is None and event_payload("") is None
    for bad in ('{"a": ', "[1, 2]", "null"):
        with pytest.raises(RemoteError, match="malformed stream event"):
            event_payload(bad)


@pytest.mark.parametrize("event", [{"choices": ["text"]}, {"choices": [{"delta": {"content": 5}}]}])
def test_an_event_off_the_schema_is_a_remote_error(event):
    with pytest.raises(RemoteError, match="cannot read"):
        Reply(0.0).feed(event, 1.0)


# ---- a server that writes the awkward stream ----------------------------------------------------

def awkward_stream(chat: bool) -> list[bytes]:
    """An OpenAI stream of TEXT (one event per character), as raw chunks: JSON with U+0085 and
    U+2028 unescaped, CR, LF and CRLF line ends in turn, cuts inside UTF-8 sequences, between a CR
    and its LF, inside `data:`, and an event spread over two data lines."""
    def event(obj: dict) -> dict:
        return {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "model": "m", **obj}

    def choice(text: str | None, finish: str | None = None) -> dict:
        part = {"delta": {"content": text} if text is not None else {}} if chat else {"text": text or ""}
        return {"index": 0, **part, "finish_reason": finish}

    events = [event({"choices": [choice(ch)]}) for ch in TEXT]
    events.append(event({"choices": [choice(None, "stop")]}))
    events.append(event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(TEXT)}}))
    ends = ["\r\n", "\r", "\n"]
    raw = ""
    for i, obj in enumerate(events):
        end = ends[i % 3]
        body = json.dumps(obj, ensure_ascii=False)
        if i == 1:                                    # one event as two data lines, joined by "\n"
            half = body.index(",") + 1
            raw += f"data: {body[:half]}{end}data: {body[half:]}{end}{end}"
        else:
            raw += f": keep-alive{end}data: {body}{end}{end}"
    raw += "data: [DONE]\r\n\r\n"
    data = raw.encode()
    cuts = sorted({7, len(data) // 3, len(data) // 2}
                  | {i + 1 for i in range(len(data) - 1) if data[i:i + 2] in (b"\r\n", b"\xc2\x85", b"\xe2\x80")})
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


def awkward_server() -> Starlette:
    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def completions(request):
        chat = request.url.path.endswith("/chat/completions")

        async def body():
            for chunk in awkward_stream(chat):
                yield chunk
                await asyncio.sleep(0.001)           # separate writes, so the client reads them apart

        return StreamingResponse(body(), media_type="text/event-stream")

    async def no_metrics(request):
        return PlainTextResponse("", status_code=404)

    return Starlette(routes=[Route("/v1/models", models), Route("/metrics", no_metrics),
                             Route("/v1/chat/completions", completions, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def url():
    with running(awkward_server()) as base:
        yield base


@pytest.fixture(autouse=True)
def _no_api_key(monkeypatch):
    monkeypatch.delenv("PDCHAT_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


def test_the_awkward_stream_is_cut_where_it_hurts():
    # precondition: the stream does carry what the tests claim
    data = b"".join(awkward_stream(chat=True))
    assert "\x85".encode() in data and "\u2028".encode() in data
    assert b"\r\n" in data and b"\r:" in data and b"\n:" in data
    chunks = awkward_stream(chat=True)
    assert any(c.endswith(b"\r") for c in chunks) and any(c.endswith(b"\xc2") for c in chunks)


def test_run_with_backend_reads_the_awkward_stream(url, capsys):
    code = main(["run", "--backend", url, "hi", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["text"] == TEXT and data["finish_reason"] == "stop"
    assert data["metrics"]["output_tokens"] == len(TEXT)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bench_serve_reads_the_awkward_stream(url, capsys, endpoint):
    code = main(["bench", "serve", "--json", "--backend", url, "--requests", "6", "--concurrency", "3",
                 "--endpoint", endpoint])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)["summary"]
    assert (summary["successful_requests"], summary["failed_requests"]) == (6, 0), summary["first_error"]
    assert summary["total_output_tokens"] == 6 * len(TEXT)
