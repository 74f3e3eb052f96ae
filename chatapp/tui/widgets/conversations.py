"""One row of the conversation list: the title on up to two lines, then when its last message came,
so two chats that start alike still look different; the open conversation is marked `-current`."""
from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.widgets import Label, ListItem

from pdchat.chatapp.tui.store import Conversation


def when(updated: float, now: float | None = None) -> str:
    """A short local time: "14:32" today, "3 Mar 14:32" this year, "3 Mar 2024" before."""
    t, today = time.localtime(updated), time.localtime(time.time() if now is None else now)
    if t[:3] == today[:3]:
        return time.strftime("%H:%M", t)
    return f"{t.tm_mday} " + time.strftime("%b %H:%M" if t.tm_year == today.tm_year else "%b %Y", t)


class ConversationItem(ListItem):
    def __init__(self, conv: Conversation, *, live: bool = False, current: bool = False):
        super().__init__(classes="conv-item -current" if current else "conv-item")
        self.conv_id = conv.id
        self.conv_title = ("● " if live else "") + conv.title        # ● a reply is being generated there
        self.updated = conv.updated

    def compose(self) -> ComposeResult:
        # markup=False: a title is the user's own text, brackets included
        yield Label(self.conv_title, classes="conv-title", markup=False)
        yield Label(when(self.updated), classes="conv-when")

    def show(self, conv: Conversation, *, live: bool = False, current: bool = False) -> None:
        """The row of the same conversation, as it is now: updated in place (rebuilding the whole
        list at every reply's start and end remounted every row while the model prefilled)."""
        title = ("● " if live else "") + conv.title
        if (title, conv.updated) != (self.conv_title, self.updated):
            self.conv_title, self.updated = title, conv.updated
            self.query_one(".conv-title", Label).update(title)
            self.query_one(".conv-when", Label).update(when(conv.updated))
        self.set_class(current, "-current")
