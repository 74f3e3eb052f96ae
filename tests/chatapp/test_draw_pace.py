"""The streaming text's drawing pace (chatapp/tui/draw_pace.py): drawn every tick while the UI
thread is cheap, held while it takes more than its share of a core, never held past MAX_S, and the
end of a reply drawn at once. Clocks are the test's: wall time and the UI thread's CPU time."""
from __future__ import annotations

import pytest

from pdchat.chatapp.backends.base import Token
from pdchat.chatapp.tui.draw_pace import MAX_S, SHARE, DrawPace
from tests.doubles.fake_backend import FakeBackend

from .helpers import idle, ready, send, wait_for

pytestmark = pytest.mark.anyio


def test_a_draw_waits_until_the_ui_threads_time_is_within_its_share():
    wall, cpu = [10.0], [5.0]
    pace = DrawPace(lambda: wall[0], lambda: cpu[0])
    assert pace.due()                              # the first text at once
    pace.drawing()
    wall[0] += 0.1
    assert pace.due()                              # a cheap draw: the next at the next tick
    cpu[0] += 0.05                                 # that draw and its renders took 50 ms of CPU
    assert not pace.due()                          # 50 ms in 100: over the share
    wall[0] = 10.0 + 0.05 / SHARE - 1e-3
    assert not pace.due()
    wall[0] = 10.0 + 0.05 / SHARE
    assert pace.due()


def test_a_busy_ui_still_draws_every_max_s_and_a_reset_draws_at_once():
    wall, cpu = [0.0], [0.0]
    pace = DrawPace(lambda: wall[0], lambda: cpu[0])
    pace.drawing()
    cpu[0] += 100.0
    wall[0] = MAX_S - 0.01
    assert not pace.due()
    wall[0] = MAX_S
    assert pace.due()
    pace.drawing()
    cpu[0] += 100.0
    wall[0] += 0.1
    assert not pace.due()
    pace.reset()
    assert pace.due()


async def test_the_chat_holds_streamed_text_while_drawing_is_over_its_share(make_app):
    wall, cpu = [1000.0], [0.0]
    backend = FakeBackend(hold="decode:1", replies=["first second third fourth fifth", "again and again"])
    app = make_app(backend, clock=lambda: wall[0], cpu_clock=lambda: cpu[0])
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await send(pilot, "go")
        await wait_for(pilot, backend.held.is_set)
        replies = app.chat.replies
        await wait_for(pilot, lambda: replies.stream_view is not None and replies.stream_view.content == "first")
        for timer in replies._live_timers:         # the test pumps, on its own clocks
            timer.pause()
        live, view = next(iter(replies.live.values())), replies.stream_view
        replies.pace.reset()

        async def more(text: str, index: int) -> str:
            live.feed(Token(text, wall[0], index))
            await replies.pump()
            return view.content

        assert await more(" second", 1) == "first second"          # drawn at once
        cpu[0] += 0.05                                             # what drawing it cost the UI thread
        wall[0] += 0.1
        assert await more(" third", 2) == "first second"           # held: 50 ms of CPU in 100
        wall[0] += 0.05 / SHARE - 0.1
        assert await more(" fourth", 3) == "first second third fourth"
        cpu[0] += 10.0                                             # a UI far over its share...
        wall[0] += MAX_S - 0.01
        assert await more(" fifth", 4) == "first second third fourth"
        wall[0] += 0.01
        assert (await more("", 5)).endswith("fourth fifth")       # ...is still drawn every MAX_S
        cpu[0] += 10.0
        wall[0] += 0.1
        backend.generations[-1].released.set()     # the reply ends: drawn whole at once
        await wait_for(pilot, lambda: live.done is not None)
        await replies.pump()
        await idle(pilot)
        assert app.store.messages(app.chat.conv_id)[-1].status == "done"
        assert view.content == "first second third fourth fifth" and view.status == "done"
        backend.held.clear()                       # the next reply's first text: at once, however busy
        await send(pilot, "more")
        await wait_for(pilot, backend.held.is_set)
        await wait_for(pilot, lambda: replies.stream_view is not view and replies.stream_view.content == "again")


async def test_the_panels_slow_refresh_stops_while_a_reply_streams_and_comes_back_after(make_app):
    # While a reply streams the panel is redrawn 4 times a second; the once-a-second refresh beside
    # it would draw the same panel again, and on a CPU every draw is time taken from the model.
    backend = FakeBackend(hold="decode:1", replies=["first second"])
    app = make_app(backend)
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        replies = app.chat.replies
        (pump, fast), (slow,) = replies._live_timers, replies._idle_timers

        def running(timer) -> bool:
            return timer._active.is_set()

        assert running(slow) and not running(pump) and not running(fast)      # idle
        await send(pilot, "go")
        await wait_for(pilot, backend.held.is_set)
        assert running(pump) and running(fast) and not running(slow)          # streaming
        backend.release()
        await wait_for(pilot, lambda: not replies.live)
        await idle(pilot)
        assert running(slow) and not running(pump) and not running(fast)      # idle again
