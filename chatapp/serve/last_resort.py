"""The last resort (pure ASGI middleware): an exception no handler expected answers its request
with OpenAI's JSON 500 (or, once an event stream has begun, ends it with that error as its last
event and [DONE]) and is logged with its traceback; other requests never notice.

Starlette's own 500 handler re-raises, and uvicorn then closes the connection, so a keep-alive
client's next request on it would fail too, and a streaming client would see its stream cut.
A client that leaves while it sends its body is no error: there is nobody left to answer.
"""
from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdchat.chatapp.serve.protocol import APIError, ErrorResponse, sse

log = logging.getLogger("uvicorn.error")        # where the server's other errors go


class LastResort:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = streaming = ended = False

        async def watched_send(message: Message) -> None:
            nonlocal started, streaming, ended
            if message["type"] == "http.response.start":
                started = True
                streaming = dict(message["headers"]).get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                ended = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except ClientDisconnect:
            return
        except Exception as e:
            log.exception("unexpected error in %s %s", scope["method"], scope["path"])
            error = APIError(500, f"internal server error ({type(e).__name__}); see the server's log",
                             type_="server_error")
            if not started:
                await ErrorResponse(error)(scope, receive, send)
            elif streaming and not ended:
                await send({"type": "http.response.body", "body": (sse(error.body()) + sse("[DONE]")).encode(),
                            "more_body": False})
            else:                       # too late for an error object: uvicorn closes the connection
                raise
