"""The `pdchat` command line: its commands and their own options. The model, sampling and engine
flags every command shares come from the settings declaration (flags.py)."""
from __future__ import annotations

import argparse
from typing import Any, Callable, NoReturn

from pdchat.chatapp.cli.flags import shared_flags, utf8

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


BACKEND_HELP = ("an OpenAI-compatible server (pdchat serve, vLLM, SGLang, llama.cpp, Ollama) instead of the "
                "local engine; API key from $PDCHAT_API_KEY or $OPENAI_API_KEY")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pdchat")
    except PackageNotFoundError:          # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    shared = shared_flags()
    parser = _Parser(
        prog="pdchat", parents=[shared],
        description="Chat with a local LLM and watch prefill, decode, the KV cache and the device live.")
    parser.add_argument("--version", action="version", version=f"pdchat {_version()}")
    parser.add_argument("--backend", metavar="URL", default=None, help=BACKEND_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", parents=[shared], help="one turn headless: stream the answer, then a summary")
    run.add_argument("prompt", nargs="?", default=None, type=utf8, help="the prompt ('-' or absent: read stdin)")
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
    bench = sub.add_parser("bench", parents=[shared], help="measure: lab | toggles | baseline | spec | quant | gpu | disagg | serve")
    bench.add_argument("suite", help="lab (the claims, with curves and verdicts) | toggles | baseline | spec | "
                       "quant (quality of int8/int4 weights) | gpu (CUDA graphs, roofline, HF, throughput on a "
                       "GPU) | disagg (a stream's stalls and a newcomer's TTFT, colocated vs disaggregated) | serve")
    bench.add_argument("--json", action="store_true", help="print machine-readable results")
    bench.add_argument("--quick", action="store_true",
                       help="small sizes: the lab in under a minute (fewer points, noisier); others: a smoke test")
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
    from pdchat.chatapp.serve.options import DEFAULT_MAX_PENDING, Limits, comma_list   # plain dataclasses: --help stays quick
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
    bounds.add_argument("--max-pending", metavar="N", type=_positive_int, default=DEFAULT_MAX_PENDING,
                        help=f"requests admitted at once, running and waiting; more get HTTP 503 "
                             f"(default {DEFAULT_MAX_PENDING})")
    bounds.add_argument("--max-body-mb", metavar="MB", type=_positive_int, default=limits.max_body_bytes // 2**20,
                        help=f"largest request body in MiB; a larger one gets HTTP 413 before it is read "
                             f"(default {limits.max_body_bytes // 2**20})")
    bounds.add_argument("--read-timeout", metavar="SECONDS", type=_positive_int, default=int(limits.read_timeout_s),
                        help=f"time a client has to send a request's headers, and again its body; slower "
                             f"connections are closed or get HTTP 408 (default {limits.read_timeout_s:g})")
    bounds.add_argument("--max-connections", metavar="N", type=_positive_int, default=limits.max_connections,
                        help=f"open connections at most; more get HTTP 503 (default {limits.max_connections})")


