"""What `pdchat serve` lets clients do: keys, the names and web pages it answers, and its limits.

The defaults are for a server on this machine that only local programs use: no web page may drive
it, and no client can make it read, parse or hold more than a bounded amount.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Requests admitted at once, running and waiting; more get HTTP 503 (`--max-pending`).
DEFAULT_MAX_PENDING = 256


def comma_list(text: str) -> tuple[str, ...]:
    """'a, b,c' -> ('a', 'b', 'c'): the form of --allowed-hosts and --allowed-origins."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


class ServeError(Exception):
    """A serve setting that cannot work (a taken port, an unreadable keys file): one line for the user."""


@dataclass(frozen=True)
class Limits:
    # A prompt that fills a 128K context is under 1 MB of JSON; 4 MiB leaves room for escaping.
    max_body_bytes: int = 4 * 2**20
    # For a request's head, and again for its body; a connection that is slower is closed (or 408).
    read_timeout_s: float = 30.0
    max_connections: int = 512
    # Idle time allowed between two requests on one connection (uvicorn's default).
    keep_alive_s: float = 5.0


@dataclass(frozen=True)
class ServeOptions:
    # The accepted API keys (see auth.load_keys), one tenant each; none: no key is required.
    api_keys: tuple[str, ...] = ()
    # False: each API key (tenant) sees only its own cached prefixes, so cached_tokens tells it
    # nothing about what other tenants sent; True trades that for hits across tenants.
    shared_prefix_cache: bool = False
    # Host header names accepted besides IP addresses and localhost; "*" accepts any.
    allowed_hosts: tuple[str, ...] = ()
    # Web page origins (scheme://host:port) allowed to call the API, with CORS; "*" allows any.
    allowed_origins: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
