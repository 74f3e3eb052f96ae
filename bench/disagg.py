"""`pdchat bench disagg`: what disaggregated prefill/decode buys a decoding stream, and what the
K/V hand-off costs the prompt that arrives.

The measurement is `bench toggles`' chunked-prefill one (toggles.stutter): a stream decodes, a long
prompt arrives (the same newcomer: 1,728 tokens of the default model at full size); the stream's
worst gap ÷ its median TPOT and the newcomer's TTFT. One row per setup, rounds interleaved, medians:

  colocated, chunked         one process on every core, prompt slices sized by time (chunk auto)
  colocated, one step        one process on every core, the prompt in one step (chunk off)
  disaggregated, shm         the prefill worker on its cores (default half), the engine decoding
                             on the rest; K/V through shared memory
  disaggregated, slow link   the same over a simulated 1 GB/s, 10 ms link
  disaggregated, socket      K/V over a loopback TCP connection (a second engine: the link is
                             fixed when an engine starts)

Per disaggregated row the newcomer's hand-off: bytes and ms, and the bytes the formula gives for
its prompt tokens but the last (the worker computes those, the engine's first decode step the last).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pdchat.engine.config import EngineConfig, SamplingParams
from pdchat.engine.disaggregation.cores import available_cores
from pdchat.engine.disaggregation.link import kv_transfer_bytes
from pdchat.engine.disaggregation.prefill_worker import log_file
from pdchat.engine.engine import Engine
from pdchat.bench import Progress, lab_claims, toggles


class WorkerUnavailable(RuntimeError):
    """The prefill worker did not start (its log says why)."""


@dataclass(frozen=True)
class Setup:
    """One row: where the newcomer's prompt is prefilled and how its K/V cross."""
    name: str
    disaggregate: bool = False
    chunk_size: int | str | None = "auto"
    kv_link: str | None = None          # disaggregated: "shm" | "socket"
    link_gbps: float | None = None      # the simulated link (None: as fast as the transport)
    link_ms: float = 0.0


CHUNKED = Setup("colocated, chunked")
ONE_STEP = Setup("colocated, one step", chunk_size=None)
SHM = Setup("disaggregated, shm", True, kv_link="shm")
SLOW = Setup("disaggregated, slow link", True, kv_link="shm", link_gbps=1.0, link_ms=10.0)
SOCKET = Setup("disaggregated, socket", True, kv_link="socket")
# Both shm rows before the socket one: one prefill worker start per engine and round.
SETUPS = [CHUNKED, ONE_STEP, SHM, SLOW, SOCKET]
SIZES = {"quick": dict(newcomer_words=toggles.QUICK_NEWCOMER_WORDS, rounds=1),
         "full": dict(newcomer_words=toggles.NEWCOMER_WORDS, rounds=3)}
CORES = "colocated: every core; disaggregated: the prefill worker's | the decoding engine's"
GOAL = (f"disaggregated (shm): the stream's worst gap <= {lab_claims.DISAGG_GAP_MAX:g}x its median TPOT while the "
        f"newcomer arrives; each hand-off's bytes = 2 x layers x kv_heads x head_dim x dtype bytes "
        f"x (prompt tokens - 1)")


def run(config: EngineConfig, *, quick: bool, progress: Progress) -> dict[str, Any]:
    sizes = SIZES["quick" if quick else "full"]
    # Prefix cache off: the newcomer is really prefilled every round.
    engine = Engine(replace(config, telemetry=False, prefix_cache=False, disaggregate=False), say=lambda m: None)
    try:
        out: dict[str, Any] = {"model": config.model, "device": str(engine.device), "inputs": dict(sizes)}
        out["disaggregation"] = measure(engine, sizes["newcomer_words"], SETUPS, sizes["rounds"], progress)
        progress("done", 1.0)
        return out
    finally:
        engine.close()


def measure(engine: Engine, words: int, setups: list[Setup], rounds: int, progress: Progress) -> dict[str, Any]:
    """The setups' rows (medians of `rounds` interleaved rounds) and what they add up to; the
    engine's settings are as before afterwards, its prefill worker stopped."""
    engines = _Engines(engine)
    prompt = toggles.newcomer_prompt(words)
    by_name = {s.name: s for s in setups}
    done = [0]

    def one(setting: dict[str, Any]) -> dict[str, Any]:
        progress(f"{setting['setup']} · round {done[0] // len(setups) + 1}/{rounds}", done[0] / (len(setups) * rounds))
        done[0] += 1
        engine, first_ms = engines.use(by_name[setting["setup"]], prompt)
        return _row(engine, prompt) | {"fresh_worker_kv_transfer_ms": first_ms}

    try:
        rows = toggles.interleaved_medians([{"setup": s.name} for s in setups], one, rounds)
    finally:
        engines.close()
    return _summary(engine, rows, by_name)


def _row(engine: Engine, prompt: str) -> dict[str, Any]:
    stats, newcomer = toggles.stutter(engine, prompt)
    formula = None
    if engine.config.disaggregate:
        mc = engine.model_config
        formula = kv_transfer_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, engine.dtype.itemsize,
                                    newcomer.prompt_tokens - 1)
    return {"cores": _cores(engine), **stats, "kv_transfer_bytes": newcomer.kv_transfer_bytes,
            "kv_transfer_ms": newcomer.kv_transfer_ms, "formula_bytes": formula,
            "bytes_equal_formula": None if formula is None else newcomer.kv_transfer_bytes == formula}


def _cores(engine: Engine) -> str:
    """The cores the row ran on: colocated every one this process may use, disaggregated the
    prefill worker's | the decoding engine's (CORES)."""
    st = engine.stats()
    if st.prefill_cores is not None:
        return f"{st.prefill_cores} | {st.decode_cores}"
    return ",".join(map(str, available_cores()))


def _summary(engine: Engine, rows: list[dict[str, Any]], setups: dict[str, Setup]) -> dict[str, Any]:
    by_name = {r["setup"]: r for r in rows}
    shm, chunked, slow = by_name.get(SHM.name), by_name.get(CHUNKED.name), setups.get(SLOW.name)
    handed = [r for r in rows if r["formula_bytes"] is not None]
    mc = engine.model_config
    out: dict[str, Any] = {
        "rows": rows, "cores": CORES, "layers": mc.num_layers, "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
        "dtype_bytes": engine.dtype.itemsize, "bytes_equal_formula": bool(handed) and all(
            r["bytes_equal_formula"] for r in handed)}
    if slow is not None:
        out["slow_link_gbps"], out["slow_link_ms"] = slow.link_gbps, slow.link_ms
    if shm and chunked:
        # below this link speed the hand-off alone costs the newcomer more than colocated slices
        out["break_even_gbps_vs_chunked"] = lab_claims.break_even_gbps(
            shm["kv_transfer_bytes"], shm["newcomer_ttft_ms"], shm["kv_transfer_ms"], chunked["newcomer_ttft_ms"])
    out["goal"] = GOAL
    if shm:
        out["met"] = shm["worst_gap_over_tpot"] <= lab_claims.DISAGG_GAP_MAX and out["bytes_equal_formula"]
    return out


class _Engines:
    """The engines the rows run on: the caller's, and one more per K/V link it was not started
    with (the link is fixed at start), made when a row first needs it. One prefill worker at a
    time: a ready worker pins this whole process to the decode cores, which a colocated row (all
    cores) or another engine's worker must not inherit."""

    def __init__(self, engine: Engine):
        self.main, self.base = engine, engine.config
        self.extra: dict[str, Engine] = {}

    def use(self, setup: Setup, prompt: str) -> tuple[Engine, float | None]:
        """The engine for `setup`, warm; with the hand-off time of a freshly started worker's first
        `prompt` (None when the worker was running already, or the row is colocated)."""
        engine = self._for(setup.kv_link)
        for other in (self.main, *self.extra.values()):
            if other is not engine and other.config.disaggregate:
                other.update(disaggregate=False)
        fresh = setup.disaggregate and engine.disagg.state == "off"
        engine.update(disaggregate=setup.disaggregate, chunk_size=setup.chunk_size, kv_link_gbps=None,
                      kv_link_ms=0.0, prefix_cache=False)
        if setup.disaggregate and not engine.disagg.wait_ready():
            raise WorkerUnavailable(f"the prefill worker did not start ({engine.disagg.state}); its log: {log_file()}")
        # Every row starts warm, as a long-running engine would be: a fresh worker's first prompt of
        # the newcomer's size (its first hand-off touches every page of the link's area and of the
        # pool: it is reported apart), and the step cost model's decode time on the cores this row
        # decodes on (prompt slices are sized by it).
        first = engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0)).result() if fresh else None
        engine.update(kv_link_gbps=setup.link_gbps, kv_link_ms=setup.link_ms)
        engine.submit("Hello there.", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)).result()
        return engine, first.metrics.kv_transfer_ms if first else None

    def _for(self, link: str | None) -> Engine:
        if link is None or link == self.base.kv_link:
            return self.main
        if link not in self.extra:
            self.extra[link] = Engine(replace(self.base, kv_link=link, disaggregate=False), say=lambda m: None)
        return self.extra[link]

    def close(self) -> None:
        for engine in self.extra.values():
            engine.close()
        b = self.base
        self.main.update(disaggregate=b.disaggregate, chunk_size=b.chunk_size, kv_link_gbps=b.kv_link_gbps,
                         kv_link_ms=b.kv_link_ms, prefix_cache=b.prefix_cache)
