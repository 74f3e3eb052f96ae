"""`pdchat serve`: the OpenAI-compatible HTTP API over one Engine (FastAPI + uvicorn).

Handlers run on the event loop and never block it: tokenizing and submitting run in the thread
pool, and each request's events arrive through a Flight. Concurrent requests meet in the engine's
continuous batching. Every failure is OpenAI's error object (a 4xx where the client is at fault,
a JSON 500 for anything unexpected); a client that goes away mid-request cancels it, which frees
its KV blocks. The Guard refuses what web pages and oversized bodies could do before any route
runs; listen.py bounds the connections themselves.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Hashable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Receive, Scope, Send

from pdchat.engine import Completion, Engine, EngineConfig, SamplingParams, TokenEvent

from pdchat.chatapp.serve import protocol
from pdchat.chatapp.serve.auth import Keys
from pdchat.chatapp.serve.errors import add_error_handlers, completion_error, shutting_down
from pdchat.chatapp.serve.flight import Flight
from pdchat.chatapp.serve.guard import Guard
from pdchat.chatapp.serve.last_resort import LastResort
from pdchat.chatapp.serve.listen import bind, http_server
from pdchat.chatapp.serve.options import DEFAULT_MAX_PENDING, ServeOptions
from pdchat.chatapp.serve.prometheus import CONTENT_TYPE, ServerMetrics
from pdchat.chatapp.serve.protocol import APIError, ChatRequest, CompletionRequest, Shape

# How often a non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25
# Text runs 3 to 5 characters per token; a prompt with more than this many characters per token
# of the context would not fit with any tokenizer we know of, and is refused before the tokenizer
# spends seconds on it (and slows every other request meanwhile).
MAX_CHARS_PER_TOKEN = 16


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
    def __init__(self, engine: Engine, *, model_name: str | None = None, keys: Keys = Keys(()),
                 max_pending: int = DEFAULT_MAX_PENDING, shared_prefix_cache: bool = False):
        self.engine = engine
        self.model_name = model_name or engine.config.model
        self.keys = keys
        self.max_pending = max_pending
        self.shared_prefix_cache = shared_prefix_cache
        self.in_flight = 0          # admitted and not finished in the engine; touched on the loop only
        self.flights: set[Flight] = set()     # those of them already submitted
        self.closing = False
        self.started = int(time.time())
        self.metrics = ServerMetrics(engine.stats)

    def shut_down(self) -> None:
        """The HTTP server is stopping: open requests end now, with a 503 error (a final error
        event and [DONE] on a stream), and new ones are refused."""
        self.closing = True
        for flight in list(self.flights):
            flight.cancel()

    # ---- admission ---------------------------------------------------------------------------
    def _authorize(self, request: Request) -> int | None:
        """The request's tenant (its key's index), or None where the server needs no key."""
        return self.keys.tenant(request.headers.get("authorization"))

    def _namespace(self, tenant: int | None, salt: str | None) -> Hashable:
        """The prefix-cache namespace: requests share cached blocks only within one."""
        if self.shared_prefix_cache:
            tenant = None
        return None if tenant is None and salt is None else (tenant, salt)

    def _check_size(self, prompt: Any, param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit the context window."""
        if isinstance(prompt, str):
            chars = len(prompt)
        elif prompt and isinstance(prompt[0], dict):
            chars = sum(len(m["content"]) for m in prompt)
        else:
            return                  # token ids: the engine compares their count at no cost
        limit = self.engine.max_model_len * MAX_CHARS_PER_TOKEN
        if chars > limit:
            raise APIError(400, f"prompt is {chars:,} characters, more than the context window of "
                                f"{self.engine.max_model_len} tokens can hold (at most {MAX_CHARS_PER_TOKEN} "
                                f"characters per token, {limit:,} in all); it was not tokenized",
                           param=param, code="context_length_exceeded")

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model '{model}' is not served here; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def _sampling(self, req: ChatRequest | CompletionRequest, max_tokens: int | None) -> SamplingParams:
        # No max_tokens: until the context is full (the engine stops there), as OpenAI does.
        return SamplingParams(max_tokens=max_tokens or self.engine.max_model_len, temperature=req.temperature,
                              top_p=req.top_p, top_k=max(req.top_k, 0), min_p=req.min_p, seed=req.seed,
                              stop=req.stop_list(), ignore_eos=req.ignore_eos)

    def _submit(self, prompt: Any, params: SamplingParams, raw_text: bool, namespace: Hashable) -> Any:
        """Runs in the thread pool: tokenizing a long prompt must not stall the event loop."""
        if raw_text and isinstance(prompt, str):
            # /v1/completions continues the text as it is: no chat template.
            prompt = self.engine.tokenizer.encode(prompt) if prompt else []
        return self.engine.submit(prompt, params, namespace=namespace)

    async def _admit(self, prompt: Any, params: SamplingParams, *, raw_text: bool, tokens: bool,
                     namespace: Hashable, t0: float) -> Flight:
        if self.closing:
            raise shutting_down()
        if self.in_flight >= self.max_pending:
            self.metrics.rejected.labels("503").inc()
            raise APIError(503, f"server busy: {self.in_flight} requests in flight (limit {self.max_pending}); "
                                "retry later", type_="server_error", code="server_busy")
        self.in_flight += 1             # before the await, so a burst cannot overshoot the limit
        try:
            stream = await run_in_threadpool(self._submit, prompt, params, raw_text, namespace)
        except BaseException:
            self.in_flight -= 1
            raise
        flight = Flight(stream, lambda c: self._finished(flight, c, t0), tokens=tokens)
        self.flights.add(flight)
        if self.closing:                # shut_down ran while this one was being submitted
            flight.cancel()
        return flight

    def _finished(self, flight: Flight, completion: Completion, t0: float) -> None:
        self.in_flight -= 1
        self.flights.discard(flight)
        self.metrics.observe(completion.metrics, (time.perf_counter() - t0) * 1000)

    # ---- endpoints ---------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        t0 = time.perf_counter()
        tenant = self._authorize(request)
        req: ChatRequest = protocol.parse(ChatRequest, await request.body())
        self._check_model(req.model)
        params = self._sampling(req, req.requested_max_tokens())
        messages = [m.as_engine_message() for m in req.messages]
        self._check_size(messages, "messages")
        flight = await self._admit(messages, params, raw_text=False, tokens=req.stream,
                                   namespace=self._namespace(tenant, req.cache_salt), t0=t0)
        return await self._respond(request, req, flight, Shape(True, self.model_name))

    async def completions(self, request: Request) -> Response:
        t0 = time.perf_counter()
        tenant = self._authorize(request)
        req: CompletionRequest = protocol.parse(CompletionRequest, await request.body())
        self._check_model(req.model)
        params = self._sampling(req, req.requested_max_tokens())
        prompt = req.prompt_value()
        self._check_size(prompt, "prompt")
        flight = await self._admit(prompt, params, raw_text=True, tokens=req.stream,
                                   namespace=self._namespace(tenant, req.cache_salt), t0=t0)
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
        if error := completion_error(c, closing=self.closing):
            raise error
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
            if error := completion_error(c, closing=self.closing):
                yield protocol.sse(error.body())
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

    async def metrics_text(self, request: Request) -> Response:
        self._authorize(request)            # it names the model and the device, and counts the traffic
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def create_app(engine: Engine, *, model_name: str | None = None, api_key: str | None = None,
               max_pending: int = DEFAULT_MAX_PENDING, options: ServeOptions = ServeOptions()) -> FastAPI:
    """The API over engine. api_key: one key to require besides options.api_keys (a shorthand)."""
    keys = Keys(((api_key,) if api_key else ()) + options.api_keys)
    server = Server(engine, model_name=model_name, keys=keys, max_pending=max_pending,
                    shared_prefix_cache=options.shared_prefix_cache)
    origins = tuple(o.lower().rstrip("/") for o in options.allowed_origins)     # as browsers write them
    middleware = [Middleware(LastResort), Middleware(Guard, limits=options.limits, allowed_hosts=options.allowed_hosts,
                                                     allowed_origins=origins)]
    if origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    app = FastAPI(title="pdchat", docs_url=None, redoc_url=None, openapi_url=None, middleware=middleware)
    app.state.server = server

    add_error_handlers(app)
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_text, methods=["GET"])
    return app


def serve(config: EngineConfig, *, host: str, port: int, max_pending: int = DEFAULT_MAX_PENDING,
          model_name: str | None = None, options: ServeOptions = ServeOptions()) -> None:
    """Listen, load the engine, then serve until interrupted. Raises ServeError (a taken port)."""
    sock = bind(host, port)
    # Clients reach the server by the name it was told to listen on, too.
    options = replace(options, allowed_hosts=options.allowed_hosts + (host,))
    with sock, Engine(config) as engine:
        app = create_app(engine, model_name=model_name, max_pending=max_pending, options=options)
        server = app.state.server
        keys = f"{len(options.api_keys)} API key(s) accepted; " if options.api_keys else ""
        address = f"[{host}]" if ":" in host else host          # an IPv6 address
        print(f"pdchat serve: {server.model_name} on {engine.device} at http://{address}:{sock.getsockname()[1]}/v1 "
              f"({keys}metrics at /metrics; Ctrl-C stops)", file=sys.stderr, flush=True)
        if not options.api_keys and host not in ("127.0.0.1", "localhost", "::1"):
            print("pdchat serve: warning: listening beyond loopback without an API key", file=sys.stderr, flush=True)
        # Ctrl+C is how a server stops: uvicorn shuts down, then raises the signal again for us.
        with contextlib.suppress(KeyboardInterrupt):
            http_server(app, options.limits, server.shut_down).run(sockets=[sock])
