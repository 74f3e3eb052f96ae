"""The panel's Device section: the machine's CPU beside pdchat's own, the machine-busy warning, and an
idle app that does not wake up for the reply timers. FakeBackend's clock moves only when told to."""
from __future__ import annotations

import pytest
from rich.cells import cell_len
from textual.widgets import Static

from pdchat.chatapp.tui.machine_busy import BUSY_S
from pdchat.chatapp.tui.screens.replies import Replies
from tests.doubles.fake_backend import FakeBackend

from .helpers import idle, ready, send, wait_for

pytestmark = pytest.mark.anyio

SIZES = [(80, 24), (160, 48)]


def device(app) -> Static:
    return app.chat.query_one("#tm-device", Static)


def lines(app) -> list[str]:
    return str(device(app).render()).split("\n")


def row(app, label: str) -> str | None:
    """The value of the Device row `label`, None when there is no such row."""
    found = [line[13:] for line in lines(app) if line[:13].rstrip() == label]
    return found[0] if found else None


def refresh(app, seconds: float = 0.0) -> None:
    app.backend.clock.advance(seconds)
    app.chat.refresh_panel()


@pytest.mark.parametrize("size", SIZES)
async def test_cpu_device_shows_the_machine_and_pdchat_apart(make_app, size):
    app = make_app(FakeBackend())
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        refresh(app)
        assert row(app, "machine CPU") == "38%"
        assert row(app, "pdchat CPU") == "30% of machine"
        assert row(app, "pdchat RSS") == "812.0 MB"
        # what the RSS holds: 538 MB of model, 1,024 blocks x 16 tokens x 9,216 B of KV, the rest
        assert (row(app, "  model"), row(app, "  KV pool"), row(app, "  other")) == ("538.0 MB", "144.0 MB", "130.0 MB")
        assert row(app, "weights/step") == "269.0 MB"
        assert "machine busy" not in str(device(app).render())


@pytest.mark.parametrize("size", SIZES)
async def test_gpu_device_adds_the_machine_cpu_under_the_gpu(make_app, size):
    app = make_app(FakeBackend(gpu=True))
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        refresh(app)
        assert lines(app)[0] == "NVIDIA H100 80GB HBM3"
        assert (row(app, "GPU util"), row(app, "machine CPU"), row(app, "pdchat CPU")) == \
            ("87%", "12%", "10% of machine")
        assert row(app, "pdchat RSS") == "2.0 GB"
        labels = [line[:13].rstrip() for line in lines(app)]
        # the model and the pool sit in GPU memory: under it, and no "other" share of the RSS
        assert labels.index("  model") == labels.index("power") - 2 == labels.index("  KV pool") - 1
        assert (row(app, "  model"), row(app, "  KV pool"), row(app, "  other")) == ("538.0 MB", "144.0 MB", None)


@pytest.mark.parametrize("size", SIZES)
async def test_busy_machine_warns_after_a_few_seconds_and_clears(make_app, size):
    app = make_app(FakeBackend())
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        app.backend.cpu_util_pct, app.backend.process_cpu_pct = 95.0, 10.0
        refresh(app)
        refresh(app, BUSY_S / 2)
        assert "machine busy" not in str(device(app).render())      # not yet: it may be a burst
        refresh(app, BUSY_S / 2)
        assert lines(app)[-2:] == ["machine busy: others 85%", "timings will be noisy"]
        assert all(cell_len(line) <= device(app).size.width for line in lines(app))   # fits, no wrap
        app.backend.cpu_util_pct = 40.0                               # others at 30%: still busy
        refresh(app, 1.0)
        assert lines(app)[-2] == "machine busy: others 30%"
        app.backend.cpu_util_pct = 35.0
        refresh(app, 1.0)
        assert lines(app)[-1] == "weights/step 269.0 MB"


async def test_no_warning_without_pdchats_own_figure(make_app):
    app = make_app(FakeBackend())
    async with app.run_test(size=SIZES[1]) as pilot:
        await ready(pilot)
        app.backend.cpu_util_pct, app.backend.process_cpu_pct = 99.0, None
        for _ in range(3):
            refresh(app, BUSY_S)
        assert row(app, "pdchat CPU") == "n/a"
        assert "machine busy" not in str(device(app).render())


@pytest.mark.parametrize("size", SIZES)
async def test_device_history_fills_the_section_without_wrapping(make_app, size):
    app = make_app(FakeBackend())
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await pilot.pause()                       # the panel's scrollbar (80x24) is laid out
        for i in range(60):
            app.backend.cpu_util_pct, app.backend.process_cpu_pct = 20.0 + i, 10.0 + i     # pdchat's own load
            refresh(app, 0.25)
        spark = lines(app)[2]
        width = device(app).size.width
        assert len(lines(app)) == 9 and spark.strip()
        assert cell_len(spark) == width - 1                 # the history as wide as the section allows
        assert all(cell_len(line) <= width for line in lines(app))


async def test_an_unchanged_section_is_not_redrawn(make_app, monkeypatch):
    app = make_app(FakeBackend())
    async with app.run_test(size=SIZES[1]) as pilot:
        await ready(pilot)
        refresh(app)
        calls: list[bool] = []
        static = device(app)
        real_update = static.update
        monkeypatch.setattr(static, "update", lambda text, layout=True: (calls.append(layout),
                                                                          real_update(text, layout=layout)))
        refresh(app)                                          # same clock, same figures
        assert calls == []
        app.backend.process_cpu_pct = 31.0                    # a number changes: no new layout
        refresh(app)
        app.backend.cpu_util_pct, app.backend.process_cpu_pct = 95.0, 5.0
        refresh(app)
        refresh(app, BUSY_S)                                  # the warning adds lines: a layout
        assert calls == [False, False, True]


async def test_reply_timers_run_only_while_a_reply_streams(make_app, monkeypatch):
    pumps: list[int] = []
    real_pump = Replies.pump

    async def counting_pump(self: Replies) -> None:
        pumps.append(1)
        await real_pump(self)

    monkeypatch.setattr(Replies, "pump", counting_pump)
    app = make_app(FakeBackend(hold="decode:2"))
    async with app.run_test(size=SIZES[1]) as pilot:
        await ready(pilot)
        await pilot.pause(0.3)
        assert pumps == []                                    # idle: the pump never woke up
        await send(pilot, "hello")
        await wait_for(pilot, lambda: app.backend.held.is_set())
        await wait_for(pilot, lambda: "DECODE" in str(app.chat.query_one("#tm-phase").render()))
        app.backend.release()
        await idle(pilot)                                     # the pump finished the reply
        done = len(pumps)
        assert done > 0
        await pilot.pause(0.3)
        assert len(pumps) == done                             # and went back to sleep
