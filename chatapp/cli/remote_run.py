"""`pdchat run --backend URL`: one turn against an OpenAI-compatible server, printed as a local run
is (streamed text and a summary line, or one JSON object). token_ids are null: the OpenAI API
does not return them."""
from __future__ import annotations

import argparse
import sys

from pdchat.chatapp.backends.base import Done, Settings, Token
from pdchat.chatapp.backends.remote import RemoteBackend
from pdchat.chatapp.cli.flags import SETTINGS_FLAGS, given
from pdchat.chatapp.cli.turn import read_prompt, report_turn


def run_remote(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    settings = Settings(**given(args, SETTINGS_FLAGS))
    backend = RemoteBackend(args.backend, model=getattr(args, "model", None))
    done: Done | None = None
    try:
        backend.load(lambda line: None)
        generation = backend.stream([{"role": "user", "content": prompt}], settings)
        try:
            for event in generation:
                if isinstance(event, Token) and not args.json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif isinstance(event, Done):
                    done = event
        except KeyboardInterrupt:
            generation.cancel()
            done = Done(generation.reply.text, "cancelled", generation.reply.metrics())
    finally:
        backend.close()
    return report_turn(args, done.text, None, done.finish_reason, done.metrics, done.error)
