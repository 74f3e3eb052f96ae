"""Every line of every telemetry section fits its section at 80x24 and 160x48, in each phase of a
reply: a line that wraps breaks bars and splits numbers."""
from __future__ import annotations

import pytest
from rich.cells import cell_len

from tests.doubles.fake_backend import FakeBackend

from .helpers import idle, ready, send, wait_for

pytestmark = pytest.mark.anyio

SECTIONS = ("phase", "latency", "timeline", "kv", "batch", "workers", "spec", "device")


def overflowing(app) -> list[tuple[str, str, int]]:
    out = []
    for name in SECTIONS:
        section = app.chat.query_one(f"#tm-{name}")
        width = section.content_size.width
        out += [(name, line, width) for line in str(section.render()).split("\n") if cell_len(line) > width]
    return out


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_no_section_line_wraps_in_any_phase(make_app, size):
    app = make_app(FakeBackend(hold="prefill"))
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await send(pilot, " ".join(f"w{i}" for i in range(2497)))      # 10,000 prompt tokens
        await wait_for(pilot, app.backend.held.is_set)
        await pilot.pause(0.3)
        assert overflowing(app) == []                                   # prefill, layer by layer
        app.backend.release()
        await idle(pilot)
        await send(pilot, "and a second turn, mostly cached")
        await idle(pilot)
        assert app.chat.last_metrics()["cached_prompt_tokens"] > 0
        await pilot.pause(0.3)
        assert overflowing(app) == []                                   # finished, with a cache hit


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_no_section_line_wraps_while_disaggregated(make_app, size):
    app = make_app(FakeBackend(hold="transfer"))
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        assert await app.apply_toggles({"disaggregate": True})
        await send(pilot, " ".join(f"w{i}" for i in range(2497)))      # 10,000 prompt tokens
        await wait_for(pilot, app.backend.held.is_set)
        await pilot.pause(0.3)
        assert app.chat.query_one("#tm-workers").display
        assert overflowing(app) == []                                   # the K/V crossing, the worker busy
        app.backend.release()
        await idle(pilot)
        await pilot.pause(0.3)
        assert app.chat.last_metrics()["kv_transfer_ms"] is not None
        assert overflowing(app) == []                                   # finished: transfer rows and segment


def test_the_decode_row_says_how_steps_launch():
    from pdchat.chatapp.tui.widgets.panel_sections import graph_words
    assert graph_words({"graph_state": "on", "graph_rows": 5, "graph_size": 8}) == "graph, 5 rows in 8"
    assert graph_words({"graph_state": "on", "graph_rows": 8, "graph_size": 8}) == "graph, 8 rows"
    assert graph_words({"graph_state": "on"}) == "CUDA graphs ready"
    assert graph_words({"graph_state": "off"}) == "eager (CUDA graphs off)"
    assert graph_words({"graph_state": "failed: RuntimeError: x"}) == "eager (CUDA graphs failed: RuntimeError: x)"
