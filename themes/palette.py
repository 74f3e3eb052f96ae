"""The colour roles every view of pdchat shares: the TUI (through its Textual themes), the lab's
terminal curves and its SVG figures. Plain data, no Textual: `pdchat bench` imports it too.

  prefill  the prompt-processing pause (time to first token)
  decode   the token stream
  cached   prompt tokens served from the prefix cache
  kv       the KV cache pool
  gpu      the device (GPU or CPU) at work
"""
from __future__ import annotations

ROLE_NAMES = ("prefill", "decode", "cached", "kv", "gpu")

# The dark theme's roles, and the defaults for any theme (Textual's built-ins) that sets none.
DEFAULT_ROLES = {
    "prefill": "#e5a50a",   # amber: waiting on the prompt
    "decode": "#33d17a",    # green: tokens flowing
    "cached": "#62a0ea",    # blue: reused work
    "kv": "#c061cb",        # purple: memory
    "gpu": "#f66151",       # red: the device
}

# Darker shades that read on a light background (the light theme, and the SVG figures' white page).
LIGHT_ROLES = {"prefill": "#b45309", "decode": "#15803d", "cached": "#1d4ed8", "kv": "#7e22ce", "gpu": "#c01c28"}
