"""The pdchat Textual app and run_app(), the entry point the CLI calls."""
from __future__ import annotations

import gc
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from pdchat.engine import settings as declared
from pdchat.themes.textual_themes import DEFAULT_THEME, THEMES, role_defaults

from pdchat.chatapp.backends.base import Backend, Settings, Toggles
from pdchat.chatapp.tui.heap import CHECK_S, HeapKeeper
from pdchat.chatapp.tui.palette import palette_commands
from pdchat.chatapp.tui.toggle_control import ToggleControl
from pdchat.chatapp.tui.loading import BackendLoaded, LoadProgress, start_load
from pdchat.chatapp.tui.screens.actions import ModelRequested, save_screenshot
from pdchat.chatapp.tui.screens.compare import CompareRequested
from pdchat.chatapp.tui.screens.chat import ChatScreen
from pdchat.chatapp.tui.screens.replies import ReplyFinished
from pdchat.chatapp.tui.screens.lab import LabScreen, lab_runner
from pdchat.chatapp.tui.store import Store
from pdchat.chatapp.tui.widgets.toggles import TogglesBox

if TYPE_CHECKING:
    from textual.driver import Driver

    from pdchat.chatapp.tui.hangup import HangUp

# The toggles that are engine settings (the rest, neighbours, belong to the app).
TOGGLE_KEYS = tuple(s.name for s in declared.TOGGLES if s.scope == declared.ENGINE)


class PdchatApp(App):
    """The app shell: the chat screen, loading and switching models, and the handlers of what the
    screens ask for. Each of those is a few lines handing over to its own module (loading.py,
    toggle_control.py, screens/lab.py, hangup.py, heap.py); together they are about 225 lines."""

    CSS_PATH = "app.tcss"
    TITLE = "pdchat"
    BINDINGS = [Binding("f9", "lab", "Lab", id="lab", show=False),
                # priority: also over modal screens (help, pickers), which hide the app's other keys
                Binding("f12", "screenshot", "Screenshot", id="screenshot", show=False, priority=True)]

    def __init__(self, backend: Backend, store: Store, *, toggles: Toggles | None = None,
                 settings: Settings | None = None, config: dict | None = None,
                 backend_factory: Callable[[str], Backend] | None = None,
                 export_dir: str | Path | None = None, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.thread_time, collector: Any = gc):
        super().__init__()
        self.backend = backend
        self.store = store
        self.toggles = toggles or Toggles.from_dict(store.get_setting("toggles"))
        self.default_settings = settings or Settings()
        self.config = config or {}
        self.backend_factory = backend_factory
        self.export_dir = Path(export_dir) if export_dir else Path.cwd()
        self.clock = clock
        self.cpu_clock = cpu_clock          # the UI thread's CPU time (draw_pace)
        # full garbage collections only while no reply streams (and not while the app shuts down)
        self.heap = HeapKeeper(lambda: self.closing or bool(self.chat.live), collector)
        self.ready = False
        self.load_error: str | None = None
        self.incoming: Backend | None = None       # the model being switched to, while it loads
        self.retired: list[Backend] = []           # replaced, closed once no reply streams from them
        self.toggle_control = ToggleControl(self)
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
        self.heap.start()
        self.set_interval(CHECK_S, self.heap.tidy)
        self.sub_title = self.backend.model
        if self.store.notice:
            self.notify(self.store.notice, severity="warning", timeout=15)
        self.load_backend()

    def _theme_changed(self, theme) -> None:
        self.store.set_setting("theme", theme.name)

    @property
    def chat(self) -> ChatScreen:
        return next(s for s in self.screen_stack if isinstance(s, ChatScreen))

    @property
    def closing(self) -> bool:
        """The chat screen is gone: the app is shutting down (a late message must not need it)."""
        return not any(isinstance(s, ChatScreen) for s in self.screen_stack)

    # ---- model loading --------------------------------------------------------------------------
    def load_backend(self) -> None:
        """Load the current backend; the chat waits for it (a switch loads on the side instead)."""
        self.ready = False
        start_load(self, self.backend)

    def on_load_progress(self, event: LoadProgress) -> None:
        if event.backend in (self.backend, self.incoming):
            self.chat.set_status(event.line)

    def on_backend_loaded(self, event: BackendLoaded) -> None:
        if event.backend is self.backend:
            self._loaded(event.backend, event.error)
        elif event.backend is self.incoming:
            self._switched(event.backend, event.error)
        else:                              # replaced while it was still loading
            self._close(event.backend)

    def _loaded(self, backend: Backend, error: str | None) -> None:
        self.load_error = error
        self.ready = error is None
        chat = self.chat
        chat.set_status(self._status_line())
        if error:
            self.notify(f"Could not load {backend.model}: {error}", severity="error", timeout=15)
        elif self.toggles.neighbours:
            self.toggles.neighbours = 0
        chat.query_one(TogglesBox).set_caps(backend.capabilities, self.toggles)
        chat.refresh_panel()
        self.heap.model_changed()

    def _status_line(self) -> str:
        if self.ready:
            return f"{self.backend.model} ready"
        if self.load_error:
            return f"[b]model not loaded[/b]: {self.load_error}"
        return f"loading {self.backend.model}…"

    def switch_model(self, model: str) -> None:
        """Load `model` beside the current one, which keeps serving; it is replaced only once the
        new one is ready, so a typo costs nothing."""
        if self.backend_factory is None:
            self.notify("Switching models is unavailable with this backend.", severity="warning")
            return
        if self.incoming is not None:
            self.notify(f"{self.incoming.model} is still loading.", severity="warning")
            return
        try:
            self.incoming = self.backend_factory(model)
        except Exception as e:
            self.notify(f"Could not load {model}: {e}", severity="error", timeout=15)
            return
        self.chat.set_status(f"loading {model}…")
        start_load(self, self.incoming)

    def _switched(self, backend: Backend, error: str | None) -> None:
        self.incoming = None
        if error:
            self._close(backend)          # whatever the failed load allocated
            self.chat.set_status(self._status_line())
            self.notify(f"Could not load {backend.model}: {error}. Still using {self.backend.model}.",
                        severity="error", timeout=15)
            return
        self.retired.append(self.backend)
        self.backend = backend
        self.sub_title = backend.model
        self.store.set_setting("model", backend.model)
        self._loaded(backend, None)
        self.close_retired()

    def close_retired(self) -> None:
        """Close replaced backends once no reply streams from them."""
        if self.closing or not self.chat.live:
            while self.retired:
                self._close(self.retired.pop())

    def _close(self, backend: Backend) -> None:
        try:
            backend.close()
        except Exception as e:
            self.notify(f"Closing {backend.model} failed: {e}", severity="warning")
        self.heap.model_changed()

    # ---- what the chat screen asks for ----------------------------------------------------------
    def on_model_requested(self, event: ModelRequested) -> None:
        self.switch_model(event.model)

    async def on_compare_requested(self, event: CompareRequested) -> None:
        await self.toggle_control.compare(event.conv_id, event.changes)

    async def on_reply_finished(self, event: ReplyFinished) -> None:
        # Also while the app shuts down: a reply that ended during the exit still posts this.
        self.close_retired()
        if not self.closing:
            await self.toggle_control.reply_finished(event.conv_id)

    # ---- terminal hang-up -----------------------------------------------------------------------
    def get_driver_class(self) -> type[Driver]:
        driver = super().get_driver_class()
        if sys.platform == "win32":
            return driver
        from textual.drivers.linux_driver import LinuxDriver

        from pdchat.chatapp.tui.hangup import HangupDriver
        return HangupDriver if driver is LinuxDriver else driver

    def on_hang_up(self, event: HangUp) -> None:
        """The terminal is gone (or SIGTERM came): exit the ordinary way (replies saved, backend closed)."""
        self.exit(return_code=event.exit_code)

    # ---- toggles --------------------------------------------------------------------------------
    async def apply_toggles(self, changes: dict[str, Any], quiet: bool = False) -> bool:
        return await self.toggle_control.apply(changes, quiet)

    async def on_toggles_box_changed(self, event: TogglesBox.Changed) -> None:
        await self.apply_toggles(event.changes)

    async def flip(self, name: str) -> None:
        await self.toggle_control.flip(name)

    # ---- the inference lab ----------------------------------------------------------------------
    def action_lab(self) -> None:
        if isinstance(self.screen, LabScreen):
            return
        runner, why = lab_runner(self.backend)
        self.push_screen(LabScreen(runner, why, load_last=self.backend.last_lab_run))

    # ---- screenshots and the command palette ----------------------------------------------------
    def action_screenshot(self) -> None:     # type: ignore[override]
        """An SVG of whatever screen is showing, into the export folder (Textual's own takes a
        file name and goes to ~/Downloads, which may not exist)."""
        try:
            saved = save_screenshot(self, Path(self.export_dir))
        except OSError as e:
            self.notify(f"Screenshot failed: {e}", severity="error", markup=False)
            return
        self.notify(f"Screenshot saved to {saved}", markup=False)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        # Textual's "Screenshot" writes to ~/Downloads: ours (in palette_commands) replaces it.
        yield from (c for c in super().get_system_commands(screen) if c.title != "Screenshot")
        yield from palette_commands(self)

    async def _on_exit_app(self) -> None:
        self.cancel_all()
        await super()._on_exit_app()

    def on_unmount(self) -> None:           # (the last event of a run, however it ended)
        self.heap.stop()

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


def make_backend(engine: dict[str, Any], backend: str | None = None) -> Backend:
    """A server's backend when `backend` (a URL) is set, else the local engine; `engine` holds
    EngineConfig fields (those left out keep EngineConfig's defaults)."""
    if backend:
        from pdchat.chatapp.backends.remote import RemoteBackend
        return RemoteBackend(backend, model=engine.get("model"))
    from pdchat.chatapp.backends.local import LocalBackend
    return LocalBackend(**engine)


def run_app(engine: dict[str, Any], settings: dict[str, Any], backend: str | None = None) -> int:
    """Open the chat app; returns an exit code. `engine` and `settings` are the EngineConfig and
    Settings fields the command line gave (cli.py); `backend` a server's URL, if any."""
    from pdchat.engine.paths import data_dir
    config = _read_config()
    store = Store(data_dir() / "pdchat.db")
    saved = store.get_setting("toggles") or {}
    # Saved toggles stand in for the engine's defaults; a flag given on the command line beats both.
    engine = {**{k: saved[k] for k in TOGGLE_KEYS if k in saved}, **engine}
    toggles = Toggles.from_dict({**saved, **{k: engine[k] for k in TOGGLE_KEYS if k in engine}})

    def switched_backend(model: str) -> Backend:
        # The toggles as they are now: the user may have changed them since the start.
        current = {k: getattr(app.toggles, k) for k in TOGGLE_KEYS}
        return make_backend({**engine, **current, "model": model}, backend)

    app = PdchatApp(make_backend(engine, backend), store, toggles=toggles, settings=Settings(**settings),
                    config=config, backend_factory=switched_backend, export_dir=os.getcwd())
    try:
        app.run()
    finally:
        try:
            app.backend.close()
        finally:
            store.close()
    return int(app.return_code or 0)
