"""Applying toggles for the app: checked against the backend's capabilities, sent to the
backend, saved, reflected in the panel and told to the user; plus Compare, which changes one
toggle for one reply and puts it back when that reply ends."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdchat.chatapp import format as fmt
from pdchat.chatapp.backends.base import Toggles
from pdchat.chatapp.tui.widgets.toggles import TogglesBox
from pdchat.engine import settings as declared

if TYPE_CHECKING:
    from pdchat.chatapp.tui.app import PdchatApp

ENGINE_DECIDES = ("spec", "quant")      # toggles the engine may change itself, with a notice


class ToggleControl:
    def __init__(self, app: "PdchatApp"):
        self.app = app
        self.compare_restore: tuple[int, dict[str, Any]] | None = None   # (conversation, toggles)

    async def apply(self, changes: dict[str, Any], quiet: bool = False) -> bool:
        """Apply `changes` to the next reply; False (and the panel put back) when they cannot be."""
        app = self.app
        caps = app.backend.capabilities
        for name, value in changes.items():
            if not caps.get(name) and value != declared.get(name).default:
                app.notify(f"{declared.get(name).title} is unavailable in this engine.", severity="warning")
                app.chat.query_one(TogglesBox).set_values(app.toggles)
                return False
        try:
            if app.ready:
                app.backend.update(**changes)
        except Exception as e:
            app.notify(f"Could not apply {', '.join(changes)}: {e}", severity="error")
            app.chat.query_one(TogglesBox).set_values(app.toggles)
            return False
        app.toggles = Toggles.from_dict({**app.toggles.to_dict(), **changes})
        # Neighbours are a live demo, not a preference: they start at 0 every time.
        app.store.set_setting("toggles", {k: v for k, v in app.toggles.to_dict().items() if k != "neighbours"})
        app.chat.query_one(TogglesBox).set_values(app.toggles)
        if not quiet:
            said = ", ".join(f"{declared.get(k).title} {fmt.setting_value(v)}" for k, v in changes.items())
            app.notify(f"{said}: applies to the next reply.")
        app.chat.refresh_panel()
        return True

    def follow_engine(self, stats: dict[str, Any], notices: list[str]) -> None:
        """What the engine decided itself: its notices become toasts, and a toggle it changed
        (speculation that did not pay here, a self-draft refused beside quantized weights) is
        followed by the toggles and the panel. Not saved: the saved toggles stay the user's
        choice, and the engine decides again."""
        app = self.app
        for notice in notices:
            app.notify(notice, severity="warning", timeout=15)
        changed = {k: stats[k] for k in ENGINE_DECIDES if k in stats and stats[k] != getattr(app.toggles, k)}
        if changed and self.compare_restore is None:
            app.toggles = Toggles.from_dict({**app.toggles.to_dict(), **changed})
            app.chat.query_one(TogglesBox).set_values(app.toggles)

    async def flip(self, name: str) -> None:
        """Turn a toggle on or off (a number that can be off goes back to its default when on)."""
        value = getattr(self.app.toggles, name)
        if isinstance(value, bool):
            await self.apply({name: not value})
        else:
            await self.apply({name: None if value is not None else declared.get(name).default})

    async def compare(self, conv_id: int, changes: dict[str, Any]) -> None:
        old = {name: getattr(self.app.toggles, name) for name in changes}
        if not await self.apply(changes, quiet=True):
            return
        said = ", ".join(f"{declared.get(k).title} {fmt.setting_value(v)}" for k, v in changes.items())
        if await self.app.chat.start_compare(conv_id, f"compare: {said}"):
            self.compare_restore = (conv_id, old)
        else:
            await self.apply(old, quiet=True)

    async def reply_finished(self, conv_id: int) -> None:
        if self.compare_restore is not None and self.compare_restore[0] == conv_id:
            changes, self.compare_restore = self.compare_restore[1], None
            await self.apply(changes, quiet=True)
            self.app.notify("Compare done: F6 shows the two replies side by side (A/B table).")
