"""Every setting is declared once (pdchat/engine/settings.py); these tests walk each one through
every surface it names: the engine's dataclasses and checks, Engine.update(), the CLI flags and
--help, the chat app's settings and toggles panel, and the HTTP server's bounds. A setting added to
the declaration is checked everywhere without touching this file; a surface that forgets one fails.
"""
from __future__ import annotations

import dataclasses

import pytest

from pdchat.engine import EngineConfig, InvalidRequest, SamplingParams, settings
from pdchat.engine.settings import ENGINE, SAMPLING, SETTINGS, Setting

from .setting_values import bad_values, other_value


def ident(s: Setting) -> str:
    return f"{s.scope}.{s.name}"


# ---- the declaration itself -------------------------------------------------------------------
def test_names_are_unique_within_a_scope_and_every_setting_explains_itself():
    keys = [(s.scope, s.name) for s in SETTINGS]
    assert len(keys) == len(set(keys))
    flags = [s.cli_flag for s in SETTINGS if s.cli_flag]
    assert len(flags) == len(set(flags)), "two settings share a flag"
    for s in SETTINGS:
        assert s.help and not s.help.endswith("."), s.name
        assert s.cli_flag or s.no_flag, f"{s.name} has no flag and no reason for it"
        assert s.problem(s.default) is None, f"{s.name}'s default is refused by its own rule"
        assert not s.runtime or s.scope == ENGINE


@pytest.mark.parametrize("scope, cls", [(ENGINE, EngineConfig), (SAMPLING, SamplingParams)])
def test_the_engine_dataclasses_are_the_declaration(scope, cls):
    declared = {s.name: s.default for s in settings.of(scope)}
    made = cls()
    assert {f.name for f in dataclasses.fields(cls)} == set(declared)
    assert {name: getattr(made, name) for name in declared} == declared


@pytest.mark.parametrize("s", [s for s in SETTINGS if s.scope in (ENGINE, SAMPLING)], ids=ident)
def test_the_engine_takes_every_valid_value_and_refuses_every_bad_one(s):
    cls = EngineConfig if s.scope == ENGINE else SamplingParams
    value = other_value(s)
    assert getattr(cls(**{s.name: value}), s.name) == value
    for bad in bad_values(s):
        with pytest.raises(InvalidRequest, match=s.title):
            cls(**{s.name: bad})


def test_words_read_as_their_values():
    chunk = settings.get("chunk_size")
    assert chunk.read("auto") == "auto" and chunk.read("off") is None and chunk.read(" 64 ") == 64
    with pytest.raises(ValueError, match="must be at least 1, got -5"):
        chunk.read("-5")
    with pytest.raises(ValueError, match="expected a whole number, auto, off or none"):
        chunk.read("128x")


# ---- Engine.update() ---------------------------------------------------------------------------
def test_update_changes_every_runtime_setting_and_refuses_the_rest(tiny_engine):
    from pdchat.engine.engine import RUNTIME_SETTINGS
    assert set(RUNTIME_SETTINGS) == {s.name for s in settings.of(ENGINE) if s.runtime}
    for s in settings.of(ENGINE):
        if not s.runtime:
            with pytest.raises(InvalidRequest, match="unknown engine setting"):
                tiny_engine.update(**{s.name: other_value(s)})
            continue
        value = other_value(s)
        tiny_engine.update(**{s.name: value})
        assert getattr(tiny_engine.config, s.name) == value, s.name
        stats = tiny_engine.stats()
        if hasattr(stats, s.name):
            assert getattr(stats, s.name) == value, s.name
        tiny_engine.update(**{s.name: s.default})
        for bad in bad_values(s):
            with pytest.raises(InvalidRequest):
                tiny_engine.update(**{s.name: bad})
    done = tiny_engine.generate(["still works"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(done[0].token_ids) == 3
