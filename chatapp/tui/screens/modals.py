"""Small modal screens: help, a one-line prompt (rename, model), conversation settings."""
from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.content import Content
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Markdown, OptionList, TextArea
from textual.worker import get_current_worker

from pdchat.chatapp.backends.base import Settings

HELP = """\
# pdchat keys

| Key | Action |
|---|---|
| Enter | send the message |
| Ctrl+J (Shift+Enter where supported) | new line in the message |
| Esc | cancel the reply being generated (the partial text is kept, marked *cancelled*) |
| Ctrl+N | new conversation |
| Ctrl+R | regenerate the last reply |
| Ctrl+E | edit the last message and resend |
| Ctrl+Y | copy the focused message (or the last reply) |
| Ctrl+O | copy the last code block of the focused message (or the last reply) |
| Ctrl+S | export the conversation to Markdown |
| F12 | save a screenshot (SVG) into the same folder as the exports |
| Ctrl+T | show / hide the optimization toggles |
| Ctrl+G | compare: re-run the last prompt with one toggle changed (KV cache, prefix cache, chunk, int8, speculation) |
| F6 | A/B table: the last two replies side by side (TTFT, prefill, decode, TPOT, cached tokens, acceptance) |
| Ctrl+F | search conversations |
| Ctrl+End | jump to the latest text and follow the reply again (scrolling up stops following) |
| F2 / F8 | rename / delete the conversation |
| F3 | conversation settings (system prompt, sampling) |
| F4 | switch model |
| F9 | the inference lab: measure the explainers' claims on this machine |
| Ctrl+P | command palette (every action, themes) |
| F1 | this help |
| Ctrl+Q | quit |

Key bindings can be remapped in `config.toml` in the config directory, e.g.

```toml
theme = "pdchat-dark"
[keys]
regenerate = "ctrl+r,f5"
```

Telemetry colours: **prefill** (the pause before the first token), **decode** (the stream),
**cached** (prefix-cache hits), **kv** (KV cache pool, and K/V crossing from the prefill worker),
**gpu** (the device). Values that cannot be measured show *n/a*.

# What the numbers mean

| Term | Meaning |
|---|---|
| Prefill | the model reads the whole prompt in one pass (many tokens at once: compute-bound) |
| TTFT | time to first token: queueing plus the prefill pause, what you wait before text appears |
| Decode | the model writes one token per step, reading all its weights each time (memory-bound) |
| TPOT | time per output token after the first; tok/s is its inverse |
| ITL | inter-token latency: the gap between two tokens as they arrive (its spikes are stalls) |
| KV cache | the keys and values of every token so far, kept so each step computes only the new token |
| Prefix cache | KV blocks of a prompt start seen before, reused: a repeated question skips most of its prefill |
| Chunked prefill | a long prompt enters in slices while others stream; auto sizes each slice so a step takes about `step budget` decode steps (the panel's sliced step: planned vs took) |
| Speculative decoding | cheap guesses of the next tokens, all checked in one forward; same output, fewer steps |
| Neighbours | synthetic users chatting beside you: batching shares each step among them |
| Disaggregate | a second process prefills prompts on cores of its own and hands their KV over: streams never wait for a prefill, TTFT pays the transfer (the panel's Workers, the timeline's transfer) |
"""

WELCOME = """\
**Welcome to pdchat.** Watch the panel: the **prefill** pause (TTFT), then the **decode** stream.

Try:
- paste a long text, ask for a summary: the prefill pause
- **Ctrl+T**, KV cache off, ask again: naive decoding
- ask about the same long text twice: the prefix cache
- **Ctrl+G** after a reply: again with one toggle changed, **F6** side by side

**F1**: keys, and what TTFT, TPOT, ITL and KV mean.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box", classes="modal-box"):
            yield Markdown(HELP)

    def action_dismiss(self) -> None:
        self.dismiss(None)


class TextPrompt(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, value: str = "", placeholder: str = ""):
        super().__init__()
        self.title_text, self.value, self.placeholder = title, value, placeholder

    def compose(self) -> ComposeResult:
        with Vertical(classes="modal-box prompt-box"):
            yield Label(self.title_text, classes="modal-title")
            yield Input(self.value, placeholder=self.placeholder, id="prompt-input")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ModelPicker(ModalScreen[str | None]):
    """Pick a model the backend already has, or type any name, hub id, folder or .gguf path. Each
    listed model shows its size where the backend can tell without loading it."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, models: list[str], current: str):
        super().__init__()
        self.models, self.current = models, current

    def compose(self) -> ComposeResult:
        with Vertical(classes="modal-box prompt-box"):
            yield Label("Model", classes="modal-title")
            yield OptionList(*self.models, id="model-list")
            yield Input(placeholder="or a hub id (org/name), a folder, a .gguf file, random:<preset>",
                        id="model-input")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        if self.current in self.models:
            options.highlighted = self.models.index(self.current)
        options.focus()
        self._look_up_sizes()

    @work(thread=True, exit_on_error=False)
    def _look_up_sizes(self) -> None:
        # Off the UI thread: reading model folders (or the engine's first import) must not freeze it.
        backend = self.app.backend
        sizes = [backend.model_size(name) for name in self.models]
        if not get_current_worker().is_cancelled:
            self.app.call_from_thread(self._show_sizes, sizes)

    def _show_sizes(self, sizes: list[str | None]) -> None:
        if not self.is_attached:               # closed while the sizes were looked up
            return
        options = self.query_one(OptionList)
        for i, (name, size) in enumerate(zip(self.models, sizes)):
            if size:
                options.replace_option_prompt_at_index(i, Content.assemble(name, (f"  {size}", "$text-muted")))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.models[event.option_index])

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class SettingsScreen(ModalScreen[Settings | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    NUMBERS = (("max_tokens", "max tokens", "integer"), ("temperature", "temperature", "number"),
               ("top_p", "top-p", "number"), ("top_k", "top-k (0 off)", "integer"),
               ("seed", "seed (blank: random)", "integer"))

    def __init__(self, settings: Settings):
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(classes="modal-box settings-box"):
            yield Label("Conversation settings", classes="modal-title")
            yield Label("System prompt")
            yield TextArea(s.system or "", id="set-system")
            with Grid(id="set-grid"):
                for name, label, kind in self.NUMBERS:
                    value = getattr(s, name)
                    yield Label(label)
                    yield Input("" if value is None else str(value), type=kind, id=f"set-{name}")
            with Horizontal(classes="modal-buttons"):
                yield Button("Save", variant="primary", id="set-save")
                yield Button("Cancel", id="set-cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "set-cancel":
            self.dismiss(None)
            return
        values = {"system": self.query_one("#set-system", TextArea).text.strip() or None}
        try:
            for name, _, kind in self.NUMBERS:
                raw = self.query_one(f"#set-{name}", Input).value.strip()
                if name == "seed" and not raw:
                    values[name] = None
                    continue
                values[name] = int(raw) if kind == "integer" else float(raw)
            if values["max_tokens"] <= 0 or values["temperature"] < 0 or not 0 < values["top_p"] <= 1:
                raise ValueError("max tokens > 0, temperature >= 0, 0 < top-p <= 1")
        except ValueError as e:
            self.notify(f"Invalid setting: {e}", severity="error")
            return
        self.dismiss(Settings(**values))

    def action_cancel(self) -> None:
        self.dismiss(None)
