"""A scripted, deterministic backend for tests and demos: fake clock, fake device telemetry.

Replies are derived from the last user message (or taken from `replies` in turn). Time advances
only on the fake clock: prefill costs `prefill_ms_per_token` per uncached prompt token, each
decoded token `tpot_ms` (more with neighbours, much more with the KV cache off). `hold` makes a
stream stop at a point until release() (or cancel()), so tests can look at a reply mid-flight:
"queued", "prefill" (half the prompt computed), "transfer" (disaggregated: the K/V on their way,
`transfer_ms` of the clock) or "decode:N" (after N tokens).
"""
from __future__ import annotations

import re
import threading
from typing import Any, Iterator

from pdchat.engine.output_processor import LAYER_PROGRESS_TOKENS
from pdchat.engine.scheduler import FIRST_SLICE
from pdchat.chatapp.backends.base import CAPABILITIES, Backend, Done, Generation, Phase, Settings, Token

GB = 1024 ** 3
MB = 1024 ** 2
KV_BYTES_PER_TOKEN = 9216
FAKE_LAYERS = 30          # as many as the default model (SmolLM2-135M)


def default_reply(prompt: str) -> str:
    return (f"You asked: *{prompt.strip()[:60]}*.\n\nHere is an example:\n\n"
            "```python\nprint(\"hello\")\n```\n\nThat is all.")


def _tokens(text: str) -> list[str]:
    return re.findall(r"\s*\S+|\s+", text)


class FakeGeneration(Generation):
    def __init__(self, backend: "FakeBackend", messages: list[dict[str, str]], settings: Settings):
        self.backend = backend
        self.messages = messages
        self.settings = settings
        self.cancelled = threading.Event()
        self.released = threading.Event()
        self.transfer: tuple[int, float] | None = None      # disaggregated: the K/V's bytes and ms

    def cancel(self) -> None:
        self.cancelled.set()
        self.released.set()

    def _hold(self, point: str) -> None:
        if self.backend.hold == point:
            self.backend.held.set()
            self.released.wait()

    def __iter__(self) -> Iterator:
        b, clock = self.backend, self.backend.clock
        b.running += 1
        try:
            yield from self._run(b, clock)
        finally:
            b.running -= 1
            b.kv_blocks_used = 0

    def _run(self, b: "FakeBackend", clock) -> Iterator:
        prompt_text = "\n".join(m["content"] for m in self.messages)
        total = max(1, len(prompt_text.split()) * 4 + 12)
        users = sum(1 for m in self.messages if m["role"] == "user")
        cached = (total // 2 // 16) * 16 if (b.toggles["prefix_cache"] and b.toggles["kv_cache"]
                                               and users > 1) else 0
        t_submit = clock.t
        yield Phase("queued", 0, total, cached, clock.t)
        self._hold("queued")
        clock.advance(0.002)
        t_sched = clock.t
        at_worker = int(b.toggles["disaggregate"])          # sent to the prefill worker until its K/V are back
        b.prefill_queue += at_worker
        try:
            yield from self._prefill(b, clock, cached, total, cached)
            if at_worker and not self.cancelled.is_set():
                yield from self._transfer(b, clock, total, cached)
        finally:
            b.prefill_queue -= at_worker
        if self.cancelled.is_set():
            yield self._done("", "cancelled", t_submit, t_sched, None, [], total, cached)
            return
        reply = b.next_reply(self.messages[-1]["content"] if self.messages else "")
        pieces = _tokens(reply)[: self.settings.max_tokens]
        tpot = b.tpot_ms * (1 + 0.25 * b.toggles["neighbours"]) * (1 if b.toggles["kv_cache"] else 4)
        text, times = "", []
        for i, piece in enumerate(pieces):
            if self.cancelled.is_set():
                break
            if i:
                clock.advance(tpot / 1000)
            times.append(clock.t)
            if i == 0:
                yield Phase("decode", total, total, cached, clock.t)
            text += piece
            b.kv_blocks_used = -(-(total + i + 1) // 16)
            yield Token(piece, clock.t, i)
            self._hold(f"decode:{i + 1}")
        if self.cancelled.is_set():
            reason = "cancelled"
        else:
            reason = "length" if len(pieces) < len(_tokens(reply)) else "stop"
        yield self._done(text, reason, t_submit, t_sched, times[0] if times else None, times, total, cached)

    @staticmethod
    def _chunk(b: "FakeBackend", total: int) -> int:
        """Prompt tokens per prefill step, as the engine plans them: the chunk while neighbours
        decode, else the whole prompt in one forward."""
        chunk = b.toggles["chunk_size"]
        if not chunk or not b.toggles["kv_cache"] or not b.toggles["neighbours"]:
            return total
        return FIRST_SLICE if chunk == "auto" else chunk

    def _prefill(self, b: "FakeBackend", clock, computed: int, total: int, cached: int) -> Iterator:
        """Steps of the prefill, with the engine's events: a count after each chunk but the last,
        and a long forward's way through its layers."""
        chunk = self._chunk(b, total)
        first = True
        while computed < total and not self.cancelled.is_set():
            step = min(chunk, total - computed)
            layers = FAKE_LAYERS if step >= LAYER_PROGRESS_TOKENS else 0
            step_s = step * b.prefill_ms_per_token / 1000 * b.prediction_error      # the engine's guess
            if first:       # as the engine: the prefill's first step is announced with its prediction
                yield Phase("prefill", computed, total, cached, clock.t, 0, layers, step, step_s)
                first = False
            for done in range(1, layers + 1):
                clock.advance(step * b.prefill_ms_per_token / 1000 / layers)
                yield Phase("prefill", computed, total, cached, clock.t, done, layers, step, step_s)
                if done * 2 == layers and computed + step >= total:
                    self._hold("prefill")
            if not layers:
                clock.advance(step * b.prefill_ms_per_token / 1000)
            computed += step
            b.kv_blocks_used = -(-computed // 16)
            if computed < total:
                yield Phase("prefill", computed, total, cached, clock.t)
                if computed * 2 >= total and not layers:
                    self._hold("prefill")

    def _transfer(self, b: "FakeBackend", clock, total: int, cached: int) -> Iterator:
        """As the disaggregated engine: the worker prefilled all but the last prompt token, whose
        K/V cross to the decode side (counted by the backend's stats)."""
        yield Phase("transfer", total - 1, total, cached, clock.t)
        self._hold("transfer")
        clock.advance(b.transfer_ms / 1000)
        yield Phase("prefill", total - 1, total, cached, clock.t)     # the last prompt token, here
        self.transfer = ((total - 1) * KV_BYTES_PER_TOKEN, b.transfer_ms)
        b.kv_transfers += 1
        b.kv_transferred_bytes += self.transfer[0]

    def _done(self, text, reason, t_submit, t_sched, t_first, times, total, cached) -> Done:
        ms = lambda a, b: None if a is None or b is None else round((b - a) * 1000, 3)  # noqa: E731
        prefill_ms = ms(t_sched, t_first)
        decode_ms = ms(times[0], times[-1]) if len(times) > 1 else None
        steps = len(times) - 1
        spec = self.backend.toggles["spec"]
        metrics = {
            "queue_ms": ms(t_submit, t_sched), "ttft_ms": ms(t_submit, t_first), "prefill_ms": prefill_ms,
            "prompt_tokens": total, "cached_prompt_tokens": cached,
            "prefill_tok_s": (total - cached) / (prefill_ms / 1000) if prefill_ms else None,
            "output_tokens": len(times), "decode_ms": decode_ms,
            "tpot_ms": decode_ms / steps if decode_ms is not None else None,
            "decode_tok_s": steps / (decode_ms / 1000) if decode_ms else None,
            "itl_ms": [round((b - a) * 1000, 3) for a, b in zip(times, times[1:])],
            "spec_method": None if spec == "off" else spec,
            "spec_drafted": 0, "spec_accepted": 0, "preemptions": 0, "finish_reason": reason,
        }
        metrics["kv_transfer_bytes"], metrics["kv_transfer_ms"] = self.transfer or (None, None)
        return Done(text, reason, metrics, None)


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t
        self._lock = threading.Lock()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.t += seconds


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, *, model: str = "fake-model", gpu: bool = False, replies: list[str] | None = None,
                 hold: str | None = None, tpot_ms: float = 32.0, prefill_ms_per_token: float = 0.5,
                 transfer_ms: float = 4.0,
                 load_error: str | None = None, capabilities: dict[str, bool] | None = None):
        self.model = model
        self.gpu = gpu
        self.replies = list(replies or [])
        self.hold = hold
        self.held = threading.Event()          # set when a stream reaches the hold point
        self.tpot_ms = tpot_ms
        self.prefill_ms_per_token = prefill_ms_per_token
        self.transfer_ms = transfer_ms
        self.prefill_queue = self.kv_transfers = self.kv_transferred_bytes = 0
        self.prediction_error = 1.0            # predicted / actual time of a prefill forward
        self.load_error = load_error
        self.clock = FakeClock()
        self.toggles: dict[str, Any] = {"kv_cache": True, "prefix_cache": True, "chunk_size": 256,
                                        "spec": "off", "quant": "none", "neighbours": 0, "cuda_graphs": True,
                                        "disaggregate": False}
        self.updates: list[dict[str, Any]] = []
        self._notices: list[str] = []
        self.requests: list[tuple[list[dict[str, str]], Settings]] = []
        self.generations: list[FakeGeneration] = []
        self.running = 0
        self.kv_blocks_used = 0
        # the machine's CPU and this process's share of it (% of all CPUs); a test may set them
        self.cpu_util_pct, self.process_cpu_pct = (12.0, 10.0) if gpu else (37.5, 30.0)
        self.loaded = False
        self._reply_i = 0
        self._caps = {c: c not in ("quant", "lab") for c in CAPABILITIES}
        self._caps["cuda_graphs"] = gpu          # as the local backend: GPU only
        self._caps.update(capabilities or {})

    def load(self, progress) -> None:
        progress(f"loading {self.model}…")
        if self.load_error:
            raise RuntimeError(self.load_error)
        self.loaded = True
        progress(f"{self.model} ready")

    @property
    def capabilities(self) -> dict[str, bool]:
        return dict(self._caps)

    def next_reply(self, prompt: str) -> str:
        if self.replies:
            reply = self.replies[self._reply_i % len(self.replies)]
            self._reply_i += 1
            return reply
        return default_reply(prompt)

    def stream(self, messages, settings) -> FakeGeneration:
        if not self.loaded:
            raise RuntimeError("the model is not loaded")
        self.requests.append((list(messages), settings))
        gen = FakeGeneration(self, list(messages), settings)
        self.generations.append(gen)
        return gen

    def release(self) -> None:
        """Let every held stream go on (and stop holding)."""
        self.hold = None
        for g in self.generations:
            g.released.set()

    def update(self, **toggles: Any) -> None:
        for key, value in toggles.items():
            if key not in self.toggles:
                raise ValueError(f"unknown setting {key}")
            if key in ("spec", "quant") and value not in ("off", "none") and not self._caps[key]:
                raise ValueError(f"{key} is not available")
        self.updates.append(dict(toggles))
        self.toggles.update(toggles)

    def decide(self, notice: str, **toggles: Any) -> None:
        """Change toggles as the engine does itself (speculation that does not pay), with its notice."""
        self.toggles.update(toggles)
        self._notices.append(notice)

    def notices(self) -> list[str]:
        taken, self._notices = self._notices, []
        return taken

    def now(self) -> float:
        return self.clock.t

    def stats(self) -> dict[str, Any]:
        total, bpt, bs = 1024, KV_BYTES_PER_TOKEN, 16
        cached = 24
        s = {
            "model": self.model, "kv_block_size": bs, "kv_blocks_total": total,
            "kv_blocks_used": self.kv_blocks_used, "kv_blocks_cached": cached, "kv_bytes_per_token": bpt,
            "kv_bytes_used": self.kv_blocks_used * bs * bpt, "kv_bytes_total": total * bs * bpt,
            "running": self.running + self.toggles["neighbours"], "waiting": 0,
            "step_ms": 32.0 if self.running else None, "step_prefill_tokens": 0,
            "step_decode_tokens": self.running, "prefix_hit_rate": 0.25,
            "prefix_cache": self.toggles["prefix_cache"], "kv_cache": self.toggles["kv_cache"],
            "chunk_size": self.toggles["chunk_size"], "spec": self.toggles["spec"], "quant": self.toggles["quant"],
            "weight_bytes": 269 * MB, "model_bytes": 538 * MB,
        }
        if self.gpu:
            s.update(device="cuda:0", device_name="NVIDIA H100 80GB HBM3", device_util_pct=87.0,
                     device_mem_used=int(12.5 * GB), device_mem_total=80 * GB, device_power_w=312.0,
                     sm_clock_mhz=1980.0, rss_bytes=2 * GB, cuda_graphs=self.toggles["cuda_graphs"],
                     graph_state="on" if self.toggles["cuda_graphs"] else "off",
                     graph_rows=self.running or None, graph_size=self.running or None)
        else:
            s.update(device="cpu", device_name=None, device_util_pct=None, device_mem_used=None,
                     device_mem_total=None, device_power_w=None, rss_bytes=812 * MB)
        s.update(cpu_util_pct=self.cpu_util_pct, process_cpu_pct=self.process_cpu_pct)
        if self.toggles["disaggregate"]:
            s.update(disaggregate=True, prefill_worker="busy" if self.prefill_queue else "idle",
                     prefill_queue=self.prefill_queue, prefill_cores="0", decode_cores="1", kv_link="shm",
                     kv_transfers=self.kv_transfers, kv_transferred_bytes=self.kv_transferred_bytes,
                     last_kv_transfer_ms=self.transfer_ms if self.kv_transfers else None)
        return s
