"""The checks every request passes before a route sees it (pure ASGI middleware).

A page in the user's browser can reach a server on 127.0.0.1. Without a CORS preflight it can
only send "simple" requests (a form's content types, or none), and by DNS rebinding it can make
its own domain name point here and read the answers. So the Host header must name this server
(an IP address, localhost or an allowed name: a rebinding page's Host is its own domain), a
request from a page (it carries an Origin header) must come from an allowed origin, and a POST
must say its body is JSON. This is the hole Ollama closed in 2024 (CVE-2024-28224).

The body is bounded before it is parsed: its declared length, then the bytes that arrive (a
chunked upload has no length), and the time they take to arrive.
"""
from __future__ import annotations

import asyncio
import ipaddress
from typing import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdchat.chatapp.serve.options import Limits
from pdchat.chatapp.serve.protocol import APIError, ErrorResponse


def host_name(host: str) -> str:
    """The name or address in a Host header value: no port, no brackets, lower case."""
    if host.startswith("["):                                    # [v6 address]:port
        name = host[1:].split("]", 1)[0]
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name.lower().rstrip(".")


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    """Whether a Host header value names this server: an IP address (which no page can rebind to
    another machine), localhost, or an allowed name ("*": any)."""
    name = host_name(host)
    allowed_names = {host_name(a) for a in allowed}
    if name == "localhost" or "*" in allowed_names or name in allowed_names:
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class Guard:
    def __init__(self, app: ASGIApp, *, limits: Limits, allowed_hosts: Iterable[str] = (),
                 allowed_origins: Iterable[str] = ()):
        self.app = app
        self.limits = limits
        self.allowed_hosts = tuple(allowed_hosts)
        self.allowed_origins = tuple(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_head(scope)
        except APIError as e:
            await ErrorResponse(e)(scope, receive, send)
            return
        await self.app(scope, self._bounded(receive), send)

    def _check_head(self, scope: Scope) -> None:
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        for name, value in headers:
            if name == "host" and not host_allowed(value, self.allowed_hosts):
                raise APIError(403, f"Host {value!r} is not a name of this server (start it with "
                                    f"--allowed-hosts {host_name(value)} to accept it)", code="host_not_allowed")
            if name == "origin" and "*" not in self.allowed_origins and value.lower() not in self.allowed_origins:
                raise APIError(403, f"requests from web pages (Origin {value!r}) are refused; start the server "
                                    f"with --allowed-origins {value} to allow that page", code="origin_not_allowed")
        if scope["method"] != "POST":
            return
        fields = dict(headers)
        media_type = fields.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, f"the body must be JSON, sent with 'Content-Type: application/json' "
                                f"(got {fields.get('content-type', 'none')!r})", code="unsupported_media_type")
        length = fields.get("content-length", "")
        if length.isdigit() and int(length) > self.limits.max_body_bytes:
            raise self._too_large()

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.limits.max_body_bytes:,} bytes "
                             f"(the server's --max-body-mb)", code="request_too_large")

    def _bounded(self, receive: Receive) -> Receive:
        """receive, refusing a body that grows past the limit or is not all there in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.read_timeout_s
        received = 0
        done = False

        async def bounded_receive() -> Message:
            nonlocal received, done
            if done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.limits.read_timeout_s:g} s",
                               code="request_timeout") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limits.max_body_bytes:
                    raise self._too_large()
                done = not message.get("more_body", False)
            return message

        return bounded_receive
