"""The chat screen's actions (bound to keys, and offered in the command palette)."""
from __future__ import annotations

import re
from pathlib import Path

from textual.containers import VerticalScroll

from .. import format as fmt
from ..widgets.chat_input import ChatInput
from ..widgets.messages import MessageView, code_blocks
from .modals import HelpScreen, ModelPicker, SettingsScreen, TextPrompt

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


class ChatActions:
    """Mixed into ChatScreen; relies on its store/backend/live/conv_id and helpers."""

    # ---- reply control --------------------------------------------------------------------------
    def action_cancel(self) -> None:
        live = self.live.get(self.conv_id)
        if live is not None:
            live.generation.cancel()
        elif self.editing is not None:
            self.editing = None
            self.query_one("#input", ChatInput).clear()
            self.notify("Edit cancelled.")

    async def action_regenerate(self) -> None:
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

    def action_edit(self) -> None:
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

    def _can_generate(self) -> bool:
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

    async def action_compare(self) -> None:
        """Re-run the last prompt with prefix caching flipped; both replies keep their summaries."""
        if not self._can_generate():
            return
        msgs = self.store.messages(self.conv_id)
        if not msgs or msgs[-1].role != "assistant":
            self.notify("Compare needs a finished reply to compare with.", severity="warning")
            return
        old = self.app.toggles.prefix_cache
        if not await self.app.apply_toggles({"prefix_cache": not old}, quiet=True):
            return
        self.compare_restore = {"conv": self.conv_id, "prefix_cache": old}
        label = f"compare: prefix cache {'off' if old else 'on'}"
        history_end = msgs[-1].id
        # the compared reply answers the same prompt: hide the previous reply from the history
        self._compare_skip = history_end
        if not await self.start_reply(self.conv_id, label=label):
            await self.app.apply_toggles({"prefix_cache": old}, quiet=True)
            self.compare_restore = None

    # ---- copy / export --------------------------------------------------------------------------
    def _target(self) -> MessageView | None:
        focused = self.app.focused
        if isinstance(focused, MessageView):
            return focused
        replies = [v for v in self.query(MessageView) if v.role == "assistant"]
        return replies[-1] if replies else None

    def action_copy(self) -> None:
        target = self._target()
        if target is None or not target.content:
            self.notify("Nothing to copy.", severity="warning")
            return
        self.app.copy_to_clipboard(target.content)
        self.notify(f"Copied the message ({len(target.content):,} characters).")

    def action_copy_code(self) -> None:
        target = self._target()
        blocks = code_blocks(target.content) if target else []
        if not blocks:
            self.notify("No code block in that message.", severity="warning")
            return
        self.app.copy_to_clipboard(blocks[-1])
        self.notify("Copied the code block.")

    def action_export(self) -> None:
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
    async def action_new_chat(self) -> None:
        await self.open_conversation(self.new_conversation())
        self.query_one("#input").focus()

    def action_search(self) -> None:
        self.query_one("#search").focus()

    def action_rename(self) -> None:
        if self.conv_id is None:
            return
        conv = self.store.conversation(self.conv_id)

        def done(title: str | None) -> None:
            if title:
                self.store.rename(conv.id, title)
                self.sub_title = title
                self.refresh_list()
        self.app.push_screen(TextPrompt("Rename conversation", conv.title), done)

    async def action_delete_chat(self) -> None:
        if self.conv_id is None:
            return
        live = self.live.pop(self.conv_id, None)
        if live is not None:
            live.generation.cancel()
            self.app.close_retired()
        conv = self.store.conversation(self.conv_id)
        self.store.delete_conversation(self.conv_id)
        self.notify(f"Deleted “{conv.title if conv else ''}”.")
        rest = self.store.conversations()
        if rest:
            await self.open_conversation(rest[0].id)
        else:
            self.conv_id = None
            await self.query_one("#messages", VerticalScroll).remove_children()
            self.refresh_list()

    def action_settings(self) -> None:
        if self.conv_id is None:
            self.conv_id = self.new_conversation()
            self.refresh_list()
        conv_id = self.conv_id

        def done(settings) -> None:
            if settings is not None:
                self.store.set_conversation_settings(conv_id, settings.to_dict())
                self.notify("Settings saved for this conversation.")
        self.app.push_screen(SettingsScreen(self.settings_for(conv_id)), done)

    def action_model(self) -> None:
        def done(model: str | None) -> None:
            if model:
                self.app.switch_model(model)
        self.app.push_screen(ModelPicker(self.backend.models(), self.backend.model), done)

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen())

    def action_toggles(self) -> None:
        self.toggle_class("show-toggles")
