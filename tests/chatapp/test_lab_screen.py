"""The Lab screen with a scripted lab result: no real run, no model."""
from __future__ import annotations

import io
import threading
from types import SimpleNamespace

import pytest
from rich.console import Console
from textual.widgets import Static

from pdchat.chatapp.tui.screens.lab import LabScreen
from pdchat.bench import lab_files

from .helpers import wait_for

pytestmark = pytest.mark.anyio

RESULT = {
    "suite": "lab", "model": "scripted", "device": "cpu", "dtype": "float32", "machine": {"date": "2026-11-22"},
    "claims": [
        {"id": "prefill_linear", "claim": "Prefill time grows about linearly with prompt length",
         "verdict": "confirmed", "rule": "R² >= 0.95", "numbers": {"r2": 0.998}},
        {"id": "prefill_vs_decode", "claim": "A 1,000-token prompt prefills in the time of 5-10 decode tokens",
         "verdict": "not confirmed", "rule": "5 <= ratio <= 10", "numbers": {"decode_tokens_equivalent": 29.5}},
    ],
    "curves": [{"id": "prefill", "title": "Prefill time vs prompt length", "x_label": "prompt tokens",
                "y_label": "ms", "x": [16, 256, 1024], "y": [40.0, 560.0, 2200.0], "role": "prefill",
                "kind": "line"}],
}


def screen_text(app) -> str:
    """What the screen's three parts show, as plain text (Rich tables rendered at 140 columns)."""
    console = Console(width=140, record=True, file=io.StringIO())
    for part in ("status", "verdicts", "curves"):
        console.print(app.screen.query_one(f"#lab-{part}", Static).content)
    return console.export_text()


async def test_f9_opens_the_lab_and_says_why_it_cannot_run_here(make_app):
    app = make_app()                                   # the FakeBackend is not a local engine
    async with app.run_test(size=(140, 44)) as pilot:
        await pilot.press("f9")
        await wait_for(pilot, lambda: isinstance(app.screen, LabScreen))
        assert "not available with this backend" in screen_text(app)
        await pilot.press("r")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, LabScreen))


async def test_run_shows_progress_then_verdicts_and_curves(make_app):
    app = make_app()
    release = threading.Event()
    fractions = []

    def runner(progress, quick=False):
        progress("prefill sweep", 0.25)
        release.wait(5)
        fractions.append(0.25)
        return RESULT

    async with app.run_test(size=(140, 44)) as pilot:
        await app.push_screen(LabScreen(runner, load_last=lambda: None))
        assert "No lab run yet" in screen_text(app)
        await pilot.press("r")
        bar = app.screen.query_one("#lab-progress")
        await wait_for(pilot, lambda: bar.progress == 0.25 and bar.display)
        assert "running: prefill sweep" in screen_text(app)
        release.set()
        await wait_for(pilot, lambda: not app.screen.running)
        text = screen_text(app)
        assert "confirmed" in text and "not confirmed" in text and "29.5" in text
        assert "Prefill time vs prompt length (ms)" in text and "2.2k" in text
        assert not bar.display and fractions == [0.25]


async def test_a_failed_run_is_reported_not_fatal(make_app):
    app = make_app()

    def runner(progress, quick=False):
        raise RuntimeError("out of memory")

    async with app.run_test(size=(140, 44)) as pilot:
        await app.push_screen(LabScreen(runner, load_last=lambda: None))
        await pilot.press("r")
        await wait_for(pilot, lambda: not app.screen.running)
        assert "lab failed" in screen_text(app) and "out of memory" in screen_text(app)


async def test_opens_on_the_last_saved_run(make_app):
    files = lab_files.save(RESULT)
    app = make_app()
    async with app.run_test(size=(140, 44)) as pilot:
        await app.push_screen(LabScreen(None, "remote backend", load_last=lab_files.last_run))
        await pilot.pause()
        text = screen_text(app)
        assert "scripted on cpu" in text and files["dir"] in text and "remote backend" in text
        assert "Prefill time grows about linearly" in text


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_q_runs_the_quick_lab_and_says_so(make_app, size, monkeypatch):
    from pdchat.chatapp.tui.screens import lab as lab_screen
    clock = [100.0]
    monkeypatch.setattr(lab_screen, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    app = make_app()
    release = threading.Event()
    asked = []

    def runner(progress, quick=False):
        asked.append(quick)
        clock[0] = 140.0                              # 40 s for half the run
        progress("prefill sweep: 128 tokens · 1/8", 0.5)
        release.wait(5)
        return {**RESULT, "mode": "quick" if quick else "full"}

    async with app.run_test(size=size) as pilot:
        await app.push_screen(LabScreen(runner, load_last=lambda: None))
        assert "q for a quick run" in screen_text(app)
        await pilot.press("q")
        bar = app.screen.query_one("#lab-progress")
        await wait_for(pilot, lambda: bar.progress == 0.5)
        # the time left at the pace so far, and no second estimate from the bar
        assert "quick run: prefill sweep: 128 tokens · 1/8 · ~40 s left" in screen_text(app)
        assert not bar.show_eta and not bar.query("ETAStatus")
        status = app.screen.query_one("#lab-status")
        assert status.region.width == size[0] and status.region.height >= 1    # on screen at this size
        release.set()
        await wait_for(pilot, lambda: not app.screen.running)
        assert asked == [True]
        assert "quick run: fewer points, noisier" in screen_text(app)


async def test_a_noisy_verdict_says_the_machine_was_busy(make_app):
    noisy = dict(RESULT["claims"][0], noisy="noisy: the machine was busy (other processes used 45% of it)")
    app = make_app()
    async with app.run_test(size=(140, 44)) as pilot:
        await app.push_screen(LabScreen(None, load_last=lambda: {**RESULT, "claims": [noisy]}))
        await pilot.pause()
        assert "the machine was busy (other processes used 45% of it)" in screen_text(app).replace("\n", " ")
