"""The main screen: conversation list, messages + input, toggles and the telemetry panel.

Its parts: replies.py streams the replies in flight, actions.py holds what the keys do, compare.py
Compare and the A/B table. It tells the app what it needs through messages (a finished reply, a
model or a compare asked for); the app sets what the screen shows (toggles, capabilities) from
above.
"""
from __future__ import annotations

import re

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, ListView, Markdown, Static

from pdchat.chatapp.backends.base import Settings
from pdchat.chatapp.tui import draw_pace
from pdchat.chatapp.tui.live import LiveReply
from pdchat.chatapp.tui.screens.actions import ChatActions
from pdchat.chatapp.tui.screens.compare import CompareActions
from pdchat.chatapp.tui.screens.modals import WELCOME
from pdchat.chatapp.tui.screens.replies import Replies
from pdchat.chatapp.tui.store import NEW_CHAT
from pdchat.chatapp.tui.widgets.chat_input import ChatInput
from pdchat.chatapp.tui.widgets.conversations import ConversationList
from pdchat.chatapp.tui.widgets.messages import MessageView
from pdchat.chatapp.tui.widgets.telemetry import TelemetryPanel
from pdchat.chatapp.tui.widgets.toggles import TogglesBox

PANEL_S = 0.25         # the telemetry panel refreshes 4 times a second while a reply streams,
IDLE_PANEL_S = 1.0     # and once a second otherwise (device figures, machine-busy warning)

B = Binding
# F1 Help first: the footer shows the keys in this order and an 80-column one runs out before its end.
BINDINGS = [
    B("f1", "help", "Help", id="help"),
    B("escape", "cancel", "Cancel", id="cancel", priority=True),
    B("ctrl+n", "new_chat", "New", id="new_chat", priority=True),
    B("ctrl+r", "regenerate", "Regen", id="regenerate", priority=True),
    B("ctrl+e", "edit", "Edit", id="edit", priority=True),
    B("ctrl+y", "copy", "Copy", id="copy", priority=True),
    B("ctrl+o", "copy_code", "Copy code", id="copy_code", priority=True, show=False),
    B("ctrl+s", "export", "Export", id="export", priority=True),
    B("ctrl+t", "toggles", "Toggles", id="toggles", priority=True),
    B("ctrl+g", "compare", "Compare", id="compare", priority=True, show=False),
    B("f6", "ab_table", "A/B", id="ab_table", priority=True, show=False),   # over the input's select-line
    B("ctrl+f", "search", "Search", id="search", priority=True, show=False),
    B("ctrl+end", "follow", "Follow", id="follow", priority=True, show=False),
    B("f2", "rename", "Rename", id="rename", show=False),
    B("f3", "settings", "Settings", id="settings", show=False),
    B("f4", "model", "Model", id="model", show=False),
    B("f8", "delete_chat", "Delete", id="delete_chat", show=False),
]


class ChatScreen(ChatActions, CompareActions, Screen):
    BINDINGS = BINDINGS

    def __init__(self):
        super().__init__()
        self.conv_id: int | None = None
        self.replies = Replies(self)
        self.editing: int | None = None           # message id being edited
        self._compare_skip: int | None = None     # a reply left out of the next history (compare)
        self.last_export = None

    # ---- layout ---------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        app = self.app
        yield Header(show_clock=False)
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Input(placeholder="search…", id="search")
                yield ConversationList(id="conv-list")
            with Vertical(id="chat"):
                yield VerticalScroll(Markdown(WELCOME, id="welcome"), id="messages")
                yield Static("", id="status")
                yield ChatInput(id="input", cursor_blink=not self.app.is_headless)
            with Vertical(id="side"):
                yield TogglesBox(app.toggles, app.backend.capabilities, id="toggles")
                yield TelemetryPanel(id="telemetry")
        yield Footer()

    def on_mount(self) -> None:
        convs = self.store.conversations()
        self.refresh_list()
        if convs:
            self.call_after_refresh(self.open_conversation, convs[0].id)
        # Anchored: the list follows a growing reply (and its summary line) while the user is at
        # the bottom; scrolling up lets go, scrolling back down or Ctrl+End follows again.
        self.query_one("#messages", VerticalScroll).anchor()
        # Idle, the app wakes only for the slow panel refresh: the text pump and the fast refresh
        # run instead of it while a reply streams (Replies resumes and pauses them).
        self.replies.while_live(self.set_interval(draw_pace.MIN_S, self.replies.pump, pause=True),
                                self.set_interval(PANEL_S, self.refresh_panel, pause=True),
                                idle=(self.set_interval(IDLE_PANEL_S, self.refresh_panel),))
        self.refresh_panel()
        self.query_one("#input").focus()

    @property
    def store(self):
        return self.app.store

    @property
    def backend(self):
        return self.app.backend

    @property
    def live(self) -> dict[int, LiveReply]:
        return self.replies.live

    def set_status(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    # ---- conversations --------------------------------------------------------------------------
    def refresh_list(self) -> None:
        search = self.query_one("#search", Input).value.strip() or None
        rows = self.query_one("#conv-list", ConversationList)
        rows.show(self.store.conversations(search), live=self.live, current=self.conv_id)

    @on(Input.Changed, "#search")
    def _search(self) -> None:
        self.refresh_list()

    @on(ListView.Selected, "#conv-list")
    async def _selected(self, event: ListView.Selected) -> None:
        conv_id = getattr(event.item, "conv_id", None)
        if conv_id is not None:
            self.remove_class("-show-sidebar")
            await self.open_conversation(conv_id)
            self.query_one("#input").focus()

    def new_conversation(self) -> int:
        """A new conversation, or the current one while it is still empty (Ctrl+N again and
        again must not pile up empty chats)."""
        if self.conv_id is not None and self.conv_id not in self.live and not self.store.messages(self.conv_id):
            return self.conv_id
        return self.store.create_conversation().id

    async def open_conversation(self, conv_id: int) -> None:
        if conv_id != self.conv_id:            # leaving a chat: one left unused must not pile up
            self.store.drop_empty(keep=conv_id)
        self.conv_id = conv_id
        self.editing = None
        self.replies.stream_view = None
        box = self.query_one("#messages", VerticalScroll)
        await box.remove_children()
        views = [MessageView(m.role, m.content, message_id=m.id, status=m.status, metrics=m.metrics)
                 for m in self.store.messages(conv_id)]
        live = self.live.get(conv_id)
        if live is not None:
            views = [v for v in views if v.message_id != live.message_id]
        await box.mount_all(views or [Markdown(WELCOME, id="welcome")])
        if live is not None:
            await self.replies.show(live)
        conv = self.store.conversation(conv_id)
        self.sub_title = conv.title if conv else ""
        box.scroll_end(animate=False)
        self.refresh_list()
        self.refresh_panel()

    def history(self, conv_id: int) -> list[dict[str, str]]:
        skip, self._compare_skip = self._compare_skip, None
        return [{"role": m.role, "content": m.content} for m in self.store.messages(conv_id)
                if m.role in ("user", "assistant") and m.content.strip() and m.id != skip
                and m.status != "streaming"]

    def last_metrics(self) -> dict | None:
        if self.conv_id is None:
            return None
        for m in reversed(self.store.messages(self.conv_id)):
            if m.role == "assistant" and m.metrics:
                return m.metrics
        return None

    # ---- sending and streaming ------------------------------------------------------------------
    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    async def send(self, text: str) -> None:
        if not self.app.ready:
            self.notify("The model is still loading; your message is kept in the input.", severity="warning")
            return
        if self.conv_id is None:
            await self.open_conversation(self.new_conversation())
        elif self.store.conversation(self.conv_id) is None:
            # Deleted under us (another pdchat on the same data dropped it as an unused empty
            # chat): the message goes into a new one rather than failing.
            await self.open_conversation(self.store.create_conversation().id)
        if self.conv_id in self.live:
            self.notify("A reply is still being generated here (Esc cancels it).", severity="warning")
            return
        if self.editing is not None:
            for m in self.store.messages(self.conv_id):
                if m.id >= self.editing:
                    self.store.delete_message(m.id)
            self.editing = None
            await self.open_conversation(self.conv_id)
        conv = self.store.conversation(self.conv_id)
        if conv and conv.title == NEW_CHAT:
            title = re.sub(r"\s+", " ", text).strip()
            self.store.rename(conv.id, title[:40] + ("…" if len(title) > 40 else ""))
            self.sub_title = self.store.conversation(conv.id).title
        msg = self.store.add_message(self.conv_id, "user", text)
        self.query_one("#input", ChatInput).clear()
        for welcome in self.query("#welcome"):
            await welcome.remove()
        await self.query_one("#messages").mount(MessageView("user", text, message_id=msg.id))
        await self.start_reply(self.conv_id)

    def settings_for(self, conv_id: int) -> Settings:
        conv = self.store.conversation(conv_id)
        return Settings.from_dict({**self.app.default_settings.to_dict(), **(conv.settings if conv else {})})

    async def start_reply(self, conv_id: int, label: str | None = None) -> bool:
        started = await self.replies.start(conv_id, self.history(conv_id), label)
        self.refresh_list()
        return started

    def refresh_panel(self) -> None:
        live = self.live.get(self.conv_id) if self.conv_id is not None else None
        try:
            stats = self.backend.stats() if self.app.ready else {}
            notices = self.backend.notices() if self.app.ready else []
        except Exception:
            stats, notices = {}, []
        self.app.toggle_control.follow_engine(stats, notices)
        last = self.last_metrics()
        snap = live.snapshot() if live else None
        tokens = 0
        if last:
            tokens = (last.get("prompt_tokens") or 0) + (last.get("output_tokens") or 0)
        if snap:
            tokens = snap.total + snap.output_tokens
        self.query_one(TelemetryPanel).update_data(stats, snap, last, self.backend.capabilities,
                                                   self.app.toggles.to_dict(), tokens, self.backend.now())

    def on_unmount(self) -> None:
        """The app is ending (quit, hang-up): stop the replies and keep what they streamed."""
        self.replies.interrupt_all()

    def on_resize(self, event) -> None:
        narrow = event.size.width < 110
        self.set_class(narrow, "-narrow")
        self.query_one(Footer).compact = narrow          # room for more key hints
