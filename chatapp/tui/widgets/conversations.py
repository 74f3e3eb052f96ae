"""The conversation list: one row per chat, the title on up to two lines, then when its last message
came, so two chats that start alike still look different; the open conversation is marked
`-current`, and a chat whose reply is being generated shows a ●."""
from __future__ import annotations

import time
from collections.abc import Container

from textual.app import ComposeResult
from textual.widgets import Label, ListItem, ListView

from pdchat.chatapp.tui.store import Conversation


def when(updated: float, now: float | None = None) -> str:
    """A short local time: "14:32" today, "3 Mar 14:32" this year, "3 Mar 2024" before."""
    t, today = time.localtime(updated), time.localtime(time.time() if now is None else now)
    if t[:3] == today[:3]:
        return time.strftime("%H:%M", t)
    return f"{t.tm_mday} " + time.strftime("%b %H:%M" if t.tm_year == today.tm_year else "%b %Y", t)


def _title(conv: Conversation, live: bool) -> str:
    return ("● " if live else "") + conv.title        # ● a reply is being generated there


class ConversationItem(ListItem):
    def __init__(self, conv: Conversation, *, live: bool = False, current: bool = False):
        super().__init__(classes="conv-item -current" if current else "conv-item")
        self.conv_id = conv.id
        self.conv_title = _title(conv, live)
        self.updated = conv.updated

    def compose(self) -> ComposeResult:
        # markup=False: a title is the user's own text, brackets included
        yield Label(self.conv_title, classes="conv-title", markup=False)
        yield Label(when(self.updated), classes="conv-when")

    def show(self, conv: Conversation, *, live: bool = False, current: bool = False) -> None:
        """The same conversation, as it is now (ConversationList updates its rows in place)."""
        title = _title(conv, live)
        if (title, conv.updated) != (self.conv_title, self.updated):
            self.conv_title, self.updated = title, conv.updated
            self.query_one(".conv-title", Label).update(title)
            self.query_one(".conv-when", Label).update(when(conv.updated))
        self.set_class(current, "-current")


class ConversationList(ListView):
    """The rows of `show`'s chats. The same chats in the same order (a reply began or ended, a title
    changed) are updated in place: rebuilding the list at every reply's start and end remounted
    every row while the model prefilled (41 chats: a follow-up's TTFT in the app 138-330 ms, 93-129
    updated in place, 2026-11-27). Otherwise the rows are rebuilt, and the cursor goes on the open
    chat once they are mounted."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._rebuilds = 0                 # rebuilds not mounted yet: their rows, not the shown, count

    def show(self, convs: list[Conversation], *, live: Container[int], current: int | None) -> None:
        at = next((i for i, c in enumerate(convs) if c.id == current), None)
        shown = list(self.children)
        if not self._rebuilds and [getattr(row, "conv_id", None) for row in shown] == [c.id for c in convs]:
            for row, c in zip(shown, convs):
                row.show(c, live=c.id in live, current=c.id == current)
            if at is not None and self.index != at:
                self.index = at
            return
        rows = [ConversationItem(c, live=c.id in live, current=c.id == current) for c in convs]
        removed, mounted = self.clear(), self.extend(rows)
        self._rebuilds += 1

        async def cursor_on_current() -> None:
            # Only once the old rows are gone: until then an index would count them too.
            try:
                await removed
                await mounted
            finally:
                self._rebuilds -= 1
            if at is not None and list(self.children) == rows:     # not refilled since
                self.index = at
        self.call_later(cursor_on_current)
