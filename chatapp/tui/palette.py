"""The command palette's entries (Ctrl+P): the chat screen's actions, the lab, and one entry per
toggle of the settings declaration, with its explanation."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from textual.app import SystemCommand

from pdchat.engine.settings import TOGGLES

if TYPE_CHECKING:
    from pdchat.chatapp.tui.app import PdchatApp

ACTIONS = [  # (title, help, action on the chat screen)
    ("New conversation", "Start a new chat (Ctrl+N)", "new_chat"),
    ("Cancel reply", "Stop the reply being generated, keep the partial text (Esc)", "cancel"),
    ("Regenerate", "Regenerate the last reply (Ctrl+R)", "regenerate"),
    ("Edit last message", "Edit and resend your last message (Ctrl+E)", "edit"),
    ("Copy message", "Copy the focused message or the last reply (Ctrl+Y)", "copy"),
    ("Copy code block", "Copy the last code block of the message (Ctrl+O)", "copy_code"),
    ("Export to Markdown", "Write the conversation to a .md file (Ctrl+S)", "export"),
    ("Show/hide toggles", "Optimization toggles panel (Ctrl+T)", "toggles"),
    ("Compare a toggle", "Re-run the last prompt with one toggle changed (Ctrl+G)", "compare"),
    ("A/B table", "The last two replies side by side: TTFT, prefill, decode, TPOT, cache, acceptance (F6)",
     "ab_table"),
    ("Search conversations", "Filter the conversation list (Ctrl+F)", "search"),
    ("Follow the reply", "Jump to the latest text and keep following it (Ctrl+End)", "follow"),
    ("Rename conversation", "F2", "rename"),
    ("Delete conversation", "F8", "delete_chat"),
    ("Conversation settings", "System prompt and sampling (F3)", "settings"),
    ("Switch model", "Load another model (F4)", "model"),
    ("Help", "Keys and colours (F1)", "help"),
]


def palette_commands(app: "PdchatApp") -> Iterable[SystemCommand]:
    chat = app.chat
    for title, help_text, action in ACTIONS:
        yield SystemCommand(title, help_text, lambda a=action: chat.run_action(a))
    yield SystemCommand("Save screenshot", "An SVG of the app, into the folder Ctrl+S exports to (F12)",
                        app.action_screenshot)
    yield SystemCommand("Inference lab", "Measure the explainers' claims on this machine: curves and "
                        "verdicts (F9)", app.action_lab)
    for conv in app.store.conversations():           # reachable even when the list is hidden
        yield SystemCommand(f"Open conversation: {conv.title}", "Switch to this conversation",
                            lambda c=conv.id: app.call_later(chat.open_conversation, c))
    caps = app.backend.capabilities
    for s in TOGGLES:
        if s.gpu_only and not caps.get(s.name):          # a GPU's own, and this backend has none
            continue
        available = "" if caps.get(s.name) else " (unavailable in this engine)"
        if s.kind is bool or any(v is None for _, v in s.words):      # on/off
            yield SystemCommand(f"Toggle {s.title}", s.help + available, lambda n=s.name: app.flip(n))
        for choice in s.choices:
            yield SystemCommand(f"{s.title.capitalize()}: {choice}", s.help + available,
                                lambda n=s.name, c=choice: app.apply_toggles({n: c}))
