"""Disaggregated prefill and decode (engine/disaggregation): a worker process prefills, the engine
decodes from the K/V it hands over. Same greedy tokens as one process, the bytes the formula says,
the link's simulated cost, cancels, a worker that dies or never starts, and turning it on and off
while the engine runs (the process's cores and threads come back)."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from pdchat.engine import Engine, SamplingParams, TokenEvent
from pdchat.engine.disaggregation import worker_process
from pdchat.engine.disaggregation.cores import CAN_PIN, split_cores
from pdchat.engine.disaggregation.link import (
    STAGING_PREFIX, SimulatedLink, kv_transfer_bytes, staging_folder, sweep_stale_staging,
)

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 250) for _ in range(40)]
    return [shared + [rng.randrange(1, 250) for _ in range(n)] for n in (3, 60, 300)] + [[7, 8]]


def engine(**kw) -> Engine:
    return Engine(model="random:tiny", telemetry=False, kv_cache_mb=16, **kw)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with engine(prefix_cache=False) as e:
        return [e.submit(p, GREEDY).result().token_ids for p in prompts()]


def formula(e: Engine, tokens: int) -> int:
    mc = e.model_config
    return kv_transfer_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.empty((), dtype=e.dtype).element_size(),
                             tokens)


@pytest.mark.parametrize("link", ["shm", "socket"])
def test_same_tokens_and_the_bytes_the_formula_says(reference, link):
    before = os.sched_getaffinity(0) if CAN_PIN else None
    with engine(disaggregate=True, kv_link=link) as e:
        assert e.stats().prefill_worker == "idle"
        done = e.generate(prompts())
        assert [c.token_ids for c in e.generate(prompts(), GREEDY)] == reference
        st = e.stats()
        assert st.kv_transfers == 2 * len(prompts())
        for c in done:
            m = c.metrics
            assert m.kv_transfer_bytes == formula(e, m.prompt_tokens - 1)
            assert m.kv_transfer_ms is not None and 0 <= m.kv_transfer_ms < m.ttft_ms
        if CAN_PIN and len(before) > 1:
            prefill, decode = split_cores(None, sorted(before))
            assert os.sched_getaffinity(0) == set(decode)
            assert (st.prefill_cores, st.decode_cores) == (",".join(map(str, prefill)), ",".join(map(str, decode)))
    if CAN_PIN:
        assert os.sched_getaffinity(0) == before            # closing gives the cores back


def test_the_workers_prefix_cache_serves_a_repeated_prompt(reference):
    with engine(disaggregate=True) as e:
        first = e.submit(prompts()[2], GREEDY).result()
        again = e.submit(prompts()[2], GREEDY).result()
    assert first.token_ids == again.token_ids == reference[2]
    assert first.metrics.cached_prompt_tokens == 0
    assert again.metrics.cached_prompt_tokens >= 16 * ((len(prompts()[2]) - 2) // 16)
    assert again.metrics.kv_transfer_bytes == first.metrics.kv_transfer_bytes   # still all of it crosses


def test_a_simulated_link_costs_latency_plus_bytes_over_bandwidth(reference):
    with engine(disaggregate=True) as e:
        e.update(kv_link_ms=150.0, kv_link_gbps=0.001)         # 1 MB/s
        c = e.submit(prompts()[1], GREEDY).result()
        assert c.token_ids == reference[1]
        wire_ms = c.metrics.kv_transfer_bytes / 1e6 * 1000
        assert c.metrics.kv_transfer_ms >= 150 + wire_ms
        e.update(kv_link_ms=0.0, kv_link_gbps=None)
        assert (e.disagg.link.latency_ms, e.disagg.link.gbps) == (0.0, None)     # the link is plain again


def test_delivery_time():
    link = SimulatedLink()
    assert link.delivery_time(10.0, 10**9) == 10.0
    link.gbps, link.latency_ms = 2.0, 10.0
    assert link.delivery_time(10.0, 10**9) == pytest.approx(10.0 + 0.010 + 0.5)


def test_staging_files_of_engines_that_are_gone_are_swept(tmp_path):
    """An engine killed before its worker was ready leaves its staging file in shared memory; the
    next engine to make one removes those whose process is gone, and no one else's."""
    import subprocess
    import sys
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"pdchat-kv-{gone.pid}-0a1b2c3d"
    mine = tmp_path / f"pdchat-kv-{os.getpid()}-4e5f6a7b"
    other = tmp_path / "pdchat-kv-notapid-00000000"
    unrelated = tmp_path / f"something-{gone.pid}"
    for path in (dead, mine, other, unrelated):
        path.write_bytes(b"\0" * 64)
    assert sweep_stale_staging(tmp_path) == [dead]
    assert not dead.exists() and mine.exists() and other.exists() and unrelated.exists()


def test_cancel_at_the_worker_leaves_the_others_alone(reference):
    with engine(disaggregate=True, kv_link_ms=300.0) as e:
        doomed = e.submit(prompts()[2], GREEDY)
        other = e.submit(prompts()[1], GREEDY)
        time.sleep(0.05)
        doomed.cancel()
        assert doomed.result().finish_reason == "cancelled"
        assert other.result().token_ids == reference[1]
        e.update(kv_link_ms=0.0)
        assert e.submit(prompts()[0], GREEDY).result().token_ids == reference[0]
        assert e.stats().prefill_queue == 0


def test_a_worker_that_dies_hands_its_prompts_back(reference):
    with engine(disaggregate=True, kv_link_ms=400.0) as e:
        streams = [e.submit(p, GREEDY) for p in prompts()]
        time.sleep(0.1)
        e.disagg.worker.process.kill()
        assert [s.result().token_ids for s in streams] == reference
        notices = e.take_notices()
        assert any("prefill worker stopped" in n for n in notices)
        assert e.stats().prefill_worker.startswith("failed")
        assert e.submit(prompts()[0], GREEDY).result().metrics.kv_transfer_bytes is None   # prefilled here


def test_a_worker_that_never_starts_leaves_the_engine_colocated(reference, monkeypatch):
    monkeypatch.setattr(worker_process.sys, "executable", "/bin/false")
    with engine(disaggregate=True) as e:
        assert e.stats().prefill_worker.startswith("failed")
        assert any("prefill worker stopped" in n for n in e.take_notices())
        assert e.submit(prompts()[1], GREEDY).result().token_ids == reference[1]


def test_turned_on_and_off_while_a_stream_runs(reference):
    """The step thread runs with one torch thread per decode core while disaggregated, and with
    as many as before once it is off (torch's count is per thread: setting it on the thread that
    calls update() left the step thread on one core's count, and colocated decoding ran at half
    speed after a disaggregated phase); the process's cores come back too."""
    before = os.sched_getaffinity(0) if CAN_PIN else None
    with engine() as e:
        seen: list[int] = []
        step = e.loop._step
        e.loop._step = lambda: (seen.append(torch.get_num_threads()), step())[1]
        stream = e.submit([5, 6, 7], SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True))
        next(ev for ev in stream if isinstance(ev, TokenEvent))
        colocated = seen[-1]
        e.update(disaggregate=True)
        assert e.disagg.wait_ready(120)
        c = e.submit(prompts()[2], GREEDY).result()
        assert c.token_ids == reference[2] and c.metrics.kv_transfer_bytes
        decode_cores = len(e.disagg.cores[1])
        assert seen[-1] == min(colocated, decode_cores)
        e.update(disaggregate=False)
        assert e.stats().prefill_worker == "off" and e.stats().prefill_cores is None
        if CAN_PIN:
            assert os.sched_getaffinity(0) == before
        c = e.submit(prompts()[1], GREEDY).result()
        assert c.token_ids == reference[1] and c.metrics.kv_transfer_bytes is None
        assert seen[-1] == colocated
        stream.cancel()


def test_turning_it_off_prefills_here_what_the_worker_held(reference):
    with engine(disaggregate=True, kv_link_ms=500.0) as e:
        streams = [e.submit(p, GREEDY) for p in prompts()[:3]]
        time.sleep(0.1)
        e.update(disaggregate=False)
        assert [s.result().token_ids for s in streams] == reference[:3]


def test_split_cores():
    assert split_cores(None, [0, 1]) == ([0], [1])
    assert split_cores(None, [0, 1, 2, 3]) == ([0, 1], [2, 3])
    assert split_cores(3, [0, 1, 2, 3]) == ([0, 1, 2], [3])
    assert split_cores(8, [0, 1, 2, 3]) == ([0, 1, 2], [3])      # decoding keeps one
    assert split_cores(None, [5]) == ([5], [5])                  # one core: shared


def test_read_kv_then_write_kv_round_trips(tiny_engine):
    runner = tiny_engine.runner
    torch.manual_seed(0)
    runner.k_cache.normal_()
    runner.v_cache.normal_()
    table = [3, 1, 4]
    kv = runner.read_kv(table, 37)
    bs = runner.block_size
    assert kv.shape == (2, runner.k_cache.shape[0], 37, runner.k_cache.shape[3], runner.k_cache.shape[4])
    assert torch.equal(kv[0, :, bs + 2], runner.k_cache[:, 1, 2])
    target = [6, 0, 2]
    runner.write_kv(target, kv)
    assert torch.equal(runner.read_kv(target, 37), kv)


def test_a_small_pool_makes_hand_offs_wait_for_room(reference):
    """Four prompts of up to 343 tokens, a decode pool of 640 tokens: hand-offs wait in order until
    finished requests free their blocks, and every output is still the reference's."""
    with Engine(model="random:tiny", telemetry=False, num_kv_blocks=40, disaggregate=True) as e:
        assert [c.token_ids for c in e.generate(prompts(), GREEDY)] == reference


def test_the_worker_follows_a_switch_of_weights():
    """int4 K/V from the worker and int4 decoding here: the tokens of an engine started in int4.
    (Its last prompt token runs the one-row int4 kernel, whose int8 activations round otherwise
    than a long prefill's: so the reference is a disaggregated engine, not a colocated one. With the
    worker left in fp32 the tokens differ from the second on.)"""
    p = prompts()[2]
    with engine(disaggregate=True, quant="int4") as e:
        int4 = e.submit(p, GREEDY).result().token_ids
    with engine(disaggregate=True) as e:
        fp32 = e.submit(p, GREEDY).result().token_ids
        e.update(quant="int4")
        assert e.submit(p, GREEDY).result().token_ids == int4
    assert fp32 != int4          # (else this test could not tell the weights apart)


@pytest.mark.parametrize("spec", [dict(spec="ngram"), dict(spec="draft"), dict(spec="draft", draft_model="random:tiny")])
def test_speculation_decodes_from_handed_over_kv(reference, spec):
    with engine(disaggregate=True, spec_always=True, **spec) as e:
        assert [c.token_ids for c in e.generate(prompts(), GREEDY)] == reference


def test_while_a_stream_decodes_a_hand_off_is_written_a_few_layers_a_step(reference, monkeypatch):
    """With a stream decoding, the pool write of a hand-off is spread over steps (arrivals.py: here
    a budget of one layer a step), and the tokens stay the reference's; with no stream it is
    written at once."""
    from pdchat.engine.disaggregation import arrivals
    monkeypatch.setattr(arrivals, "IMPORT_SHARE", 1e-9)
    with engine(disaggregate=True) as e:
        writes: list[slice] = []
        write = e.runner.write_kv
        e.runner.write_kv = lambda table, kv, layers=slice(None): (writes.append(layers), write(table, kv, layers))
        assert e.submit(prompts()[2], GREEDY).result().token_ids == reference[2]
        assert writes == [slice(0, e.model_config.num_layers)]                 # no stream: at once
        stream = e.submit([5, 6, 7], SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True))
        next(ev for ev in stream if isinstance(ev, TokenEvent))
        writes.clear()
        assert e.submit(prompts()[2], GREEDY).result().token_ids == reference[2]
        stream.cancel()
    assert [(w.start, w.stop) for w in writes] == [(i, i + 1) for i in range(e.model_config.num_layers)]


def test_closing_while_the_worker_loads_does_not_wait_for_it():
    """A loading worker reads no message until it has loaded (~2 s here): closing kills it rather
    than asking it to stop and waiting, which would end it normally, later."""
    with engine() as e:
        e.update(disaggregate=True)                   # returns at once; the worker loads
        assert e.stats().prefill_worker == "starting"
        process = e.disagg.worker.process
    assert process.returncode == -signal.SIGKILL


def test_turned_off_and_on_at_once_the_new_worker_is_not_taken_for_the_old():
    """The stopped worker's pipe closing is posted as "lost"; handled after the new worker
    started, it must not fail the new one."""
    with engine(disaggregate=True) as e:
        with e.loop.lock:                         # the step thread drains only after both
            e.update(disaggregate=False)
            time.sleep(0.2)                       # the old worker's "lost" is in the inbox by now
            e.update(disaggregate=True)
        assert e.disagg.wait_ready(120) and e.stats().prefill_worker == "idle"
        assert e.submit(prompts()[1], GREEDY).result().metrics.kv_transfer_bytes


class _Control:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> None:
        self.sent.append(message)


class _Sender:
    """The link's worker end, in memory: what area() gives and send() hands over."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, torch.Tensor]] = []

    def area(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def send(self, request_id, kv, cached, t_prefilled) -> None:
        self.sent.append((request_id, kv.clone()))


def test_a_prompt_that_fails_in_the_worker_fails_alone(monkeypatch):
    """In the worker (run here, in-process): a forward that raises sends ("failed", id, why) for
    that prompt, frees its blocks, and the next prompt is prefilled and handed over."""
    from pdchat.engine.config import EngineConfig
    from pdchat.engine.disaggregation.prefill_worker import PrefillWorker
    control, sender = _Control(), _Sender()
    worker = PrefillWorker(EngineConfig(model="random:tiny", telemetry=False, kv_cache_mb=16), sender, control)
    forward = worker.runner.forward

    def broken_once(*args, **kw):
        worker.runner.forward = forward
        raise RuntimeError("boom")
    worker.runner.forward = broken_once
    worker._prefill("a", prompts()[1], None)
    worker._prefill("b", prompts()[1], None)
    failed = [m for m in control.sent if m[0] == "failed"]
    assert failed == [("failed", "a", "prefill worker: RuntimeError: boom")]
    assert [rid for rid, _ in sender.sent] == ["b"] and sender.sent[0][1].shape[2] == len(prompts()[1]) - 1
    assert worker.blocks.num_used == 0


def test_a_failure_the_worker_reports_ends_that_request_alone(reference):
    with engine(disaggregate=True, kv_link_ms=400.0) as e:
        doomed, other = e.submit(prompts()[2], GREEDY), e.submit(prompts()[1], GREEDY)
        time.sleep(0.1)
        with e.loop.lock:
            rid = next(iter(e.disagg.at_worker))        # the first routed: `doomed`
        e.loop.post("disagg", (e.disagg.worker, ("failed", rid, "prefill worker: RuntimeError: boom")))
        result = doomed.result()
        assert (result.finish_reason, result.error) == ("error", "prefill worker: RuntimeError: boom")
        assert other.result().token_ids == reference[1]
        assert e.submit(prompts()[0], GREEDY).result().token_ids == reference[0]


def test_a_worker_that_cannot_be_started_leaves_no_staging_file(reference, monkeypatch):
    monkeypatch.setattr(worker_process.sys, "executable", "/nonexistent/python")
    folder = staging_folder()
    mine = f"{STAGING_PREFIX}{os.getpid()}-*"      # other test workers stage files of their own meanwhile
    staged = set(folder.glob(mine))
    with engine(disaggregate=True) as e:
        assert e.stats().prefill_worker.startswith("failed: it could not be started")
        assert e.submit(prompts()[1], GREEDY).result().token_ids == reference[1]
    assert set(folder.glob(mine)) <= staged
