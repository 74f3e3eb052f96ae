"""The HTTP server under the app: the listening socket, the connection rules uvicorn lacks, and a
shutdown that ends open requests with an error event instead of cutting them.

uvicorn's h11 protocol waits forever for a request's head: a connection that sends nothing, or
half a head a byte at a time, holds its socket for good. Here a connection that is not running a
request must deliver a complete head within the read timeout, however it trickles bytes (the
body has its own deadline in the Guard). Connections past the limit get OpenAI's JSON 503, and
malformed HTTP a JSON 400, instead of uvicorn's plain-text answers.
"""
from __future__ import annotations

import asyncio
import errno
import json
import socket
from functools import partial
from typing import Any, Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdchat.chatapp.serve.options import Limits, ServeError
from pdchat.chatapp.serve.protocol import APIError, ErrorResponse

BACKLOG = 2048
# After a shutdown ended the open requests, how long their connections may take to close.
GRACEFUL_SHUTDOWN_S = 5


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one), made before the model loads: a taken port is one
    line, not a traceback after the banner."""
    where = f"{host}:{port}"
    if not 0 <= port <= 65535:          # getaddrinfo would take 70000 for 4464
        raise ServeError(f"cannot listen on {where}: a port is a number from 0 to 65535 (0: any free port)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ServeError(f"cannot listen on {where}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # a port in TIME_WAIT is free
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        hint = " (another program is listening there; pick another --port)" if e.errno == errno.EADDRINUSE else ""
        raise ServeError(f"cannot listen on {where}: {e.strerror}{hint}") from None
    return sock


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args: Any, limits: Limits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            # Answer its first request with a 503 (reading it first, so the client sees the
            # answer rather than a reset), then close.
            self.app = ErrorResponse(APIError(
                503, f"too many connections (the server's limit is {self.limits.max_connections}); retry later",
                type_="server_error", code="server_busy"), close=True)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # msg is uvicorn's constant "Invalid HTTP request received."; h11 keeps the reason to itself
        body = json.dumps(APIError(400, "malformed HTTP request: the server could not parse it").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _watch(self) -> None:
        """Arm the head deadline while no request runs; it is not re-armed by arriving bytes."""
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()
        elif self._head_deadline is None and not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self.limits.read_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _expire(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class Server(uvicorn.Server):
    """uvicorn's server, calling on_shutdown (which ends the open requests) before it waits for
    their connections: otherwise an open stream holds the shutdown until uvicorn cancels it, cut
    without a final event and with a CancelledError traceback in the log."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets=sockets)


def http_server(app: Any, limits: Limits, on_shutdown: Callable[[], None]) -> Server:
    """A server for app; start it with .run(sockets=[bind(host, port)])."""
    config = uvicorn.Config(app, http=partial(GuardedH11Protocol, limits=limits), ws="none", lifespan="off",
                            log_level="warning", access_log=False, timeout_keep_alive=limits.keep_alive_s,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return Server(config, on_shutdown)
