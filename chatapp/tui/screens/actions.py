"""The chat screen's actions: what its keys (and the command palette) do."""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from textual.app import App
from textual.containers import VerticalScroll
from textual.widgets import Markdown
from textual.message import Message

from pdchat.chatapp import format as fmt
from pdchat.chatapp.tui.widgets.chat_input import ChatInput
from pdchat.chatapp.tui.widgets.messages import MessageView, code_blocks
from pdchat.chatapp.tui.screens.modals import WELCOME, HelpScreen, ModelPicker, SettingsScreen, TextPrompt
from pdchat.chatapp.tui.screens.replies import ReplyFinished

if TYPE_CHECKING:
    from pdchat.chatapp.tui.screens.chat import ChatScreen

ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System"}


def export_markdown(title: str, system: str | None, messages) -> str:
    out = [f"# {title}\n"]
    if system:
        out.append(f"> System: {system}\n")
    for m in messages:
        head = ROLE_TITLES.get(m.role, m.role)
        if m.status not in ("done",):
            head += f" ({m.status})"
        out.append(f"## {head}\n\n{m.content}\n")
        if m.role == "assistant" and m.metrics:
            out.append(f"*{fmt.summary(m.metrics)}*\n")
    return "\n".join(out)


def save_screenshot(app: App, folder: Path) -> Path:
    """Write an SVG of the screen as it is now into `folder` (made if missing); its path."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = folder / f"pdchat-{stamp}.svg", 1
    while path.exists():                     # two in the same second
        path, n = folder / f"pdchat-{stamp}-{n}.svg", n + 1
    path.write_text(app.export_screenshot(), encoding="utf-8")
    return path


class ModelRequested(Message):
    """The user picked a model to switch to (the app loads it beside the current one)."""

    def __init__(self, model: str):
        super().__init__()
        self.model = model


class ChatActions:
    """ChatScreen's key actions, kept apart from its layout and streaming. Every method runs on a
    ChatScreen (`self` is annotated so): its store, backend, replies, conv_id and helpers."""

    # ---- reply control --------------------------------------------------------------------------
    def action_cancel(self: "ChatScreen") -> None:
        if self.has_class("-show-sidebar"):            # the list Ctrl+F showed on a narrow terminal
            self.remove_class("-show-sidebar")
            self.query_one("#input").focus()
            return
        if self.replies.cancel(self.conv_id):
            return
        if self.editing is not None:
            self.editing = None
            self.query_one("#input", ChatInput).clear()
            self.notify("Edit cancelled.")

    async def action_regenerate(self: "ChatScreen") -> None:
        if not self._can_generate():
            return
        msgs = self.store.messages(self.conv_id)
        if not any(m.role == "user" for m in msgs):
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        while msgs and msgs[-1].role == "assistant":
            self.store.delete_message(msgs.pop().id)
        await self.open_conversation(self.conv_id)
        await self.start_reply(self.conv_id)

    def action_edit(self: "ChatScreen") -> None:
        if self.conv_id is None or self.conv_id in self.live:
            self.notify("Nothing to edit (or a reply is still running).", severity="warning")
            return
        users = [m for m in self.store.messages(self.conv_id) if m.role == "user"]
        if not users:
            self.notify("No message to edit yet.", severity="warning")
            return
        self.editing = users[-1].id
        box = self.query_one("#input", ChatInput)
        box.text = users[-1].content
        box.focus()
        self.notify("Editing your last message: Enter resends it, Esc cancels the edit.")

    def _can_generate(self: "ChatScreen") -> bool:
        if not self.app.ready:
            self.notify("The model is still loading.", severity="warning")
            return False
        if self.conv_id is None:
            self.notify("No conversation yet.", severity="warning")
            return False
        if self.conv_id in self.live:
            self.notify("A reply is still being generated here.", severity="warning")
            return False
        return True

    # ---- copy / export --------------------------------------------------------------------------
    def _target(self: "ChatScreen") -> MessageView | None:
        focused = self.app.focused
        if isinstance(focused, MessageView):
            return focused
        replies = [v for v in self.query(MessageView) if v.role == "assistant"]
        return replies[-1] if replies else None

    def action_copy(self: "ChatScreen") -> None:
        target = self._target()
        if target is None or not target.content:
            self.notify("Nothing to copy.", severity="warning")
            return
        self.app.copy_to_clipboard(target.content)
        self.notify(f"Copied the message ({len(target.content):,} characters).")

    def action_copy_code(self: "ChatScreen") -> None:
        target = self._target()
        blocks = code_blocks(target.content) if target else []
        if not blocks:
            self.notify("No code block in that message.", severity="warning")
            return
        self.app.copy_to_clipboard(blocks[-1])
        self.notify("Copied the code block.")

    def action_export(self: "ChatScreen") -> None:
        if self.conv_id is None:
            self.notify("No conversation to export.", severity="warning")
            return
        conv = self.store.conversation(self.conv_id)
        slug = re.sub(r"[^A-Za-z0-9]+", "-", conv.title).strip("-").lower()[:40] or "chat"
        folder = Path(self.app.export_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"pdchat-{slug}-{conv.id}.md"
        text = export_markdown(conv.title, self.settings_for(conv.id).system, self.store.messages(conv.id))
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as e:
            self.notify(f"Export failed: {e}", severity="error")
            return
        self.last_export = path
        self.notify(f"Exported to {path}")

    # ---- conversations --------------------------------------------------------------------------
    async def action_new_chat(self: "ChatScreen") -> None:
        await self.open_conversation(self.new_conversation())
        self.query_one("#input").focus()

    def action_follow(self: "ChatScreen") -> None:
        """Jump to the latest text and follow the stream again."""
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)

    def action_search(self: "ChatScreen") -> None:
        # A narrow terminal hides the list: show it over the chat until a conversation is chosen.
        self.add_class("-show-sidebar")
        self.query_one("#search").focus()

    def action_rename(self: "ChatScreen") -> None:
        if self.conv_id is None:
            return
        conv = self.store.conversation(self.conv_id)

        def done(title: str | None) -> None:
            if title:
                self.store.rename(conv.id, title)
                self.sub_title = title
                self.refresh_list()
        self.app.push_screen(TextPrompt("Rename conversation", conv.title), done)

    async def action_delete_chat(self: "ChatScreen") -> None:
        if self.conv_id is None:
            return
        live = self.live.pop(self.conv_id, None)
        if live is not None:
            live.generation.cancel()
            self.post_message(ReplyFinished(self.conv_id))
        conv = self.store.conversation(self.conv_id)
        self.store.delete_conversation(self.conv_id)
        self.notify(f"Deleted “{conv.title if conv else ''}”.")
        rest = self.store.conversations()
        if rest:
            await self.open_conversation(rest[0].id)
        else:
            self.conv_id = None
            box = self.query_one("#messages", VerticalScroll)
            await box.remove_children()
            await box.mount(Markdown(WELCOME, id="welcome"))
            self.refresh_list()

    def action_settings(self: "ChatScreen") -> None:
        if self.conv_id is None:
            self.conv_id = self.new_conversation()
            self.refresh_list()
        conv_id = self.conv_id

        def done(settings) -> None:
            if settings is not None:
                self.store.set_conversation_settings(conv_id, settings.to_dict())
                self.notify("Settings saved for this conversation.")
        self.app.push_screen(SettingsScreen(self.settings_for(conv_id)), done)

    def action_model(self: "ChatScreen") -> None:
        def done(model: str | None) -> None:
            if model:
                self.post_message(ModelRequested(model))
        self.app.push_screen(ModelPicker(self.backend.models(), self.backend.model), done)

    def action_help(self: "ChatScreen") -> None:
        self.app.push_screen(HelpScreen())

    def action_toggles(self: "ChatScreen") -> None:
        self.toggle_class("show-toggles")
