"""`pdchat run --backend URL`: one turn against an OpenAI-compatible server, printed as a local run
is (streamed text and a summary line, or one JSON object). token_ids are null: the OpenAI API
does not return them."""
from __future__ import annotations

import argparse
import json
import sys

from .backend import Done, Settings, Token
from .remote_backend import RemoteBackend


def run_remote(args: argparse.Namespace) -> int:
    from .cli import EXIT_ERROR, _read_prompt, summary_line
    prompt = _read_prompt(args)
    settings = Settings(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=args.seed, system=args.system)
    backend = RemoteBackend(args.backend, model=args.model)
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
    if done.error:
        print(f"pdchat: error: {done.error}", file=sys.stderr)
    if args.json:
        print(json.dumps({"text": done.text, "token_ids": None, "finish_reason": done.finish_reason,
                          "metrics": done.metrics}))
    else:
        sys.stdout.write("\n")
        print(summary_line(done.metrics), file=sys.stderr)
    return EXIT_ERROR if done.finish_reason == "error" else 0
