"""Every way a request can end badly, as OpenAI's error object with the status that says whose
fault it was: the client's (4xx: a prompt too long, a request that can never fit the KV pool), the
server's (500: an engine fault such as non-finite logits), or nobody's (503: shutting down, cancelled;
retry). One place decides the mapping, for plain responses and for the final event of a stream."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pdchat.engine import Completion, ContextTooLong, EngineClosed, InvalidRequest

from pdchat.chatapp.serve.protocol import APIError, ErrorResponse

SHUTTING_DOWN = "server_shutting_down"


def shutting_down() -> APIError:
    return APIError(503, "server shutting down", type_="server_error", code=SHUTTING_DOWN)


def completion_error(c: Completion, *, closing: bool) -> APIError | None:
    """What a finished request is to its client: None for a normal finish (stop, length), else
    the error. closing: the HTTP server is stopping (its own cancellations say so)."""
    if c.finish_reason == "error":
        if isinstance(c.exception, InvalidRequest):     # e.g. it outgrew the whole KV pool
            return APIError(400, c.error or "invalid request")
        return APIError(500, c.error or "generation failed", type_="server_error")
    if c.finish_reason == "cancelled":
        if closing:
            return shutting_down()
        return APIError(503, c.error or "the request was cancelled", type_="server_error")
    return None


def submit_error(e: InvalidRequest | EngineClosed, path: str) -> APIError:
    """An engine exception raised while a request was submitted. path: the URL path, which says
    whether the prompt came as chat messages or as a prompt."""
    if isinstance(e, ContextTooLong):
        param = "messages" if "/chat/" in path else "prompt"
        return APIError(400, str(e), param=param, code="context_length_exceeded")
    if isinstance(e, EngineClosed):
        return APIError(503, str(e), type_="server_error")
    return APIError(400, str(e))


def add_error_handlers(app: FastAPI) -> None:
    """Turn every exception a route can raise into the error object (the last-resort middleware
    takes whatever escapes these)."""

    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return ErrorResponse(e)

    async def engine_error(request: Request, e: InvalidRequest | EngineClosed) -> JSONResponse:
        return ErrorResponse(submit_error(e, request.url.path))

    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return ErrorResponse(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(InvalidRequest, engine_error)      # ContextTooLong and KVCacheTooSmall too
    app.add_exception_handler(EngineClosed, engine_error)
    app.add_exception_handler(HTTPException, http_error)
