"""Values for each declared setting, derived from its declaration: a valid one that is not the
default, the text that types it, and values it refuses. Shared by the tests that walk every
setting through every surface (tests/test_settings.py, tests/chatapp/test_cli_flags.py,
tests/chatapp/test_settings_surfaces.py)."""
from __future__ import annotations

from typing import Any

from pdchat.engine.settings import Setting


def other_value(s: Setting) -> Any:
    """A valid value that is not the default (what a surface must carry through unchanged)."""
    if s.kind is bool:
        return not s.default
    if s.choices:
        return next(c for c in s.choices if c != s.default)
    if s.kind is list:
        return ["###"]
    if s.kind is str:
        return "random:tiny" if s.name in ("model", "draft_model") else "cpu" if s.name == "device" else "hello"
    low = s.low if s.low is not None else 0
    value = s.kind(low) + (1 if s.kind is int else 0.5)
    if s.high is not None and value >= s.high:
        value = s.kind(s.kind(low) + (s.kind(s.high) - s.kind(low)) / (2 if s.kind is float else 1))
    if s.rule is not None:                      # block size: a power of two
        value = 2 if s.default != 2 else 4
    if s.name == "threads":
        value = 1
    assert s.problem(value) is None, (s.name, value)
    return value


def bad_values(s: Setting) -> list[Any]:
    """Values the declaration refuses (each surface must refuse them too)."""
    bad: list[Any] = []
    if s.choices:
        bad.append("no-such-" + s.name)
    if s.kind in (int, float):
        if s.low is not None:
            bad.append(s.kind(s.low) if s.low_open else s.kind(s.low) - 1)
        if s.high is not None:
            bad.append(s.kind(s.high) if s.high_open else s.kind(s.high) + 1)
    if s.kind is int:
        bad.append(1.5)
    if s.rule is not None:
        bad.append(12)
    return bad


def typed(s: Setting, value: Any) -> list[str]:
    """The command-line words that give `value` (a bool flag alone flips it)."""
    if s.kind is bool:
        return [s.cli_flag]
    return [s.cli_flag, str(value)]
