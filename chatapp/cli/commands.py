"""What each `pdchat` command does, once its command line is parsed. Each imports the engine (and
torch) itself, so that `pdchat --help` and the chat UI's start stay quick."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from pdchat.chatapp.cli.flags import ENGINE_FLAGS, SETTINGS_FLAGS, engine_config, given, sampling_params
from pdchat.chatapp.cli.turn import EXIT_ERROR, read_prompt, report_turn


def cmd_run(args: argparse.Namespace) -> int:
    if args.backend:
        from pdchat.chatapp.cli.remote_run import run_remote
        return run_remote(args)
    from pdchat.engine import Engine, FinishEvent, TokenEvent
    prompt = read_prompt(args)
    params = sampling_params(args)
    with Engine(engine_config(args), telemetry=False) as engine:
        for notice in engine.take_notices():
            print(f"pdchat: note: {notice}", file=sys.stderr)
        stream = engine.submit(prompt, params, system=getattr(args, "system", None))
        completion = None
        try:
            for event in stream:
                if isinstance(event, TokenEvent) and not args.json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif isinstance(event, FinishEvent):
                    completion = event.completion
        except KeyboardInterrupt:
            stream.cancel()
            completion = stream.result()
        for notice in engine.take_notices():          # what the engine changed while it ran
            print(f"\npdchat: note: {notice}", file=sys.stderr)
    return report_turn(args, completion.text, completion.token_ids, completion.finish_reason,
                       completion.metrics.to_dict(), completion.error)


def cmd_pull(args: argparse.Namespace) -> int:
    from pdchat.engine import DEFAULT_MODEL
    from pdchat.engine.model_source import resolve
    files = resolve(getattr(args, "model", None) or DEFAULT_MODEL)
    print(f"{files.name}: {files.path or files.source} ({files.source})")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from pdchat.engine.model_source import cached_models
    rows = cached_models()
    if not rows:
        print("no cached models (run `pdchat pull`)")
    for name, path, size in rows:
        print(f"{name:32s} {size / 2**20:8.1f} MB  {path}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from pdchat.engine.info import info
    for key, value in info().items():
        print(f"{key:18s} {value}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdchat.chatapp.reporting.bench_report import progress_bar, render
    console = Console(stderr=args.json)         # with --json, stdout carries the JSON alone
    if args.suite != "serve" and args.backend:
        console.print(f"pdchat bench {args.suite} measures the local engine; it is not available with a remote "
                      f"backend ({args.backend}). Use `pdchat bench serve --backend URL` to load a server.",
                      soft_wrap=True)
        return 2
    bar, update = progress_bar(console)
    with bar:
        if args.suite == "serve":            # a client: loads a server, needs no local engine
            from pdchat.chatapp.reporting.loadtest import run_from_args
            result = run_from_args(args, progress=update)
        else:
            from pdchat.bench import run_suite
            result = run_suite(args.suite, engine_config(args), quick=args.quick, progress=update)
    if args.json:
        print(json.dumps(result, indent=2))
        if "files" in result:
            console.print(f"lab results written to {result['files']['dir']}", soft_wrap=True)
    elif args.suite == "lab":
        from pdchat.chatapp.reporting.lab_report import render_lab
        render_lab(result, console)
    else:
        render(result, console)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pdchat.chatapp.serve.app import serve
    from pdchat.chatapp.serve.auth import load_keys
    from pdchat.chatapp.serve.options import Limits, ServeError, ServeOptions
    try:
        limits = Limits(max_body_bytes=args.max_body_mb * 2**20, read_timeout_s=args.read_timeout,
                        max_connections=args.max_connections)
        options = ServeOptions(api_keys=load_keys(args.api_key, args.api_key_file),
                               shared_prefix_cache=args.shared_prefix_cache, allowed_hosts=args.allowed_hosts,
                               allowed_origins=args.allowed_origins, limits=limits)
        serve(engine_config(args), host=args.host, port=args.port, max_pending=args.max_pending, options=options)
    except ServeError as e:
        print(f"pdchat: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    # The app's UI thread shares the cores with the model. OpenMP's workers spin after each of
    # their parallel ops (the sampler's, a long prompt's products) by default, and there one took a
    # fifth of a core from the model's kernels and the UI: a sampled reply decoded at a TPOT of
    # 55-60 ms where it took 48-53 with them waiting asleep (2-core AMD EPYC, AVX2, 2026-11-28;
    # `pdchat run` 39-40 ms). OpenMP reads the setting when torch loads it, after this (the engine
    # loads in the app); a user's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from pdchat.chatapp.tui.app import run_app
    return run_app(given(args, ENGINE_FLAGS), given(args, SETTINGS_FLAGS), backend=args.backend)


COMMANDS: dict[str | None, Callable[[argparse.Namespace], int]] = {
    None: cmd_chat, "run": cmd_run, "pull": cmd_pull, "models": cmd_models, "info": cmd_info, "bench": cmd_bench,
    "serve": cmd_serve,
}


