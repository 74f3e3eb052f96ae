"""The Engine API: streaming events, metrics, stops, cancellation, bad input."""
from __future__ import annotations

import random
import time

import pytest
import torch

from pdchat.engine import (ContextTooLong, Engine, FinishEvent, InvalidRequest, ProgressEvent, SamplingParams,
                           TokenEvent)

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while engine.scheduler.has_work and time.time() < deadline:
        time.sleep(0.01)


def test_stream_events_text_and_metrics(tiny_engine):
    events = list(tiny_engine.submit("hello there", GREEDY))
    phases = [e.phase for e in events if isinstance(e, ProgressEvent)]
    assert phases[0] == "queued" and "prefill" in phases and phases[-1] == "decode"
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    done = events[-1]
    assert isinstance(done, FinishEvent)
    c = done.completion
    assert "".join(t.text for t in tokens) == c.text
    assert [t.token_id for t in tokens] == c.token_ids and len(c.token_ids) == 24
    assert c.finish_reason == "length"
    m = c.metrics
    assert m.output_tokens == 24 and m.prompt_tokens == len(tiny_engine.encode("hello there"))
    assert len(m.itl_ms) == 23 and all(x >= 0 for x in m.itl_ms)
    assert m.ttft_ms >= m.prefill_ms > 0 and m.queue_ms >= 0
    assert m.tpot_ms == pytest.approx(sum(m.itl_ms) / 23)
    assert m.decode_tok_s == pytest.approx(1000 / m.tpot_ms)
    times = [t.t for t in tokens]
    assert times == sorted(times) and times[-1] > times[0]
    assert [t.index for t in tokens] == list(range(24))


def test_stop_string_truncates_and_is_never_streamed(tiny_engine):
    full = tiny_engine.submit("abc", GREEDY).result().text
    assert len(full) > 6
    stop = full[3:6]
    c = tiny_engine.submit("abc", GREEDY.with_(stop=[stop])).result()
    assert c.finish_reason == "stop"
    assert c.text == full[:full.index(stop)]


def test_context_too_long_names_both_numbers():
    with Engine(model="random:tiny", telemetry=False, max_model_len=64, kv_cache_mb=4) as engine:
        with pytest.raises(ContextTooLong) as err:
            engine.submit(list(range(100)), GREEDY)
        assert "100" in str(err.value) and "64" in str(err.value)
        # A prompt that fits stops at the window.
        c = engine.submit(list(range(60)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)).result()
        assert c.finish_reason == "length" and len(c.token_ids) == 4


@pytest.mark.parametrize("prompt", ["", "   \n", [], [{"role": "user"}], [10**9], "half \ud800 a pair",
                                    [{"role": "user", "content": "\udfff"}]])
def test_bad_prompts_are_rejected(tiny_engine, prompt):
    with pytest.raises(InvalidRequest):
        tiny_engine.submit(prompt, GREEDY)


def test_cancel_mid_decode_frees_blocks(tiny_engine):
    stream = tiny_engine.submit("go on", SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True))
    n = 0
    for event in stream:
        if isinstance(event, TokenEvent):
            n += 1
            if n == 5:
                stream.cancel()
    c = stream.result()
    assert c.finish_reason == "cancelled" and 5 <= len(c.token_ids) < 1000
    wait_idle(tiny_engine)
    assert tiny_engine.stats().kv_blocks_used == 0


def test_cancel_while_queued_and_mid_prefill():
    with Engine(model="random:tiny", telemetry=False, max_num_seqs=2, chunk_size=16, kv_cache_mb=4) as engine:
        # A decoding neighbour makes the chunk budget apply, and fills one of the two batch slots.
        background = engine.submit([1, 2], SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True))
        next(e for e in background if isinstance(e, TokenEvent))
        long = engine.submit(list(range(1, 400)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        queued = engine.submit("later", GREEDY)
        queued.cancel()
        for event in long:
            if isinstance(event, ProgressEvent) and event.phase == "prefill" and event.computed > 0:
                long.cancel()
        assert long.result().finish_reason == "cancelled" and long.result().token_ids == []
        assert queued.result().finish_reason == "cancelled" and queued.result().token_ids == []
        background.cancel()
        wait_idle(engine)
        assert engine.stats().kv_blocks_used == 0


def test_many_random_requests_and_cancellations_leak_nothing():
    rng = random.Random(1)
    with Engine(model="random:tiny", telemetry=False, kv_cache_mb=1, chunk_size=32) as engine:
        streams = []
        for i in range(40):
            ids = [rng.randrange(1, 250) for _ in range(rng.randrange(1, 120))]
            streams.append(engine.submit(ids, SamplingParams(max_tokens=rng.randrange(1, 40), temperature=1.0,
                                                              seed=i, ignore_eos=True)))
            if rng.random() < 0.3:
                rng.choice(streams).cancel()
        results = [s.result(timeout=120) for s in streams]
        assert {r.finish_reason for r in results} <= {"length", "cancelled"}
        wait_idle(engine)
        st = engine.stats()
        assert st.kv_blocks_used == 0 and st.running == 0 and st.waiting == 0
        assert engine.blocks.num_free == st.kv_blocks_total


def test_stats_report_kv_geometry(tiny_engine):
    st = tiny_engine.stats()
    cfg = tiny_engine.model_config
    assert st.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert st.kv_bytes_total == st.kv_blocks_total * st.kv_block_size * st.kv_bytes_per_token
    assert st.kv_bytes_total == tiny_engine.runner.kv_bytes_total     # the pool really is that big
    stream = tiny_engine.submit("x" * 40, SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    for event in stream:
        if isinstance(event, TokenEvent):
            break
    st = tiny_engine.stats()
    assert st.kv_blocks_used >= 1 and st.running == 1
    assert st.kv_bytes_used == st.kv_blocks_used * st.kv_block_size * st.kv_bytes_per_token
    stream.cancel()
    assert stream.result().finish_reason == "cancelled"


def test_seeded_requests_are_reproducible(tiny_engine):
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=42, ignore_eos=True)
    a = tiny_engine.submit("seed me", p).result().token_ids
    b = tiny_engine.submit("seed me", p).result().token_ids
    c = tiny_engine.submit("seed me", p.with_(seed=43)).result().token_ids
    assert a == b and a != c


def test_generate_admits_its_prompts_in_one_go(tiny_engine):
    # The loop gets time to take each request as it is posted; generate's still arrive together, so
    # a batch's steps do not depend on thread timing (the decode-graph tests compare two runs).
    posted, seen_at_admission = [], []
    real_post, real_add = tiny_engine.loop.post, tiny_engine.loop._handlers["add"]

    def post(kind, arg):
        real_post(kind, arg)
        if kind == "add":
            posted.append(arg)
            time.sleep(0.05)

    def add(seq):
        seen_at_admission.append(len(posted))
        real_add(seq)

    tiny_engine.loop.post, tiny_engine.loop._handlers["add"] = post, add
    done = tiny_engine.generate(["one", "two", "three"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert seen_at_admission == [3, 3, 3] and [c.finish_reason for c in done] == ["length"] * 3


def test_batch_size_limit_holds_even_with_unfinished_prefills():
    with Engine(model="random:tiny", telemetry=False, max_num_seqs=2, chunk_size=8, kv_cache_mb=4) as engine:
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        streams = [engine.submit(list(range(1, 60 + i)), params) for i in range(5)]
        most = 0
        while not all(s.done for s in streams):
            most = max(most, engine.stats().running)
            time.sleep(0.001)
        assert most == 2
        assert all(len(s.result().token_ids) == 30 for s in streams)


def test_stats_still_answer_after_close():
    from pdchat.engine import Engine
    engine = Engine(model="random:tiny", device="cpu", telemetry=False, kv_cache_mb=8)
    before = engine.stats()
    engine.close()
    after = engine.stats()
    assert after.weight_bytes == before.weight_bytes > 0 and after.running == 0


def test_auto_dtype_is_bf16_on_a_gpu_that_has_it_and_fp16_on_one_that_does_not(monkeypatch):
    from pdchat.engine.loader import pick_dtype
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    assert pick_dtype("auto", cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert pick_dtype("auto", cuda) == torch.float16          # only emulated: a pre-Ampere GPU
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
