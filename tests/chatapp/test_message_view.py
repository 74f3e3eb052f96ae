"""A message's streamed text (chatapp/tui/widgets/messages.py): text that leaves its paragraph as
many lines as before repaints it without a layout of the screen; text that wraps onto a new line
lays it out, so the paragraph grows."""
from __future__ import annotations

import pytest
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll

from pdchat.chatapp.tui.widgets.messages import MessageParagraph, MessageView

pytestmark = pytest.mark.anyio


class OneMessage(App):
    def compose(self) -> ComposeResult:
        yield VerticalScroll(MessageView("assistant", ""))


async def test_streamed_text_lays_the_screen_out_only_when_its_paragraph_grows():
    app = OneMessage()
    async with app.run_test(size=(60, 20)) as pilot:
        view = app.query_one(MessageView)
        view.start_stream()
        await view.append("The first words")
        await pilot.pause()
        paragraph = app.query_one(MessageParagraph)
        width, lines = paragraph.content_size
        assert (lines, view.content) == (1, "The first words")
        layouts: list[bool] = []
        refresh = paragraph.refresh

        def spy(*regions, **kwargs):
            layouts.append(kwargs.get("layout", False))
            return refresh(*regions, **kwargs)

        paragraph.refresh = spy
        await view.append(" and more")                      # still one line
        await pilot.pause()
        assert layouts and not any(layouts)
        assert paragraph.content_size.height == 1 and "and more" in str(paragraph.render())
        layouts.clear()
        await view.append(" and" * width)                   # wraps: the paragraph must grow
        await pilot.pause()
        assert any(layouts)
        assert paragraph.content_size.height > 1
