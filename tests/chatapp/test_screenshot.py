"""F12 (and the palette) save an SVG of the app into the export folder, made if missing; a folder
that cannot be written is one error line, never a traceback."""
from __future__ import annotations

import pytest

from pdchat.chatapp.tui.palette import palette_commands
from pdchat.chatapp.tui.screens.modals import HELP

from .helpers import ready, wait_for

pytestmark = pytest.mark.anyio


def notes(app, severity: str = "information") -> list[str]:
    return [n.message for n in app._notifications if n.severity == severity]


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_f12_saves_an_svg_into_the_export_folder(make_app, tmp_path, size):
    app = make_app()
    folder = tmp_path / "exports"
    assert not folder.exists()                   # made on the first screenshot
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await pilot.press("f12")
        await wait_for(pilot, lambda: list(folder.glob("*.svg")))
        await pilot.press("f12")                 # a second one in the same second is a new file
        await wait_for(pilot, lambda: len(list(folder.glob("*.svg"))) == 2)
        for shot in folder.glob("*.svg"):
            text = shot.read_text(encoding="utf-8")
            assert text.lstrip().startswith("<svg") and "pdchat" in text
            assert any(str(shot) in n for n in notes(app))
    assert "| F12 |" in HELP


async def test_the_palette_saves_a_screenshot_too(make_app, tmp_path):
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        assert [c.title for c in palette_commands(app) if c.title == "Save screenshot"]
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Save screenshot")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: list((tmp_path / "exports").glob("*.svg")))
        [shot] = (tmp_path / "exports").glob("*.svg")
        text = shot.read_text(encoding="utf-8")
        assert "Welcome&#160;to&#160;pdchat" in text and "Save&#160;screenshot" not in text   # the app, not the palette


async def test_an_unwritable_folder_is_one_error_line(make_app, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the folder should be")
    app = make_app()
    app.export_dir = blocker / "shots"
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.press("f12")
        await wait_for(pilot, lambda: notes(app, "error"))
        [error] = notes(app, "error")
        assert error.startswith("Screenshot failed:") and "\n" not in error
        assert app.is_running


async def test_f12_works_on_every_screen_and_textuals_own_entry_is_replaced(make_app, tmp_path):
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.press("f1")                  # the help screen is on top
        await pilot.pause(0.1)
        await pilot.press("f12")
        await wait_for(pilot, lambda: list((tmp_path / "exports").glob("*.svg")))
        [shot] = (tmp_path / "exports").glob("*.svg")
        assert "pdchat&#160;keys" in shot.read_text(encoding="utf-8")
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert titles.count("Save screenshot") == 1 and "Screenshot" not in titles
