"""One chat message: a header (role, status), Markdown body (streamed while growing), summary."""
from __future__ import annotations

import re
import threading

from markdown_it import MarkdownIt
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.visual import VisualType
from textual.widgets import Label, Markdown, Static

from pdchat.chatapp import format as fmt

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)```", re.S)

STATUS_LABEL = {"cancelled": "cancelled", "error": "error", "interrupted": "interrupted",
                "streaming": "…", "done": ""}


_parsers = threading.local()


def markdown_parser() -> MarkdownIt:
    """The message bodies' Markdown parser: one per thread, kept. Textual's Markdown builds a new
    one for every fragment a reply streams in (0.26 ms each on the 2-core AMD EPYC, more than
    parsing a 600-character paragraph takes); its update() parses in worker threads, hence one
    per thread rather than one for all."""
    parser = getattr(_parsers, "parser", None)
    if parser is None:
        parser = _parsers.parser = MarkdownIt("gfm-like")
    return parser


def clean(text: str) -> str:
    """What the terminal may show: control characters (random models emit them) become \ufffd."""
    return CONTROL.sub("\ufffd", text)


def code_blocks(text: str) -> list[str]:
    return [m.group(1).rstrip("\n") for m in CODE_BLOCK.finditer(text)]


class MessageParagraph(Markdown.BLOCKS["paragraph_open"]):
    """A paragraph of a message: new text that leaves it as many lines as it had repaints it
    alone. Static.update lays out the whole screen after every change, and while a reply streams
    that layout (and the second one it sets off, for the scrolled view's new size) was most of
    the UI's drawing: ~44 ms each, two a draw, with a chat's widgets on a 2-core AMD EPYC."""

    def update(self, content: VisualType = "", *, layout: bool = True) -> None:
        width, lines = self.content_size
        if layout and width and isinstance(content, Content) and content.get_height(self.styles, width) == lines:
            layout = False
        super().update(content, layout=layout)


class MessageBody(Markdown):
    """A message's Markdown: its paragraphs are MessageParagraphs."""
    BLOCKS = {**Markdown.BLOCKS, "paragraph_open": MessageParagraph}


class MessageView(Vertical, can_focus=True):
    """A message; assistant replies stream into the Markdown body and end with a summary line."""

    def __init__(self, role: str, content: str, *, message_id: int | None = None, status: str = "done",
                 metrics: dict | None = None):
        super().__init__(classes=f"message {role}")
        self.role = role
        self.content = content
        self.message_id = message_id
        self.status = status
        self.metrics = metrics
        self._stream = None

    def compose(self) -> ComposeResult:
        yield Label(self._header(), classes="message-header")
        yield MessageBody(clean(self.content), classes="message-body", parser_factory=markdown_parser)
        yield Static(fmt.summary(self.metrics), classes="message-summary")

    def on_mount(self) -> None:
        self._sync()

    def _header(self) -> str:
        who = {"user": "You", "assistant": "Assistant", "system": "System"}.get(self.role, self.role)
        label = STATUS_LABEL.get(self.status, self.status)
        return f"{who} · {label}" if label else who

    def _sync(self) -> None:
        self.query_one(".message-header", Label).update(self._header())
        summary = self.query_one(".message-summary", Static)
        summary.update(fmt.summary(self.metrics))
        summary.display = bool(self.metrics)
        self.set_class(self.status in ("cancelled", "error", "interrupted"), f"-{self.status}")

    # ---- streaming ----------------------------------------------------------------------------
    def start_stream(self) -> None:
        self.status = "streaming"
        self._sync()
        self._stream = Markdown.get_stream(self.query_one(".message-body", Markdown))

    async def append(self, fragment: str) -> None:
        if fragment:
            self.content += fragment
            if self._stream is not None:
                await self._stream.write(clean(fragment))

    async def finish(self, text: str, status: str, metrics: dict | None) -> None:
        """End the stream, then one final full render of the whole text."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.content, self.status, self.metrics = text, status, metrics
        await self.query_one(".message-body", Markdown).update(clean(text))
        self._sync()

    async def set_content(self, text: str) -> None:
        self.content = text
        await self.query_one(".message-body", Markdown).update(clean(text))
