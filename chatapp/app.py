"""The pdchat Textual app and run_app(), the entry point the CLI calls."""
from __future__ import annotations

import os
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from pdchat.themes import DEFAULT_THEME, THEMES, role_defaults

from .backend import DEFAULT_CHUNK, Backend, Settings, Toggles
from .screens.chat import ChatScreen
from .screens.lab import LabScreen, lab_runner
from .store import Store
from .widgets.toggles import TogglesBox

TOGGLE_KEYS = ("kv_cache", "prefix_cache", "chunk_size", "spec", "quant")
PALETTE = [  # (title, help, action on the chat screen)
    ("New conversation", "Start a new chat (Ctrl+N)", "new_chat"),
    ("Cancel reply", "Stop the reply being generated, keep the partial text (Esc)", "cancel"),
    ("Regenerate", "Regenerate the last reply (Ctrl+R)", "regenerate"),
    ("Edit last message", "Edit and resend your last message (Ctrl+E)", "edit"),
    ("Copy message", "Copy the focused message or the last reply (Ctrl+Y)", "copy"),
    ("Copy code block", "Copy the last code block of the message (Ctrl+O)", "copy_code"),
    ("Export to Markdown", "Write the conversation to a .md file (Ctrl+S)", "export"),
    ("Show/hide toggles", "Optimization toggles panel (Ctrl+T)", "toggles"),
    ("Compare prefix cache", "Re-run the last prompt with prefix caching flipped (Ctrl+G)", "compare"),
    ("Search conversations", "Filter the conversation list (Ctrl+F)", "search"),
    ("Rename conversation", "F2", "rename"),
    ("Delete conversation", "F8", "delete_chat"),
    ("Conversation settings", "System prompt and sampling (F3)", "settings"),
    ("Switch model", "Load another model (F4)", "model"),
    ("Help", "Keys and colours (F1)", "help"),
]


class PdchatApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "pdchat"
    BINDINGS = [Binding("f9", "lab", "Lab", id="lab", show=False)]

    def __init__(self, backend: Backend, store: Store, *, toggles: Toggles | None = None,
                 settings: Settings | None = None, config: dict | None = None,
                 backend_factory: Callable[[str], Backend] | None = None,
                 export_dir: str | Path | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.backend = backend
        self.store = store
        self.toggles = toggles or Toggles.from_dict(store.get_setting("toggles"))
        self.default_settings = settings or Settings()
        self.config = config or {}
        self.backend_factory = backend_factory
        self.export_dir = Path(export_dir) if export_dir else Path.cwd()
        self.clock = clock
        self.ready = False
        self.load_error: str | None = None
        for theme in THEMES:
            self.register_theme(theme)
        theme = store.get_setting("theme") or self.config.get("theme") or DEFAULT_THEME
        self.theme = theme if theme in self.available_themes else DEFAULT_THEME
        keys = self.config.get("keys")
        if isinstance(keys, dict):
            self.set_keymap({str(k): str(v) for k, v in keys.items()})

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return role_defaults()

    def on_mount(self) -> None:
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        self.push_screen(ChatScreen())
        self.sub_title = self.backend.model
        if self.store.notice:
            self.notify(self.store.notice, severity="warning", timeout=15)
        self.load_backend()

    def _theme_changed(self, theme) -> None:
        self.store.set_setting("theme", theme.name)

    @property
    def chat(self) -> ChatScreen:
        return next(s for s in self.screen_stack if isinstance(s, ChatScreen))

    # ---- model loading --------------------------------------------------------------------------
    def load_backend(self) -> None:
        self.ready = False
        self.run_worker(self._load, thread=True, group="load", exit_on_error=False)

    def _status(self, line: str) -> None:
        self.call_from_thread(lambda: self.chat.set_status(line))

    def _load(self) -> None:
        backend = self.backend
        try:
            backend.load(self._status)
        except Exception as e:                      # shown, never fatal
            msg = f"{type(e).__name__}: {e}" if not str(e) else str(e)
            self.call_from_thread(self._loaded, backend, msg)
            return
        self.call_from_thread(self._loaded, backend, None)

    def _loaded(self, backend: Backend, error: str | None) -> None:
        if backend is not self.backend:
            return
        self.load_error = error
        self.ready = error is None
        chat = self.chat
        if error:
            chat.set_status(f"[b]model not loaded[/b]: {error}")
            self.notify(f"Could not load {backend.model}: {error}", severity="error", timeout=15)
        else:
            chat.set_status(f"{backend.model} ready")
            if self.toggles.neighbours:
                self.toggles.neighbours = 0
        chat.query_one(TogglesBox).set_caps(backend.capabilities, self.toggles)
        chat.refresh_panel()

    def switch_model(self, model: str) -> None:
        if self.chat.live:
            self.notify("Wait for the running replies to finish (or cancel them) first.", severity="warning")
            return
        if self.backend_factory is None:
            self.notify("Switching models is unavailable with this backend.", severity="warning")
            return
        old = self.backend
        self.backend = self.backend_factory(model)
        self.sub_title = model
        self.store.set_setting("model", model)
        try:
            old.close()
        except Exception as e:
            self.notify(f"Closing the old model failed: {e}", severity="warning")
        self.chat.set_status(f"loading {model}…")
        self.load_backend()

    # ---- toggles --------------------------------------------------------------------------------
    async def apply_toggles(self, changes: dict[str, Any], quiet: bool = False) -> bool:
        caps = self.backend.capabilities
        for key, cap in (("spec", "spec"), ("quant", "quant")):
            if key in changes and changes[key] not in ("off", "none") and not caps.get(cap):
                self.notify(f"{key} is unavailable in this engine.", severity="warning")
                self.chat.query_one(TogglesBox).set_values(self.toggles)
                return False
        try:
            if self.ready:
                self.backend.update(**changes)
        except Exception as e:
            self.notify(f"Could not apply {', '.join(changes)}: {e}", severity="error")
            self.chat.query_one(TogglesBox).set_values(self.toggles)
            return False
        self.toggles = Toggles.from_dict({**self.toggles.to_dict(), **changes})
        self.store.set_setting("toggles", {k: v for k, v in self.toggles.to_dict().items() if k != "neighbours"})
        self.chat.query_one(TogglesBox).set_values(self.toggles)
        if not quiet:
            desc = ", ".join(f"{k}={'off' if v is None or v is False else 'on' if v is True else v}"
                             for k, v in changes.items())
            self.notify(f"{desc}: applies to the next reply.")
        self.chat.refresh_panel()
        return True

    async def on_toggles_box_changed(self, event: TogglesBox.Changed) -> None:
        await self.apply_toggles(event.changes)

    async def flip(self, name: str) -> None:
        if name == "chunked":
            await self.apply_toggles({"chunk_size": None if self.toggles.chunk_size else DEFAULT_CHUNK})
        else:
            await self.apply_toggles({name: not getattr(self.toggles, name)})

    # ---- the inference lab ----------------------------------------------------------------------
    def action_lab(self) -> None:
        if isinstance(self.screen, LabScreen):
            return
        runner, why = lab_runner(self.backend)
        self.push_screen(LabScreen(runner, why))

    # ---- command palette ------------------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self.chat
        for title, help_text, action in PALETTE:
            yield SystemCommand(title, help_text, lambda a=action: chat.run_action(a))
        yield SystemCommand("Inference lab", "Measure the explainers' claims on this machine: curves and "
                            "verdicts (F9)", self.action_lab)
        for name, title in (("kv_cache", "KV cache"), ("prefix_cache", "Prefix cache"),
                            ("chunked", "Chunked prefill")):
            yield SystemCommand(f"Toggle {title}", f"Flip {title.lower()} for the next reply",
                                lambda n=name: self.flip(n))
        for method in ("off", "ngram", "draft"):
            yield SystemCommand(f"Speculative decoding: {method}", "unavailable in this engine"
                                if not self.backend.capabilities.get("spec") else "for the next reply",
                                lambda m=method: self.apply_toggles({"spec": m}))

    async def _on_exit_app(self) -> None:
        self.cancel_all()
        await super()._on_exit_app()

    def cancel_all(self) -> None:
        """Stop every reply in flight (on exit), so no worker thread is left waiting."""
        for screen in self.screen_stack:
            if isinstance(screen, ChatScreen):
                for live in list(screen.live.values()):
                    live.generation.cancel()


def _read_config() -> dict:
    from pdchat.engine.paths import config_dir
    path = config_dir() / "config.toml"
    try:
        return tomllib.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        print(f"pdchat: ignoring {path}: {e}")
        return {}


def make_backend(options: dict, model: str | None = None) -> Backend:
    if options.get("backend"):
        from .remote_backend import RemoteBackend
        return RemoteBackend(options["backend"], model=model or options.get("model"))
    from .local_backend import LocalBackend
    engine_options = {k: options[k] for k in TOGGLE_KEYS + ("spec_tokens", "draft_model") if options.get(k) is not None}
    return LocalBackend(model=model or options.get("model") or "smollm2-135m",
                        device=options.get("device") or "auto", dtype=options.get("dtype") or "auto",
                        **engine_options)


def run_app(options: dict) -> int:
    """Open the chat app; returns an exit code. Keys of `options` are the CLI flags (see cli.py)."""
    from pdchat.engine.paths import data_dir
    options = dict(options or {})
    config = _read_config()
    store = Store(data_dir() / "pdchat.db")
    toggles = Toggles.from_dict(store.get_setting("toggles"))
    for key in TOGGLE_KEYS:
        if options.get(key) is not None:
            setattr(toggles, key, options[key])
    settings = Settings(**{k: options[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "system")
                           if options.get(k) is not None})
    opts = {**options, **{k: getattr(toggles, k) for k in TOGGLE_KEYS}}
    backend = make_backend(opts)
    app = PdchatApp(backend, store, toggles=toggles, settings=settings, config=config,
                    backend_factory=lambda m: make_backend(opts, m), export_dir=os.getcwd())
    try:
        app.run()
    finally:
        try:
            app.backend.close()
        finally:
            store.close()
    return int(app.return_code or 0)
