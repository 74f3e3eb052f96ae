"""The flags every `pdchat` command shares (model, device, sampling, optimizations), made from the
settings declaration (pdchat/engine/settings.py): name, type, range, default and help come from
there, so a setting added there is a flag here. A flag not given sets nothing (argparse's
SUPPRESS): `pdchat --threads 4 run` keeps its 4, chat can tell a flag from a saved toggle, and
defaults live only in the declaration.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

from pdchat.engine import settings
from pdchat.engine.settings import CHAT, ENGINE, SAMPLING, Setting

GROUPS = ("model and device", "sampling", "optimizations", "disaggregation")

_FLAGGED = tuple(s for s in settings.SETTINGS if s.cli_flag)
# The shared flags by what they configure (argparse destinations are the fields they set).
ENGINE_FLAGS = tuple(s.name for s in _FLAGGED if s.scope == ENGINE)        # EngineConfig
SAMPLING_FLAGS = tuple(s.name for s in _FLAGGED if s.scope == SAMPLING)    # SamplingParams
SETTINGS_FLAGS = SAMPLING_FLAGS + tuple(s.name for s in _FLAGGED if s.scope == CHAT)   # the app's Settings


def flag_name(dest: str) -> str:
    return next(s.cli_flag for s in _FLAGGED if s.name == dest)


def utf8(text: str) -> str:
    """Command-line text for the model: bytes that are not UTF-8 reach Python as lone surrogates,
    which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 (character {e.start + 1})") from None
    return text


def _value_of(s: Setting) -> Callable[[str], Any]:
    """An argparse type: the declaration reads and checks the text, so a bad value is a usage
    error before any model loads."""
    def convert(text: str) -> Any:
        try:
            return s.read(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = s.name
    return convert


def _add(group: argparse._ArgumentGroup, s: Setting) -> None:
    if s.kind is bool:
        group.add_argument(s.cli_flag, dest=s.name, action="store_false" if s.default else "store_true",
                           help=f"turn off: {s.help}" if s.default else s.help)
    elif s.choices:
        group.add_argument(s.cli_flag, dest=s.name, choices=s.choices, help=s.describe())
    else:
        group.add_argument(s.cli_flag, dest=s.name, type=_value_of(s), metavar=s.metavar or s.name.upper(),
                           help=s.describe())


def shared_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    for title in GROUPS:
        group = p.add_argument_group(title)
        for s in _FLAGGED:
            if s.group == title:
                _add(group, s)
    return p


def given(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """The flags among `names` that the command line gave, by destination; the rest keep their
    defaults where the values are used (EngineConfig, SamplingParams, the app's Settings)."""
    return {name: value for name, value in vars(args).items() if name in names}


def engine_config(args: argparse.Namespace) -> Any:
    """The one mapping from the command line to the engine's configuration, for every command
    (chat hands the same fields to its LocalBackend)."""
    from pdchat.engine import EngineConfig
    return EngineConfig(**given(args, ENGINE_FLAGS))


def sampling_params(args: argparse.Namespace) -> Any:
    from pdchat.engine import SamplingParams
    return SamplingParams(**given(args, SAMPLING_FLAGS))


def flags_used(args: argparse.Namespace) -> tuple[tuple[str, ...], str]:
    """The shared flags a command reads, and why it has no use for the others."""
    command = args.command
    if command in (None, "run"):
        if args.backend:
            return ("model",) + SETTINGS_FLAGS, f"they set up the local engine, and {args.backend} runs its own"
        return ENGINE_FLAGS + SETTINGS_FLAGS, ""
    if command == "bench" and args.suite == "serve":
        return ("model",) + SAMPLING_FLAGS, "bench serve is a client, and the server runs its own engine"
    if command == "bench":
        return ENGINE_FLAGS, f"bench {args.suite} sends its own prompts with its own sampling"
    if command == "serve":
        return ENGINE_FLAGS, "pdchat serve takes the sampling of each request from the request"
    if command == "pull":
        return ("model",), "pdchat pull only fetches a model"
    return (), f"pdchat {command} takes none of the model, sampling or engine flags"


def unused_flags(args: argparse.Namespace) -> str | None:
    """Why the command line gives a flag that its command ignores, if it does: such a flag is a usage
    error, so that every flag means the same wherever it is taken."""
    used, why = flags_used(args)
    unused = [flag_name(dest) for dest in given(args, ENGINE_FLAGS + SETTINGS_FLAGS) if dest not in used]
    if not unused:
        return None
    return f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} nothing here: {why}"


