"""pdchat's Textual themes, built on the colour roles of palette.py (which needs no Textual).

Roles (CSS variables `$role-<name>` and `roles(app)` in Python):
  prefill  the prompt-processing pause (time to first token)
  decode   the token stream
  cached   prompt tokens served from the prefix cache
  kv       the KV cache pool
  gpu      the device (GPU or CPU) at work
"""
from __future__ import annotations

from textual.theme import Theme

from pdchat.themes.palette import DEFAULT_ROLES, LIGHT_ROLES, ROLE_NAMES

__all__ = ["DEFAULT_ROLES", "DEFAULT_THEME", "ROLE_NAMES", "THEMES", "role_defaults", "roles"]

def _vars(**roles: str) -> dict[str, str]:
    return {f"role-{k}": v for k, v in {**DEFAULT_ROLES, **roles}.items()}


PDCHAT_DARK = Theme(
    name="pdchat-dark",
    primary="#5e81ac",
    secondary="#88c0d0",
    accent="#e5a50a",
    foreground="#e5e9f0",
    background="#1b1f27",
    surface="#232833",
    panel="#2b3140",
    success="#33d17a",
    warning="#e5a50a",
    error="#f66151",
    dark=True,
    variables=_vars(),
)

PDCHAT_LIGHT = Theme(
    name="pdchat-light",
    primary="#1c71d8",
    secondary="#0e7490",
    accent="#b45309",
    foreground="#1e1e1e",
    background="#fafafa",
    surface="#f0f0f0",
    panel="#e4e4e7",
    success="#15803d",
    warning="#b45309",
    error="#c01c28",
    dark=False,
    variables=_vars(**LIGHT_ROLES),
)

THEMES = [PDCHAT_DARK, PDCHAT_LIGHT]
DEFAULT_THEME = PDCHAT_DARK.name


def role_defaults() -> dict[str, str]:
    """CSS variable defaults (role-prefill, ...) for App.get_theme_variable_defaults."""
    return _vars()


def roles(app) -> dict[str, str]:
    """The role colours of the app's current theme, keyed by role name (for Rich Text styles)."""
    variables = getattr(app, "theme_variables", {}) or {}
    return {name: variables.get(f"role-{name}", DEFAULT_ROLES[name]) for name in ROLE_NAMES}
