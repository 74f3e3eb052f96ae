"""The K/V hand-off from the prefill worker to the decoding engine.

Two transports, chosen by `--kv-link`:
- shm: a staging area in shared memory that both processes map (a file in /dev/shm); the worker
  writes a prompt's K/V there, the engine copies them out and says so, and the area is free again.
- socket: the bytes cross a TCP connection on the loopback interface, as they would between two
  machines (the worker proves who it is with a token the engine gave it).

Either way the receiving side can simulate a slower link: a hand-off is delivered no earlier than
latency + bytes / bandwidth after the worker finished the prompt (`--kv-link-gbps`, `--kv-link-ms`),
so one can watch where the transfer starts to cost more than the interference it removes.
Times are time.perf_counter(): on Linux and macOS a monotonic clock that both processes share.
"""
from __future__ import annotations

import os
import secrets
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from threading import Semaphore
from typing import Callable

import torch


TOKEN_BYTES = 16           # what the worker proves itself with on the socket link
READY_CONNECT_S = 30       # the worker connected before it said it was ready: far longer than needed
STAGING_PREFIX = "pdchat-kv-"       # staging files are named pdchat-kv-<engine pid>-<random>


def staging_folder() -> Path:
    return Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


def sweep_stale_staging(folder: Path) -> list[Path]:
    """Remove the staging files of engines that are gone, and say which. An engine forgets its
    file's name once the worker is ready; one killed before that (SIGKILL, a test's timeout while
    the worker loaded) leaves the file in shared memory for good. A PID reused since by another
    process keeps its file: the sweep errs on the side of leaving one. (An engine in another PID
    namespace sharing this /dev/shm would look gone; containers do not share it by default.)"""
    removed = []
    for path in folder.glob(STAGING_PREFIX + "*"):
        pid = path.name[len(STAGING_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                path.unlink()
            except OSError:             # another user's, or already gone
                continue
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:             # another user's process
        return True
    return True


def kv_transfer_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, tokens: int) -> int:
    """What a hand-off of `tokens` tokens moves: K and V, every layer, every KV head."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes * tokens


@dataclass
class Handoff:
    """One prompt's K/V on its way from the prefill worker into the engine's pool. `kv` is a view
    of the link's one receiving area: `release()` once they are copied out (or dropped), and the
    link takes the next hand-off."""
    request_id: str
    kv: torch.Tensor         # [2, layers, tokens, kv heads, head dim]
    cached: int              # prompt tokens the worker's prefix cache already held
    t_prefilled: float       # the worker finished the prompt's forward
    release: Callable[[], None] = lambda: None

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass(frozen=True)
class LinkSpec:
    """What the worker needs to send: the transport, where its data goes (the TCP address and
    the token, or the staging file), and the largest hand-off's size."""
    kind: str                                   # "shm" | "socket"
    address: tuple[str, int] | None = None
    token: bytes = b""
    staging: str = ""
    staging_bytes: int = 0


class SimulatedLink:
    """A link's bandwidth (GB/s, None: unlimited) and latency (ms), applied on the receiving side."""

    def __init__(self) -> None:
        self.gbps: float | None = None
        self.latency_ms = 0.0

    def delivery_time(self, t_sent: float, nbytes: int) -> float:
        wire = nbytes / (self.gbps * 1e9) if self.gbps else 0.0
        return t_sent + self.latency_ms / 1000 + wire


def _staging_tensor(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (recv_into lets go of the GIL while it waits, so the decoding
    thread runs meanwhile; multiprocessing's Connection gathers the bytes in Python)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the prefill worker closed the link")
        got += n


class KvSender:
    """The worker's end. The worker reads a prompt's K/V straight into `area()` (the shared staging
    area, or a reusable send buffer), then `send()` passes the header on the control pipe and the
    bytes by the link (shm: it waits for the engine's "copied" before the area is reused)."""

    def __init__(self, spec: LinkSpec, control: Connection, data: socket.socket):
        self.control, self.data = control, data
        self.shared = spec.kind == "shm"
        self._area = _staging_tensor(spec.staging, spec.staging_bytes) if self.shared else \
            torch.empty(spec.staging_bytes, dtype=torch.uint8)

    @classmethod
    def connect(cls, spec: LinkSpec, control: Connection, data_fd: int | None) -> "KvSender":
        if spec.kind == "socket":
            data = socket.create_connection(spec.address)
            data.sendall(spec.token)
        else:
            data = socket.socket(fileno=data_fd)
        return cls(spec, control, data)

    def area(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Where the next hand-off's K/V go (free: the last send returned once the engine had them)."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return self._area[:nbytes].view(dtype).view(shape)

    def send(self, request_id: str, kv: torch.Tensor, cached: int, t_prefilled: float) -> None:
        """Hand over `kv` (the tensor area() gave)."""
        self.control.send(("kv", request_id, tuple(kv.shape), kv.dtype, cached, t_prefilled))
        if self.shared:
            _recv_into(self.data, memoryview(bytearray(1)))    # "copied": the area is free again
        else:
            self.data.sendall(_bytes_of(kv))


class KvReceiver:
    """The engine's end. Made before the worker starts (the worker connects to it); turns a "kv"
    header into a Handoff, delayed as the simulated link says.

    The K/V are not copied here: a hand-off is a view of one receiving area (the shared staging
    area, or a socket's receive buffer) until the engine writes it into its pool. A fresh tensor
    per hand-off would cost the decoding core a page fault per 4 KB (a 1,728-token prompt of the
    default model is 80 MB: 30-80 ms measured, more than a decode step)."""

    def __init__(self, kind: str, link: SimulatedLink, staging_bytes: int):
        self.link = link
        self._listener: socket.socket | None = None
        self._data: socket.socket | None = None
        self._area: torch.Tensor | None = None
        self.worker_fd: int | None = None          # shm: the worker's end of the acknowledgements
        if kind == "socket":
            self._listener = socket.create_server(("127.0.0.1", 0))
            self._listener.settimeout(READY_CONNECT_S)
            self._token = secrets.token_bytes(TOKEN_BYTES)
            self._free = Semaphore(1)              # the receive buffer holds one hand-off
            self.spec = LinkSpec(kind, self._listener.getsockname()[:2], self._token, staging_bytes=staging_bytes)
        else:
            folder = staging_folder()
            sweep_stale_staging(folder)
            self._path = folder / f"{STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            self._area = _staging_tensor(str(self._path), staging_bytes)
            self._data, theirs = socket.socketpair()
            self.worker_fd = theirs.detach()
            self.spec = LinkSpec(kind, staging=str(self._path), staging_bytes=staging_bytes)
        self._staging_bytes = staging_bytes

    def connect(self) -> None:
        """Once the worker is ready: accept its data connection (socket: it connected before it
        said so; one without the token is not the worker's and is refused), or forget the
        staging file's name (shm: both sides have it mapped)."""
        if self._listener is None:
            self._path.unlink(missing_ok=True)
            return
        while self._data is None:
            conn, _ = self._listener.accept()
            token = memoryview(bytearray(TOKEN_BYTES))
            conn.settimeout(READY_CONNECT_S)
            try:
                _recv_into(conn, token)
            except (OSError, EOFError):
                conn.close()
                continue
            if secrets.compare_digest(bytes(token), self._token):
                conn.settimeout(None)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
                self._data = conn
            else:
                conn.close()

    def receive(self, message: tuple) -> Handoff:
        _, request_id, shape, dtype, cached, t_prefilled = message
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if self._listener is None:
            release = self._acknowledge              # the worker waits for it to reuse the area
        else:
            self._free.acquire()                     # the previous hand-off is in the pool
            if self._area is None:
                self._area = torch.empty(self._staging_bytes, dtype=torch.uint8)
            _recv_into(self._data, _bytes_of(self._area)[:nbytes])
            release = self._free.release
        kv = self._area[:nbytes].view(dtype).view(shape)
        handoff = Handoff(request_id, kv, cached, t_prefilled, release)
        wait = self.link.delivery_time(t_prefilled, handoff.nbytes) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return handoff

    def _acknowledge(self) -> None:
        try:
            self._data.sendall(b"\x01")
        except OSError:                              # the worker is gone: nobody to tell
            pass

    def close(self) -> None:
        for end in (self._data, self._listener):
            if end is not None:
                end.close()
        if self._listener is None:
            self._path.unlink(missing_ok=True)
