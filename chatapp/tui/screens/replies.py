"""Replies in flight on the chat screen: starting one (a backend Generation drained by a worker
thread into a LiveReply), moving its text into the view on a timer, saving it as it grows, and
finishing it (database, view, a ReplyFinished message up to the app).

The stream itself (backend events into text and timings) is live.py, apart from any widget; this
module joins it to the screen's views and the store.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from textual.containers import VerticalScroll
from textual.message import Message
from textual.timer import Timer

from pdchat.chatapp.backends.base import TOGGLES, Done
from pdchat.chatapp.tui.draw_pace import DrawPace
from pdchat.chatapp.tui.live import LiveReply
from pdchat.chatapp.tui.widgets.messages import MessageView

if TYPE_CHECKING:
    from pdchat.chatapp.tui.screens.chat import ChatScreen

SAVE_S = 0.5           # a streaming reply is written to the database at least this often


class ReplyFinished(Message):
    """A reply ended (done, cancelled or failed) in conversation `conv_id`."""

    def __init__(self, conv_id: int):
        super().__init__()
        self.conv_id = conv_id


class Replies:
    def __init__(self, screen: "ChatScreen"):
        self.screen = screen
        self.live: dict[int, LiveReply] = {}      # by conversation: at most one reply each
        self.stream_view: MessageView | None = None
        self._last_save: dict[int, float] = {}
        self._live_timers: tuple[Timer, ...] = ()
        self._idle_timers: tuple[Timer, ...] = ()
        self.pace = DrawPace(lambda: screen.app.clock(), lambda: screen.app.cpu_clock())

    def while_live(self, *timers: Timer, idle: tuple[Timer, ...] = ()) -> None:
        """Timers that matter only while a reply streams (the text pump, the panel's fast refresh):
        start() resumes them and pump() pauses them once no reply is left, so an idle app does
        not wake up for them. The `idle` ones (the panel's slow refresh) run only when no reply
        streams: beside the fast one they would only draw the same panel again."""
        self._live_timers, self._idle_timers = timers, idle

    async def start(self, conv_id: int, history: list[dict[str, str]], label: str | None = None) -> bool:
        screen = self.screen
        try:
            gen = screen.backend.stream(history, screen.settings_for(conv_id))
        except Exception as e:                        # engine errors never kill the UI
            screen.notify(f"Could not start a reply: {e}", severity="error")
            return False
        msg = screen.store.add_message(conv_id, "assistant", "", status="streaming")
        live = LiveReply(conv_id, msg.id, screen.backend.now)
        live.generation = gen
        live.label = label
        live.made_with = self._made_with()
        self.live[conv_id] = live
        for timer in self._live_timers:
            timer.resume()
        for timer in self._idle_timers:
            timer.pause()
        if conv_id == screen.conv_id:
            await self.show(live)
            screen.query_one("#messages", VerticalScroll).scroll_end(animate=False)
        screen.run_worker(lambda: self._consume(live), thread=True, group="gen", exit_on_error=False)
        return True

    async def show(self, live: LiveReply) -> None:
        """Mount a streaming view of `live` (its conversation was just opened, or it just began)."""
        view = MessageView("assistant", live.taken_text(), message_id=live.message_id)
        await self.screen.query_one("#messages").mount(view)
        view.start_stream()
        self.stream_view = view

    def _made_with(self) -> dict:
        """What produces the reply, kept with it (summary, database, export): the model, the
        device, and every toggle that differs from its declared default."""
        app = self.screen.app
        try:
            device = app.backend.stats().get("device") if app.ready else None
        except Exception:                             # telemetry never stops a reply
            device = None
        changed = {s.name: getattr(app.toggles, s.name) for s in TOGGLES
                   if getattr(app.toggles, s.name) != s.default}
        return {"model": app.backend.model, "device": device, "changed": changed}

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
        """Timer: move new text into the view, save growing replies, finish completed ones. The
        message list is anchored (ChatScreen): it follows the text while the user is at the
        bottom, and stays put once they scroll up."""
        screen = self.screen
        draw, drew = self.pace.due(), False
        for conv_id, live in list(self.live.items()):
            view = self.stream_view if conv_id == screen.conv_id else None
            # Held while the UI is over its share of a core (draw_pace); _finish draws the whole text.
            fragment = "" if view is not None and not draw else live.take_text()
            if view is not None and fragment:
                if not drew:
                    self.pace.drawing()
                    drew = True
                await view.append(fragment)
            now = screen.app.clock()
            if live.done is not None:
                await self._finish(live, view)
            elif fragment and now - self._last_save.get(conv_id, 0) >= SAVE_S:
                screen.store.update_message(live.message_id, content=live.full_text())
                self._last_save[conv_id] = now
        if not self.live:              # the last one finished (or its chat was deleted)
            for timer in self._live_timers:
                timer.pause()
            for timer in self._idle_timers:
                timer.resume()
            self.pace.reset()

    async def _finish(self, live: LiveReply, view: MessageView | None) -> None:
        screen = self.screen
        done = live.done
        status = {"cancelled": "cancelled", "error": "error"}.get(done.finish_reason, "done")
        text = live.full_text()
        metrics = dict(done.metrics or {})
        if getattr(live, "label", None):
            metrics["label"] = live.label
        metrics["made_with"] = live.made_with
        screen.store.update_message(live.message_id, content=text, status=status, metrics=metrics)
        self.live.pop(live.conversation_id, None)
        if view is not None:
            await view.finish(text, status, metrics)
            if view is self.stream_view:
                self.stream_view = None
        if done.error:
            screen.notify(f"Generation failed: {done.error}", severity="error")
        screen.post_message(ReplyFinished(live.conversation_id))
        screen.refresh_list()
        screen.refresh_panel()

    def cancel(self, conv_id: int | None) -> bool:
        """Cancel the reply of `conv_id`, if one streams; its partial text is kept."""
        live = self.live.get(conv_id)
        if live is not None:
            live.generation.cancel()
        return live is not None

    def interrupt_all(self) -> None:
        """The app is ending (quit, hang-up): stop every reply and keep what it streamed."""
        for live in list(self.live.values()):
            live.generation.cancel()
            self.screen.store.update_message(live.message_id, content=live.full_text(), status="interrupted")
