"""Every declared setting on the app's surfaces (the engine's are in tests/test_settings.py; the
flags' path to the engine in test_cli_flags.py): `pdchat --help`, usage errors, the chat app's
conversation settings and toggles panel, and the HTTP server's validation. Cases come from the
declaration, so a setting added there is checked here, and a surface that misses it fails."""
from __future__ import annotations

import dataclasses
import json

import pytest
from textual.widgets import Input, Select, Static, Switch

from pdchat.chatapp.backends.base import CAPABILITIES, Settings, Toggles
from pdchat.chatapp.cli.main import main
from pdchat.chatapp.cli.parser import build_parser
from pdchat.chatapp.tui.widgets.toggles import TogglesBox
from pdchat.engine import settings
from pdchat.engine.settings import SAMPLING, SETTINGS, TOGGLES, Setting
from tests.doubles.fake_backend import FakeBackend

from ..setting_values import bad_values, other_value
from .conftest import MODEL
from .helpers import ready

FLAGGED = [s for s in SETTINGS if s.cli_flag]


def ident(s: Setting) -> str:
    return f"{s.scope}.{s.name}"


# ---- the command line --------------------------------------------------------------------------
def test_help_shows_every_flag_with_its_explanation():
    text = " ".join(build_parser().format_help().split())      # argparse wraps lines
    for s in FLAGGED:
        assert s.cli_flag in text, s.name
        assert " ".join(s.help.split()[:6]) in text, f"{s.cli_flag}'s explanation is missing from --help"


@pytest.mark.parametrize("s", [s for s in FLAGGED if bad_values(s)], ids=ident)
def test_a_refused_value_is_a_usage_error_naming_the_flag(s, capsys):
    for bad in bad_values(s):
        if str(bad) in dict(s.words):                     # "0" is a word: chunking off
            continue
        assert main(["run", "hi", "--model", "random:nope", s.cli_flag, str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and s.cli_flag in err and "Traceback" not in err, err


# ---- the chat app: conversation settings and toggles ------------------------------------------
def test_the_apps_settings_and_toggles_are_the_declaration():
    conversation = {s.name for s in SETTINGS if (s.scope == SAMPLING and s.chat) or (s.scope == "chat" and not s.toggle)}
    assert {f.name for f in dataclasses.fields(Settings)} == conversation
    assert {f.name for f in dataclasses.fields(Toggles)} == {s.name for s in TOGGLES}
    assert Toggles().to_dict() == {s.name: s.default for s in TOGGLES}
    assert set(CAPABILITIES) == {s.name for s in TOGGLES} | {"lab"}
    for s in TOGGLES:                                  # a saved value the declaration refuses is dropped
        for bad in bad_values(s):
            assert getattr(Toggles.from_dict({s.name: bad}), s.name) == s.default


async def _open_toggles(pilot) -> TogglesBox:
    await ready(pilot)
    await pilot.press("ctrl+t")
    await pilot.pause()
    return pilot.app.chat.query_one(TogglesBox)


async def _change(pilot, box: TogglesBox, s: Setting, value) -> None:
    """Set toggle `s` to `value` through its control, as a person would."""
    if s.kind is bool:
        await pilot.click(f"#tg-{s.name}")
    elif s.choices:
        box.query_one(f"#tg-{s.name}", Select).value = value
    else:
        field = box.query_one(f"#tg-{s.name}", Input)
        field.value = str(value)
        await field.action_submit()
    await pilot.pause()


@pytest.mark.anyio
@pytest.mark.parametrize("s", TOGGLES, ids=ident)
async def test_every_toggle_has_an_explained_control_that_reaches_the_backend(s, make_app):
    backend = FakeBackend(capabilities=dict.fromkeys(CAPABILITIES, True))
    app = make_app(backend)
    async with app.run_test(size=(160, 60)) as pilot:
        box = await _open_toggles(pilot)
        box.query_one(f"#tg-{s.name}").focus()             # its explanation, in the declaration's words
        await pilot.pause()
        assert str(box.query_one("#tg-help", Static).render()) == f"{s.title}: {s.help}"
        assert box.query_one(f"#tg-{s.name}").parent.tooltip == s.help
        value = other_value(s)
        await _change(pilot, box, s, value)
        assert {s.name: value} in backend.updates, backend.updates
        assert getattr(app.toggles, s.name) == value
        if not s.kind is bool and not s.choices:          # a refused value: marked, never sent
            sent = len(backend.updates)
            field = box.query_one(f"#tg-{s.name}", Input)
            for bad in bad_values(s):
                if str(bad) in dict(s.words):
                    continue
                field.value = str(bad)
                await field.action_submit()
                await pilot.pause()
                assert field.has_class("-invalid") and len(backend.updates) == sent
                help_line = box.query_one("#tg-help", Static)
                assert help_line.has_class("-error") and str(help_line.render()).startswith(f"{s.title}: ")


@pytest.mark.anyio
@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
async def test_the_telemetry_stays_in_view_with_the_toggles_open(size, make_app):
    app = make_app(FakeBackend())
    async with app.run_test(size=size) as pilot:
        box = await _open_toggles(pilot)
        await pilot.pause(0.3)
        height = size[1]
        for s in TOGGLES:                                   # every toggle's row on screen
            if s.gpu_only:                                  # a CPU backend: no control at all
                assert not box.query(f"#tg-{s.name}"), s.name
                continue
            row = box.query_one(f"#tg-{s.name}").parent
            assert 0 <= row.region.y < height and row.region.height == 1, s.name
        for section in ("#tm-phase", "#tm-latency"):         # and the live numbers under them
            region = app.chat.query_one(section).region
            assert region.height > 0 and region.y + region.height <= height - 1, section


@pytest.mark.anyio
async def test_a_gpu_backend_shows_the_cuda_graphs_switch(make_app):
    backend = FakeBackend(gpu=True)
    app = make_app(backend)
    async with app.run_test(size=(160, 60)) as pilot:
        box = await _open_toggles(pilot)
        switch = box.query_one("#tg-cuda_graphs", Switch)
        assert switch.value and not switch.disabled
        await pilot.click("#tg-cuda_graphs")
        await pilot.pause()
        assert backend.updates[-1] == {"cuda_graphs": False}


@pytest.mark.anyio
async def test_a_number_that_can_be_off_has_a_switch(make_app):
    backend = FakeBackend()
    app = make_app(backend)
    async with app.run_test(size=(160, 60)) as pilot:
        box = await _open_toggles(pilot)
        assert box.query_one("#tg-chunk_size", Input).value == "auto"        # the default, no error
        assert not box.query_one("#tg-chunk_size", Input).has_class("-invalid")
        await pilot.click("#tg-chunk_size-on")
        await pilot.pause()
        assert backend.updates[-1] == {"chunk_size": None}
        field = box.query_one("#tg-chunk_size", Input)
        field.value = "64"
        await field.action_submit()                       # kept while off
        assert backend.updates[-1] == {"chunk_size": None}
        await pilot.click("#tg-chunk_size-on")
        await pilot.pause()
        assert backend.updates[-1] == {"chunk_size": 64}
        assert box.query_one("#tg-chunk_size-on", Switch).value


# ---- the HTTP server ---------------------------------------------------------------------------
# The wire format widens one bound: top_k = -1 is vLLM's "off", taken as 0.
WIRE_ALSO_ACCEPTS = {"top_k": [-1]}


@pytest.mark.parametrize("s", settings.of(SAMPLING), ids=ident)
def test_the_server_takes_every_sampling_setting_within_its_bounds(s, http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    value = other_value(s)
    r = http.post("/v1/chat/completions", json={**body, s.name: 1 if s.name == "max_tokens" else value})
    assert r.status_code == 200, r.text
    for bad in bad_values(s):
        if bad in WIRE_ALSO_ACCEPTS.get(s.name, []):
            continue
        r = http.post("/v1/chat/completions", content=json.dumps({**body, s.name: bad}),
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (s.name, bad, r.text)
        assert r.json()["error"]["param"] == s.name


@pytest.mark.anyio
async def test_a_palette_toggle_applies_and_notifies_once(make_app):
    from tests.doubles.fake_backend import FakeBackend
    from .helpers import ready
    app = make_app(FakeBackend())
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+p")
        await pilot.pause(0.2)
        await pilot.press(*"Toggle KV cache")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause(0.5)
        assert app.backend.updates == [{"kv_cache": False}]          # the panel's echo sends nothing
        assert [n.message for n in app._notifications] == ["KV cache off: applies to the next reply."]
