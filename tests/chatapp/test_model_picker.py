"""The model picker shows each model's size (from local files alone, never the network), and a
load says what it is doing: its phase lines, then the time the phase has taken."""
from __future__ import annotations

import json
import socket

import pytest
from textual.widgets import OptionList

from pdchat.chatapp.backends.local import LocalBackend
from pdchat.chatapp.tui.loading import BackendLoaded, LoadProgress, PhaseLines, _load
from pdchat.chatapp.tui.screens.modals import ModelPicker
from pdchat.engine.random_models import PRESETS
from tests.doubles.fake_backend import FakeBackend

from .helpers import ready, wait_for

pytestmark = pytest.mark.anyio


class SizedBackend(FakeBackend):
    SIZES = {"fake-model": "135M params · 739.4 MB", "other-model": None}

    def models(self) -> list[str]:
        return list(self.SIZES)

    def model_size(self, model: str) -> str | None:
        return self.SIZES[model]


def prompts(app) -> list[str]:
    options = app.screen.query_one(OptionList)
    return [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_the_picker_shows_the_sizes_it_knows(make_app, size):
    app = make_app(SizedBackend())
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker) and "params" in prompts(app)[0])
        assert prompts(app) == ["fake-model  135M params · 739.4 MB", "other-model"]
        options = app.screen.query_one(OptionList)
        assert options.region.width > len(prompts(app)[0])       # the size is in view
        await pilot.press("escape")


# ---- the sizes the local backend finds ----------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a size lookup must not touch the network")
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_sizes_of_random_presets_come_from_their_shapes(cache, no_network):
    b = LocalBackend()
    assert b.model_size("random:smollm2-135m") == "135M params"
    assert b.model_size("random:llama-8b") == "8.0B params"
    assert b.model_size("random:no-such-preset") is None


def test_a_cached_model_shows_parameters_and_bytes_on_disk(cache, no_network):
    folder = cache / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(PRESETS["smollm2-135m"]))
    (folder / "model.safetensors").write_bytes(b"\0" * (3 * 2**20))
    b = LocalBackend()
    assert b.models() == ["smollm2-135m"]
    assert b.model_size("smollm2-135m").startswith("135M params · 3.0 MB")


def test_a_model_not_here_shows_what_is_known_and_never_asks_the_hub(cache, no_network):
    b = LocalBackend()
    assert b.model_size("smollm2-135m") == "93.0 MB download"          # the PyPI package's size
    assert b.model_size("Qwen/Qwen2.5-0.5B-Instruct") is None
    assert b.model_size("./no/such/folder") is None


def test_a_damaged_config_costs_only_the_parameter_count(cache, no_network):
    folder = cache / "broken"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{ not json")
    (folder / "model.safetensors").write_bytes(b"\0" * 2048)
    assert LocalBackend().model_size("broken") == "2.0 KB"


# ---- the status line while a model loads --------------------------------------------------------
class Posts:
    """Stands in for the app: keeps what the loader posts."""

    def __init__(self):
        self.messages = []

    def post_message(self, message) -> bool:
        self.messages.append(message)
        return True

    def lines(self) -> list[str]:
        return [m.line for m in self.messages if isinstance(m, LoadProgress)]


def test_a_long_phase_shows_the_time_it_has_taken():
    app, t = Posts(), [100.0]
    lines = PhaseLines(app, FakeBackend(), clock=lambda: t[0])
    assert lines.tick()                          # nothing said yet: nothing to repeat
    lines("fetching the default model (93 MB) from PyPI…")
    t[0] = 112.4
    assert lines.tick()
    assert app.lines() == ["fetching the default model (93 MB) from PyPI…",
                           "fetching the default model (93 MB) from PyPI… 12 s"]
    lines.done.set()
    assert not lines.tick() and len(app.lines()) == 2      # finished: no stale line after "ready"


def test_a_load_ends_with_its_result_after_its_phase_lines():
    app, backend = Posts(), FakeBackend(model="m")
    _load(app, backend)
    assert app.lines()[:2] == ["loading m…", "m ready"]
    assert isinstance(app.messages[-1], BackendLoaded) and app.messages[-1].error is None
