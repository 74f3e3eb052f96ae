"""The main screen: conversation list, messages + input, toggles and the telemetry panel."""
from __future__ import annotations

import re

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Label, ListItem, ListView, Static

from ..backend import Done, Settings
from ..live import LiveReply
from ..widgets.chat_input import ChatInput
from ..widgets.messages import MessageView
from ..widgets.telemetry import TelemetryPanel
from ..widgets.toggles import TogglesBox
from .actions import ChatActions

PUMP_S = 0.08          # text reaches the Markdown stream at most this often
PANEL_S = 0.25         # the telemetry panel refreshes 4 times a second
SAVE_S = 0.5           # a streaming reply is written to the database at least this often

B = Binding
BINDINGS = [
    B("escape", "cancel", "Cancel", id="cancel", priority=True),
    B("ctrl+n", "new_chat", "New", id="new_chat", priority=True),
    B("ctrl+r", "regenerate", "Regen", id="regenerate", priority=True),
    B("ctrl+e", "edit", "Edit", id="edit", priority=True),
    B("ctrl+y", "copy", "Copy", id="copy", priority=True),
    B("ctrl+o", "copy_code", "Copy code", id="copy_code", priority=True, show=False),
    B("ctrl+s", "export", "Export", id="export", priority=True),
    B("ctrl+t", "toggles", "Toggles", id="toggles", priority=True),
    B("ctrl+g", "compare", "Compare", id="compare", priority=True, show=False),
    B("ctrl+f", "search", "Search", id="search", priority=True, show=False),
    B("f1", "help", "Help", id="help"),
    B("f2", "rename", "Rename", id="rename", show=False),
    B("f3", "settings", "Settings", id="settings", show=False),
    B("f4", "model", "Model", id="model", show=False),
    B("f8", "delete_chat", "Delete", id="delete_chat", show=False),
]


class ChatScreen(ChatActions, Screen):
    BINDINGS = BINDINGS

    def __init__(self):
        super().__init__()
        self.conv_id: int | None = None
        self.live: dict[int, LiveReply] = {}
        self.stream_view: MessageView | None = None
        self.editing: int | None = None           # message id being edited
        self.compare_restore: dict | None = None
        self._last_save: dict[int, float] = {}
        self._compare_skip: int | None = None
        self.last_export = None

    # ---- layout ---------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        app = self.app
        yield Header(show_clock=False)
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Input(placeholder="search…", id="search")
                yield ListView(id="conv-list")
            with Vertical(id="chat"):
                yield VerticalScroll(id="messages")
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
        self.set_interval(PUMP_S, self.pump)
        self.set_interval(PANEL_S, self.refresh_panel)
        self.refresh_panel()
        self.query_one("#input").focus()

    @property
    def store(self):
        return self.app.store

    @property
    def backend(self):
        return self.app.backend

    def set_status(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    # ---- conversations --------------------------------------------------------------------------
    def refresh_list(self) -> None:
        search = self.query_one("#search", Input).value.strip() or None
        lv = self.query_one("#conv-list", ListView)
        lv.clear()
        for i, c in enumerate(self.store.conversations(search)):
            mark = "● " if c.id in self.live else ""
            item = ListItem(Label(mark + c.title), classes="conv-item")
            item.conv_id = c.id
            lv.append(item)
            if c.id == self.conv_id:
                lv.index = i

    @on(Input.Changed, "#search")
    def _search(self) -> None:
        self.refresh_list()

    @on(ListView.Selected, "#conv-list")
    async def _selected(self, event: ListView.Selected) -> None:
        conv_id = getattr(event.item, "conv_id", None)
        if conv_id is not None:
            await self.open_conversation(conv_id)
            self.query_one("#input").focus()

    def new_conversation(self) -> int:
        conv = self.store.create_conversation("New chat", {})
        return conv.id

    async def open_conversation(self, conv_id: int) -> None:
        self.conv_id = conv_id
        self.editing = None
        self.stream_view = None
        box = self.query_one("#messages", VerticalScroll)
        await box.remove_children()
        views = [MessageView(m.role, m.content, message_id=m.id, status=m.status, metrics=m.metrics)
                 for m in self.store.messages(conv_id)]
        live = self.live.get(conv_id)
        if live is not None:
            views = [v for v in views if v.message_id != live.message_id]
        await box.mount_all(views)
        if live is not None:
            view = MessageView("assistant", live.taken_text(), message_id=live.message_id)
            await box.mount(view)
            view.start_stream()
            self.stream_view = view
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
        if conv and conv.title == "New chat":
            title = re.sub(r"\s+", " ", text).strip()
            self.store.rename(conv.id, title[:40] + ("…" if len(title) > 40 else ""))
            self.sub_title = self.store.conversation(conv.id).title
        msg = self.store.add_message(self.conv_id, "user", text)
        self.query_one("#input", ChatInput).clear()
        await self.query_one("#messages").mount(MessageView("user", text, message_id=msg.id))
        await self.start_reply(self.conv_id)

    def settings_for(self, conv_id: int) -> Settings:
        conv = self.store.conversation(conv_id)
        return Settings.from_dict({**self.app.default_settings.to_dict(), **(conv.settings if conv else {})})

    async def start_reply(self, conv_id: int, label: str | None = None) -> bool:
        try:
            gen = self.backend.stream(self.history(conv_id), self.settings_for(conv_id))
        except Exception as e:                        # engine errors never kill the UI
            self.notify(f"Could not start a reply: {e}", severity="error")
            return False
        msg = self.store.add_message(conv_id, "assistant", "", status="streaming")
        live = LiveReply(conv_id, msg.id, self.backend.now)
        live.generation = gen
        live.label = label
        self.live[conv_id] = live
        if conv_id == self.conv_id:
            view = MessageView("assistant", "", message_id=msg.id)
            await self.query_one("#messages").mount(view)
            view.start_stream()
            self.stream_view = view
            self.query_one("#messages", VerticalScroll).scroll_end(animate=False)
        self.run_worker(lambda: self._consume(live), thread=True, group="gen", exit_on_error=False)
        self.refresh_list()
        return True

    def _consume(self, live: LiveReply) -> None:
        """Worker thread: drain the generation into the LiveReply."""
        try:
            for ev in live.generation:
                live.feed(ev)
                if isinstance(ev, Done):
                    return
            if live.done is None:
                live.feed(Done(live.full_text(), "error", {}, "the stream ended without a result"))
        except Exception as e:
            live.feed(Done(live.full_text(), "error", {}, f"{type(e).__name__}: {e}"))

    async def pump(self) -> None:
        """Timer: move new text into the view, save growing replies, finish completed ones."""
        box = self.query_one("#messages", VerticalScroll)
        for conv_id, live in list(self.live.items()):
            follow = box.scroll_y >= box.max_scroll_y - 1
            fragment = live.take_text()
            view = self.stream_view if conv_id == self.conv_id else None
            if view is not None and fragment:
                await view.append(fragment)
            now = self.app.clock()
            if live.done is not None:
                await self.finish_reply(live, view)
            elif fragment and now - self._last_save.get(conv_id, 0) >= SAVE_S:
                self.store.update_message(live.message_id, content=live.full_text())
                self._last_save[conv_id] = now
            if view is not None and follow:
                box.scroll_end(animate=False)

    async def finish_reply(self, live: LiveReply, view: MessageView | None) -> None:
        done = live.done
        status = {"cancelled": "cancelled", "error": "error"}.get(done.finish_reason, "done")
        text = live.full_text()
        metrics = dict(done.metrics or {})
        if getattr(live, "label", None):
            metrics["label"] = live.label
        self.store.update_message(live.message_id, content=text, status=status, metrics=metrics)
        self.live.pop(live.conversation_id, None)
        if view is not None:
            await view.finish(text, status, metrics)
            if view is self.stream_view:
                self.stream_view = None
        self.app.close_retired()
        if done.error:
            self.notify(f"Generation failed: {done.error}", severity="error")
        if self.compare_restore is not None and live.conversation_id == self.compare_restore.get("conv"):
            await self.app.apply_toggles({k: v for k, v in self.compare_restore.items() if k != "conv"},
                                         quiet=True)
            self.compare_restore = None
            self.notify("Compare done: both summaries are shown under the replies.")
        self.refresh_list()
        self.refresh_panel()

    def refresh_panel(self) -> None:
        live = self.live.get(self.conv_id) if self.conv_id is not None else None
        try:
            stats = self.backend.stats() if self.app.ready else {}
        except Exception:
            stats = {}
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
        for live in list(self.live.values()):
            live.generation.cancel()
            self.store.update_message(live.message_id, content=live.full_text(), status="interrupted")

    def on_resize(self, event) -> None:
        self.set_class(event.size.width < 110, "-narrow")
