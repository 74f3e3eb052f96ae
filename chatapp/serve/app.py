"""`pdchat serve`: the OpenAI-compatible HTTP API over one Engine (FastAPI + uvicorn).

Handlers run on the event loop and never block it: tokenizing and submitting run in the thread
pool, and each request's events arrive through a Flight. Concurrent requests meet in the engine's
continuous batching. Every failure is OpenAI's error object; a client that goes away mid-request
cancels it, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import hmac
import sys
import time
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from pdchat.engine import (Completion, ContextTooLong, Engine, EngineClosed, EngineConfig, InvalidRequest,
                           SamplingParams, TokenEvent)

from . import protocol
from .flight import Flight
from .prometheus import CONTENT_TYPE, ServerMetrics
from .protocol import APIError, ChatRequest, CompletionRequest, Shape

DEFAULT_MAX_PENDING = 256
# How often a non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


class _FlightResponse(StreamingResponse):
    """An SSE response that cancels its engine request however the response ends (client gone
    included: Starlette then abandons the body iterator without closing it)."""

    def __init__(self, body: AsyncIterator[str], flight: Flight):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.flight = flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.flight.cancel()


class Server:
    def __init__(self, engine: Engine, *, model_name: str | None = None, api_key: str | None = None,
                 max_pending: int = DEFAULT_MAX_PENDING):
        self.engine = engine
        self.model_name = model_name or engine.config.model
        self.api_key = api_key
        self.max_pending = max_pending
        self.in_flight = 0          # admitted and not finished in the engine; touched on the loop only
        self.started = int(time.time())
        self.metrics = ServerMetrics(engine.stats)

    # ---- admission ---------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model '{model}' is not served here; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def _sampling(self, req: ChatRequest | CompletionRequest, max_tokens: int | None) -> SamplingParams:
        # No max_tokens: until the context is full (the engine stops there), as OpenAI does.
        return SamplingParams(max_tokens=max_tokens or self.engine.max_model_len, temperature=req.temperature,
                              top_p=req.top_p, top_k=max(req.top_k, 0), min_p=req.min_p, seed=req.seed,
                              stop=req.stop_list(), ignore_eos=req.ignore_eos)

    def _submit(self, prompt: Any, params: SamplingParams, raw_text: bool) -> Any:
        """Runs in the thread pool: tokenizing a long prompt must not stall the event loop."""
        if raw_text and isinstance(prompt, str):
            # /v1/completions continues the text as it is: no chat template.
            prompt = self.engine.tokenizer.encode(prompt) if prompt else []
        return self.engine.submit(prompt, params)

    async def _admit(self, prompt: Any, params: SamplingParams, *, raw_text: bool, tokens: bool,
                     t0: float) -> Flight:
        if self.in_flight >= self.max_pending:
            self.metrics.rejected.labels("503").inc()
            raise APIError(503, f"server busy: {self.in_flight} requests in flight (limit {self.max_pending}); "
                                "retry later", type_="server_error", code="server_busy")
        self.in_flight += 1             # before the await, so a burst cannot overshoot the limit
        try:
            stream = await run_in_threadpool(self._submit, prompt, params, raw_text)
        except BaseException:
            self.in_flight -= 1
            raise
        return Flight(stream, lambda c: self._finished(c, t0), tokens=tokens)

    def _finished(self, completion: Completion, t0: float) -> None:
        self.in_flight -= 1
        self.metrics.observe(completion.metrics, (time.perf_counter() - t0) * 1000)

    # ---- endpoints ---------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        t0 = time.perf_counter()
        self._authorize(request)
        req: ChatRequest = protocol.parse(ChatRequest, await request.body())
        self._check_model(req.model)
        params = self._sampling(req, req.requested_max_tokens())
        messages = [m.as_engine_message() for m in req.messages]
        flight = await self._admit(messages, params, raw_text=False, tokens=req.stream, t0=t0)
        return await self._respond(request, req, flight, Shape(True, self.model_name))

    async def completions(self, request: Request) -> Response:
        t0 = time.perf_counter()
        self._authorize(request)
        req: CompletionRequest = protocol.parse(CompletionRequest, await request.body())
        self._check_model(req.model)
        params = self._sampling(req, req.requested_max_tokens())
        flight = await self._admit(req.prompt_value(), params, raw_text=True, tokens=req.stream, t0=t0)
        return await self._respond(request, req, flight, Shape(False, self.model_name))

    async def _respond(self, request: Request, req: ChatRequest | CompletionRequest, flight: Flight,
                       shape: Shape) -> Response:
        if req.stream:
            return _FlightResponse(self._sse(flight, shape, req.include_usage), flight)
        while not flight.completion.done():
            await asyncio.wait({flight.completion}, timeout=DISCONNECT_POLL_S)
            if not flight.completion.done() and await request.is_disconnected():
                flight.cancel()
                return Response(status_code=499)      # nobody is listening any more
        c = flight.completion.result()
        _raise_for(c)
        m = c.metrics
        return JSONResponse(shape.response(c.text, c.finish_reason,
                                           protocol.usage(m.prompt_tokens, m.output_tokens, m.cached_prompt_tokens)))

    async def _sse(self, flight: Flight, shape: Shape, include_usage: bool) -> AsyncIterator[str]:
        sent = 0
        if shape.chat:
            yield protocol.sse(shape.chunk("", role=True))
        async for ev in flight.events():
            if isinstance(ev, TokenEvent):
                if ev.text:
                    sent += len(ev.text)
                    yield protocol.sse(shape.chunk(ev.text))
                continue
            c = ev.completion
            try:
                _raise_for(c)
            except APIError as e:
                yield protocol.sse(e.body())
                break
            # the completion's text is authoritative: it may extend the deltas (held-back text)
            yield protocol.sse(shape.chunk(c.text[sent:] or None, c.finish_reason))
            if include_usage:
                m = c.metrics
                yield protocol.sse(shape.usage_chunk(
                    protocol.usage(m.prompt_tokens, m.output_tokens, m.cached_prompt_tokens)))
        yield protocol.sse("[DONE]")

    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.started,
                                            "owned_by": "pdchat", "max_model_len": self.engine.max_model_len}]}


def _raise_for(c: Completion) -> None:
    """A request the engine ended with an error (or by shutting down) is an error for the client."""
    if c.finish_reason == "error":
        raise APIError(500, c.error or "generation failed", type_="server_error")
    if c.finish_reason == "cancelled":
        raise APIError(503, c.error or "the request was cancelled", type_="server_error")


def _error(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def create_app(engine: Engine, *, model_name: str | None = None, api_key: str | None = None,
               max_pending: int = DEFAULT_MAX_PENDING) -> FastAPI:
    server = Server(engine, model_name=model_name, api_key=api_key, max_pending=max_pending)
    app = FastAPI(title="pdchat", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(ContextTooLong)
    async def too_long(request: Request, e: ContextTooLong) -> JSONResponse:
        param = "messages" if "/chat/" in request.url.path else "prompt"
        return _error(APIError(400, str(e), param=param, code="context_length_exceeded"))

    @app.exception_handler(InvalidRequest)
    async def invalid(request: Request, e: InvalidRequest) -> JSONResponse:
        return _error(APIError(400, str(e)))

    @app.exception_handler(EngineClosed)
    async def closed(request: Request, e: EngineClosed) -> JSONResponse:
        return _error(APIError(503, str(e), type_="server_error"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return _error(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))

    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
    app.add_api_route("/metrics", lambda: Response(server.metrics.render(), media_type=CONTENT_TYPE),
                      methods=["GET"])
    return app


def serve(config: EngineConfig, *, host: str, port: int, api_key: str | None, max_pending: int,
          model_name: str | None = None) -> None:
    """Load the engine, then serve until interrupted."""
    with Engine(config) as engine:
        app = create_app(engine, model_name=model_name, api_key=api_key, max_pending=max_pending)
        name = app.state.server.model_name
        print(f"pdchat serve: {name} on {engine.device} at http://{host}:{port}/v1 "
              f"(metrics at /metrics; Ctrl-C stops)", file=sys.stderr, flush=True)
        if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
            print("pdchat serve: warning: listening beyond loopback without --api-key", file=sys.stderr, flush=True)
        # Open streams must not hold a shutdown forever; the engine then cancels what is left.
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
