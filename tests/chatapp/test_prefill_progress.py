"""The prefill pause shows progress for a lone long prompt: its one forward reports each layer, so
the count and the bar move at least every half second (on the fake clock), with the rate and the
time left."""
from __future__ import annotations

import pytest

from pdchat.chatapp.backends.base import Phase
from pdchat.chatapp.tui.live import LiveReply
from tests.doubles.fake_backend import FakeBackend

from .helpers import idle, ready, send, wait_for

pytestmark = pytest.mark.anyio

PROMPT = " ".join(f"w{i}" for i in range(747))         # the fake counts 4 tokens a word + 12: 3,000


def phase_text(app) -> str:
    return str(app.chat.query_one("#tm-phase").render())


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_a_lone_prefill_shows_count_rate_and_time_left(make_app, size):
    # 1 ms a token, held after 15 of the forward's 30 layers
    app = make_app(FakeBackend(hold="prefill", prefill_ms_per_token=1.0))
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await send(pilot, PROMPT)
        await wait_for(pilot, app.backend.held.is_set)
        await wait_for(pilot, lambda: "~1,500/3,000 prompt tok" in phase_text(app))
        text = phase_text(app)
        assert "PREFILL" in text
        # half of a 3,000-token forward in 1.5 s of the fake clock; 1,500 tokens to go at that rate
        assert "1,000.0 tok/s · ~1.5 s left" in text and "forward at layer 15 of 30" in text
        bar = text.splitlines()[2]
        assert bar.count("█") == round(len(bar) / 2) and len(bar) == app.chat.query_one("#tm-phase").content_size.width
        app.backend.release()
        await idle(pilot)


async def test_progress_reaches_the_panel_at_least_every_half_second(make_app, monkeypatch):
    seen: list[tuple[float, float]] = []
    feed = LiveReply.feed

    def recording(self, ev):
        feed(self, ev)
        if getattr(ev, "phase", None) == "prefill":
            seen.append((ev.t, self.snapshot().prefill_done))
    monkeypatch.setattr(LiveReply, "feed", recording)
    app = make_app(FakeBackend())
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await send(pilot, PROMPT)
        await idle(pilot)
    done = [d for _, d in seen]
    # a thirtieth of the prompt a layer (the backend's clock may have moved on a little since the
    # report: then the count is a little ahead, by the prediction, never past the next report)
    assert len(done) == 31 and all(100 * n <= d <= 100 * (n + 1) for n, d in enumerate(done))
    gaps = [b - a for (a, _), (b, _) in zip(seen, seen[1:])]
    assert max(gaps) <= 0.5


@pytest.mark.parametrize("error", [1.0, 0.5, 3.0])
async def test_between_slow_layer_reports_the_count_moves_by_the_predicted_pace(make_app, error):
    # A 1B-sized prefill: 20 ms a token, so each of the 30 layers takes 2 s. Held after 15 layers,
    # the clock moves on: the count and the bar follow the engine's prediction of the forward
    # (exact, twice too fast, three times too slow), never past the next layer's report.
    backend = FakeBackend(hold="prefill", prefill_ms_per_token=20.0)
    backend.prediction_error = error
    app = make_app(backend)
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await send(pilot, PROMPT)
        await wait_for(pilot, app.backend.held.is_set)
        await wait_for(pilot, lambda: "~1,500/3,000 prompt tok" in phase_text(app))
        def count() -> int:
            return int(phase_text(app).split("~")[1].split("/")[0].replace(",", ""))

        predicted_rate = 3000 / (60 * error)     # tokens a second, as predicted
        for i in range(8):                       # 8 x 0.4 s: past the next report's time
            backend.clock.advance(0.4)
            want = int(min(1500 + predicted_rate * 0.4 * (i + 1), 1600))
            # (the panel refreshes at 4 Hz: wait for the refresh, then the count must be this one)
            await wait_for(pilot, lambda: abs(count() - want) <= 1 or count() > want + 1)
            assert count() == pytest.approx(want, abs=1)
        app.backend.release()
        await idle(pilot)


async def test_before_the_first_report_the_time_left_is_the_prediction(make_app):
    backend = FakeBackend(hold="queued", prefill_ms_per_token=20.0)
    app = make_app(backend)
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await send(pilot, PROMPT)
        await wait_for(pilot, app.backend.held.is_set)
        live = next(iter(app.chat.live.values()))
        live.feed(Phase("prefill", 0, 3000, 0, backend.clock.t, 0, 30, 3000, 60.0))
        backend.clock.advance(1.0)
        await wait_for(pilot, lambda: "~59 s left (predicted)" in phase_text(app))
        assert "~50/3,000 prompt tok" in phase_text(app)
        app.backend.release()
        await idle(pilot)


async def test_before_a_slice_finishes_the_rate_is_being_measured(make_app):
    app = make_app(FakeBackend(hold="queued"))
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await send(pilot, PROMPT)
        await wait_for(pilot, app.backend.held.is_set)
        live = next(iter(app.chat.live.values()))
        live.feed(Phase("prefill", 0, 3000, 0, app.backend.clock.t))   # started, no slice done
        await wait_for(pilot, lambda: "measuring the prefill rate" in phase_text(app))
        app.backend.release()
        await idle(pilot)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_after_a_prefix_cache_hit_the_prefill_rate_comes_with_the_cached_count(make_app, size):
    app = make_app(FakeBackend())
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await send(pilot, "first question")
        await idle(pilot)
        assert "cached" not in str(app.chat.query_one("#tm-latency").render())
        await send(pilot, "second question")                # the fake caches half of a later turn
        await idle(pilot)
        m = app.chat.last_metrics()
        assert m["cached_prompt_tokens"] > 0
        section = app.chat.query_one("#tm-latency")
        lines = str(section.render()).split("\n")
        value = f"{m['cached_prompt_tokens']:,} of {m['prompt_tokens']:,} tok"
        assert [line.split() for line in lines if value in line] == [["cached", *value.split()]]
