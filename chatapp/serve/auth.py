"""API keys: where they come from (a flag, $PDCHAT_API_KEY, a keys file) and which tenant a request is.

Each accepted key is a tenant; the server salts the prefix cache by tenant, so one key's requests
cannot learn from `cached_tokens` which prompts another key sent.
"""
from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Sequence

from pdchat.chatapp.serve.options import ServeError
from pdchat.chatapp.serve.protocol import APIError

ENV_VAR = "PDCHAT_API_KEY"          # the name pdchat's own client reads too


def load_keys(api_key: str | None, key_file: str | None) -> tuple[str, ...]:
    """--api-key (else $PDCHAT_API_KEY), then every key of --api-key-file: one per line, blank
    lines and '#' comments skipped. A flag shows in `ps`; the other two do not."""
    keys = [api_key or os.environ.get(ENV_VAR) or ""]
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ServeError(f"cannot read the keys file {key_file}: {getattr(e, 'strerror', None) or e}") from None
        in_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not in_file:
            raise ServeError(f"the keys file {key_file} holds no key (one per line)")
        keys += in_file
    keys = [k for k in keys if k]
    for k in keys:
        # An HTTP header carries printable ASCII only: such a key could never be sent.
        if not (k.isascii() and k.isprintable()) or " " in k:
            raise ServeError("an API key must be printable ASCII without spaces")
    return tuple(dict.fromkeys(keys))


class Keys:
    def __init__(self, keys: Sequence[str]):
        self._bearers = [f"Bearer {k}".encode() for k in keys]

    @property
    def required(self) -> bool:
        return bool(self._bearers)

    def tenant(self, authorization: str | None) -> int | None:
        """The index of the key the request carries (None when the server needs none); 401 otherwise."""
        if not self._bearers:
            return None
        given = (authorization or "").encode("latin-1")
        # Every key is compared, so the time taken says nothing about which one nearly matched.
        matches = [i for i, bearer in enumerate(self._bearers) if hmac.compare_digest(given, bearer)]
        if not matches:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
        return matches[0]
