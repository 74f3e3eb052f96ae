"""The `pdchat` command: chat (default), run, pull, models, info, bench.

Engine errors become one readable line on stderr and exit code 1, never a traceback; usage errors
(a value out of range, a flag the command has no use for) one line and exit code 2.
The engine (and torch) is imported only by the commands that need it, so `pdchat --help` is quick.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, NoReturn

EXIT_ERROR = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A usage error in one line (argparse would print the whole usage first)."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _real(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _checked(parse: Callable[[str], Any], ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """An argparse type: `parse` the text, then require ok(value), so a bad value is a usage error
    before any model loads (the engine checks again, for callers other than this CLI)."""
    def convert(text: str) -> Any:
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return value
    return convert


_positive_int = _checked(_whole, lambda n: n >= 1, "must be at least 1")
# More threads than CPUs only slows torch down, and enough of them abort the process (libgomp).
_threads = _checked(_whole, lambda n: 1 <= n <= (os.cpu_count() or 1),
                    f"must be 1 to {os.cpu_count() or 1} (the CPUs of this machine)")
_temperature = _checked(_real, lambda t: 0 <= t <= 2, "must be a number from 0 to 2")   # NaN fails too
_top_p = _checked(_real, lambda p: 0 < p <= 1, "must be more than 0 and at most 1")
_top_k = _checked(_whole, lambda k: k >= 0, "must be 0 (off) or more")
# The range of SamplingParams.seed (torch generators take 64-bit seeds, signed or not).
_seed = _checked(_whole, lambda s: -2**63 <= s < 2**64, "must fit 64 bits (-2**63 to 2**64-1)")


def _utf8(text: str) -> str:
    """Command-line text for the model: bytes that are not UTF-8 reach Python as lone surrogates,
    which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 (character {e.start + 1})") from None
    return text


def _chunk(text: str) -> int | None | str:
    """--chunk-size N, auto (the device's default), or 0/off for no chunking."""
    if text.lower() in ("0", "off", "none"):
        return None
    if text.lower() == "auto":
        return "auto"
    return _positive_int(text)


def _shared_flags() -> argparse.ArgumentParser:
    # No defaults: a flag not given sets nothing (SUPPRESS). So `pdchat --threads 4 run` keeps its 4
    # (a subcommand's default would overwrite it), chat can tell a flag from a saved toggle, and the
    # defaults live in one place, EngineConfig and SamplingParams. Destinations are their fields.
    p = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    g = p.add_argument_group("model and device")
    g.add_argument("--model", help="smollm2-135m (default), a hub id, a folder, a .gguf, random:<preset>")
    g.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    g.add_argument("--dtype", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    g.add_argument("--threads", type=_threads, metavar="N", help="CPU threads for torch (default: torch's choice)")
    g.add_argument("--kernels", choices=["auto", "torch", "triton", "cpu"],
                   help="auto (default: Triton attention on CUDA, the C kernels for fp32 on CPU), or force one; "
                        "torch = plain PyTorch ops")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=_positive_int, metavar="N", help="most tokens to generate (default 256)")
    s.add_argument("--temperature", type=_temperature, metavar="T", help="0 = greedy, up to 2 (default 0.7)")
    s.add_argument("--top-p", type=_top_p, metavar="P", help="nucleus sampling, in (0, 1] (default 1 = off)")
    s.add_argument("--top-k", type=_top_k, metavar="K", help="sample from the K likeliest tokens (default 0 = off)")
    s.add_argument("--seed", type=_seed, help="for reproducible sampling (default: random)")
    s.add_argument("--system", type=_utf8, help="system prompt")
    o = p.add_argument_group("optimizations")
    o.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="naive mode: recompute everything each token")
    o.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not reuse cached prompt prefixes")
    o.add_argument("--chunk-size", type=_chunk, metavar="N",
                   help="prefill tokens per step: auto (default), N, or 0 = no chunking")
    o.add_argument("--kv-cache-mb", type=_positive_int, metavar="MB", help="KV pool size in MB")
    o.add_argument("--max-batch", dest="max_num_seqs", type=_positive_int, metavar="N",
                   help="most requests per step (default 64)")
    o.add_argument("--spec", choices=["off", "ngram", "draft"], help="speculative decoding (default off)")
    o.add_argument("--draft-model", help="draft for --spec draft: a model with the same tokenizer, "
                   "or 'self' (default: the target's own weights in int8)")
    o.add_argument("--spec-tokens", type=_positive_int, metavar="K", help="initial draft length (default 4)")
    o.add_argument("--quant", choices=["none", "int8"], help="weight quantization (default none)")
    return p


# The shared flags by what they configure (argparse destinations, named as the fields they set).
ENGINE_FLAGS = ("model", "device", "dtype", "threads", "kernels", "kv_cache", "prefix_cache", "chunk_size",
                "kv_cache_mb", "max_num_seqs", "spec", "draft_model", "spec_tokens", "quant")   # EngineConfig
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "seed")                        # SamplingParams
SETTINGS_FLAGS = SAMPLING_FLAGS + ("system",)                                                 # the app's Settings
RENAMED_FLAGS = {"kv_cache": "--no-kv-cache", "prefix_cache": "--no-prefix-cache", "max_num_seqs": "--max-batch"}


def flag_name(dest: str) -> str:
    return RENAMED_FLAGS.get(dest, "--" + dest.replace("_", "-"))


BACKEND_HELP = ("an OpenAI-compatible server (pdchat serve, vLLM, SGLang, llama.cpp, Ollama) instead of the "
                "local engine; API key from $PDCHAT_API_KEY or $OPENAI_API_KEY")


def build_parser() -> argparse.ArgumentParser:
    shared = _shared_flags()
    parser = _Parser(
        prog="pdchat", parents=[shared],
        description="Chat with a local LLM and watch prefill, decode, the KV cache and the device live.")
    parser.add_argument("--backend", metavar="URL", default=None, help=BACKEND_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", parents=[shared], help="one turn headless: stream the answer, then a summary")
    run.add_argument("prompt", nargs="?", default=None, type=_utf8, help="the prompt ('-' or absent: read stdin)")
    run.add_argument("--json", action="store_true", help="print one JSON object {text, token_ids, finish_reason, metrics}")
    # SUPPRESS: not given here, `pdchat --backend URL run` keeps the URL given before the command
    run.add_argument("--backend", metavar="URL", default=argparse.SUPPRESS, help=BACKEND_HELP)
    pull = sub.add_parser("pull", help="fetch a model into the cache")
    pull.add_argument("model", nargs="?", default=argparse.SUPPRESS, help="default: smollm2-135m")
    sub.add_parser("models", help="list cached models")
    sub.add_parser("info", help="versions, device, GPU, data/config/cache paths")
    _add_bench(sub, shared)
    _add_serve(sub, shared)
    return parser


def _add_bench(sub: Any, shared: argparse.ArgumentParser) -> None:
    bench = sub.add_parser("bench", parents=[shared], help="measure: lab | toggles | baseline | spec | serve")
    bench.add_argument("suite", help="lab (the claims, with curves and verdicts) | toggles | baseline | spec | serve")
    bench.add_argument("--json", action="store_true", help="print machine-readable results")
    bench.add_argument("--quick", action="store_true", help="small sizes (for a smoke test)")
    load = bench.add_argument_group("bench serve (a load test of --backend URL)")
    load.add_argument("--backend", metavar="URL", default=argparse.SUPPRESS,
                      help="the OpenAI-compatible server to load")
    load.add_argument("--concurrency", type=_positive_int, default=16, help="clients sending at once (default 16)")
    load.add_argument("--requests", type=_positive_int, default=64, help="requests in all (default 64)")
    load.add_argument("--prompt-words", type=_positive_int, default=64, help="words per prompt (default 64)")
    load.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens (vLLM, SGLang, llama.cpp, pdchat)")
    load.add_argument("--endpoint", choices=["chat", "completions"], default="chat", help="which API to load")


def _add_serve(sub: Any, shared: argparse.ArgumentParser) -> None:
    serve = sub.add_parser(
        "serve", parents=[shared], help="OpenAI-compatible HTTP server (127.0.0.1 by default)",
        description="Serve the model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), "
                    "with /metrics and /health. By default only this machine can connect, web pages cannot "
                    "call it, and every request is bounded in size and time.")
    from pdchat.chatapp.serve.options import Limits, comma_list   # plain dataclasses: --help stays quick
    limits = Limits()
    net = serve.add_argument_group("listening")
    net.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0: every network, "
                          "so set an API key)")
    net.add_argument("--port", type=_whole, default=8000,
                     help="TCP port (default 8000; 0: any free port, printed at start)")
    keys = serve.add_argument_group("API keys (each key is a tenant, with a prefix cache of its own)")
    keys.add_argument("--api-key", metavar="KEY", default=None,
                      help="require 'Authorization: Bearer KEY' on /v1 and /metrics (default: $PDCHAT_API_KEY; "
                           "neither: no key). A flag shows in `ps`: prefer the variable or --api-key-file")
    keys.add_argument("--api-key-file", metavar="PATH", default=None,
                      help="accept every key in this file too: one per line, '#' comments (default: none)")
    keys.add_argument("--shared-prefix-cache", action="store_true",
                      help="let different API keys reuse each other's cached prompt prefixes: more cache hits, "
                           "but cached_tokens then tells a key whether another key sent the same text "
                           "(default: each key has its own cache; a request's cache_salt splits it further)")
    web = serve.add_argument_group("web pages (CORS, DNS rebinding)")
    web.add_argument("--allowed-hosts", metavar="NAME,...", type=comma_list, default=(),
                     help="names accepted in the Host header besides IP addresses, localhost and --host; "
                          "'*' = any (default: none, which stops DNS-rebinding pages)")
    web.add_argument("--allowed-origins", metavar="ORIGIN,...", type=comma_list, default=(),
                     help="web pages allowed to call the API, with CORS, e.g. http://localhost:3000; '*' = any "
                          "(default: none: requests from browser pages are refused)")
    bounds = serve.add_argument_group("limits")
    bounds.add_argument("--max-pending", metavar="N", type=_positive_int, default=256,
                        help="requests admitted at once, running and waiting; more get HTTP 503 (default 256)")
    bounds.add_argument("--max-body-mb", metavar="MB", type=_positive_int, default=limits.max_body_bytes // 2**20,
                        help=f"largest request body in MiB; a larger one gets HTTP 413 before it is read "
                             f"(default {limits.max_body_bytes // 2**20})")
    bounds.add_argument("--read-timeout", metavar="SECONDS", type=_positive_int, default=int(limits.read_timeout_s),
                        help=f"time a client has to send a request's headers, and again its body; slower "
                             f"connections are closed or get HTTP 408 (default {limits.read_timeout_s:g})")
    bounds.add_argument("--max-connections", metavar="N", type=_positive_int, default=limits.max_connections,
                        help=f"open connections at most; more get HTTP 503 (default {limits.max_connections})")


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


def _read_prompt(args: argparse.Namespace) -> str:
    from pdchat.engine.errors import InvalidRequest
    if args.prompt not in (None, "-"):
        prompt = args.prompt
    else:
        prompt = _read_stdin()
    if not prompt.strip():
        raise InvalidRequest("empty prompt")
    return prompt


def _read_stdin() -> str:
    from pdchat.engine.errors import InvalidRequest
    if sys.stdin is None or sys.stdin.isatty():
        raise InvalidRequest("no prompt: give one as an argument or pipe it on stdin")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"stdin is not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


def summary_line(m: dict[str, Any]) -> str:
    """The reply's one-line summary (the app's per-message line, plus the prefill rate)."""
    from .format import summary
    return summary(m, prefill_rate=True)


def cmd_run(args: argparse.Namespace) -> int:
    if args.backend:
        from pdchat.chatapp.remote_run import run_remote
        return run_remote(args)
    from pdchat.engine import Engine, FinishEvent, TokenEvent
    prompt = _read_prompt(args)
    params = sampling_params(args)
    with Engine(engine_config(args), telemetry=False) as engine:
        for notice in engine.notices:
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
    return report_turn(args, completion.text, completion.token_ids, completion.finish_reason,
                       completion.metrics.to_dict(), completion.error)


def report_turn(args: argparse.Namespace, text: str, token_ids: list[int] | None, finish_reason: str,
                metrics: dict[str, Any], error: str | None) -> int:
    """How a finished `pdchat run` turn ends, local or remote: the JSON object, or a newline after
    the streamed text and the summary line; then the exit code."""
    if error:
        print(f"pdchat: error: {error}", file=sys.stderr)
    if args.json:
        print(json.dumps({"text": text, "token_ids": token_ids, "finish_reason": finish_reason,
                          "metrics": metrics}))
    else:
        sys.stdout.write("\n")
        print(summary_line(metrics), file=sys.stderr)
    return EXIT_ERROR if finish_reason == "error" else 0


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

    from pdchat.chatapp.bench_report import progress_bar, render
    console = Console(stderr=args.json)         # with --json, stdout carries the JSON alone
    if args.suite != "serve" and args.backend:
        console.print(f"pdchat bench {args.suite} measures the local engine; it is not available with a remote "
                      f"backend ({args.backend}). Use `pdchat bench serve --backend URL` to load a server.",
                      soft_wrap=True)
        return 2
    bar, update = progress_bar(console)
    with bar:
        if args.suite == "serve":            # a client: loads a server, needs no local engine
            from pdchat.chatapp.loadtest import run_from_args
            result = run_from_args(args, progress=update)
        else:
            from pdchat.engine.bench import run_suite
            result = run_suite(args.suite, engine_config(args), quick=args.quick, progress=update)
    if args.json:
        print(json.dumps(result, indent=2))
        if "files" in result:
            console.print(f"lab results written to {result['files']['dir']}", soft_wrap=True)
    elif args.suite == "lab":
        from pdchat.chatapp.lab_report import render_lab
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
    from pdchat.chatapp.app import run_app
    return run_app(given(args, ENGINE_FLAGS), given(args, SETTINGS_FLAGS), backend=args.backend)


COMMANDS: dict[str | None, Callable[[argparse.Namespace], int]] = {
    None: cmd_chat, "run": cmd_run, "pull": cmd_pull, "models": cmd_models, "info": cmd_info, "bench": cmd_bench,
    "serve": cmd_serve,
}


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


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:                      # usage errors (2) and --help (0), as a return code
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if why := unused_flags(args):
        print(f"pdchat: error: {why}", file=sys.stderr)
        return EXIT_USAGE
    from pdchat.chatapp.openai_client import RemoteError
    from pdchat.engine.errors import EngineError
    try:
        return COMMANDS[args.command](args)
    except (EngineError, RemoteError) as e:
        print(f"pdchat: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("pdchat: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`pdchat run ... | head`): stop quietly, and keep Python from failing
        # again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except OSError as e:                         # the machine's doing (disk full, a path that is a file)
        print(f"pdchat: error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
