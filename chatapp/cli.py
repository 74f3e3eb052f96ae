"""The `pdchat` command: chat (default), run, pull, models, info, bench.

Engine errors become one readable line on stderr and a non-zero exit code, never a traceback.
The engine (and torch) is imported only by the commands that need it, so `pdchat --help` is quick.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

EXIT_ERROR = 1
EXIT_USAGE = 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _chunk(text: str) -> int | None | str:
    """--chunk-size N, auto (the device's default), or 0/off for no chunking."""
    if text.lower() in ("0", "off", "none"):
        return None
    if text.lower() == "auto":
        return "auto"
    return _positive_int(text)


def _shared_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("model and device")
    g.add_argument("--model", default=None, help="smollm2-135m (default), a hub id, a folder, a .gguf, random:<preset>")
    g.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    g.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for torch")
    g.add_argument("--kernels", choices=["auto", "torch", "triton", "cpu"], default="auto",
                   help="auto (default: Triton attention on CUDA, the C kernels for fp32 on CPU), or force one; "
                        "torch = plain PyTorch ops")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    s.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--system", default=None, help="system prompt")
    o = p.add_argument_group("optimizations")
    o.add_argument("--no-kv-cache", action="store_true", help="naive mode: recompute everything each token")
    o.add_argument("--no-prefix-cache", action="store_true", help="do not reuse cached prompt prefixes")
    o.add_argument("--chunk-size", type=_chunk, default="auto", help="prefill tokens per step: auto (default), N, or 0 = no chunking")
    o.add_argument("--kv-cache-mb", type=_positive_int, default=None, help="KV pool size in MB")
    o.add_argument("--max-batch", type=_positive_int, default=64, help="most requests per step")
    o.add_argument("--spec", choices=["off", "ngram", "draft"], default="off", help="speculative decoding")
    o.add_argument("--draft-model", default=None, help="draft for --spec draft: a model with the same tokenizer, "
                   "or 'self' (default: the target's own weights in int8)")
    o.add_argument("--spec-tokens", type=_positive_int, default=4)
    o.add_argument("--quant", choices=["none", "int8"], default="none", help="weight quantization")
    return p


BACKEND_HELP = ("an OpenAI-compatible server (pdchat serve, vLLM, SGLang, llama.cpp, Ollama) instead of the "
                "local engine; API key from $PDCHAT_API_KEY or $OPENAI_API_KEY")


def build_parser() -> argparse.ArgumentParser:
    shared = _shared_flags()
    parser = argparse.ArgumentParser(
        prog="pdchat", parents=[shared],
        description="Chat with a local LLM and watch prefill, decode, the KV cache and the device live.")
    parser.add_argument("--backend", metavar="URL", default=None, help=BACKEND_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", parents=[shared], help="one turn headless: stream the answer, then a summary")
    run.add_argument("prompt", nargs="?", default=None, help="the prompt ('-' or absent: read stdin)")
    run.add_argument("--json", action="store_true", help="print one JSON object {text, token_ids, finish_reason, metrics}")
    run.add_argument("--backend", metavar="URL", default=None, help=BACKEND_HELP)
    pull = sub.add_parser("pull", help="fetch a model into the cache")
    pull.add_argument("model", nargs="?", default=None)
    sub.add_parser("models", help="list cached models")
    sub.add_parser("info", help="versions, device, GPU, data/config/cache paths")
    bench = sub.add_parser("bench", parents=[shared], help="measure: lab | toggles | baseline | spec | serve")
    bench.add_argument("suite", help="lab (the claims, with curves and verdicts) | toggles | baseline | spec | serve")
    bench.add_argument("--json", action="store_true", help="print machine-readable results")
    bench.add_argument("--quick", action="store_true", help="small sizes (for a smoke test)")
    load = bench.add_argument_group("bench serve (a load test of --backend URL)")
    load.add_argument("--backend", metavar="URL", default=None, help="the OpenAI-compatible server to load")
    load.add_argument("--concurrency", type=_positive_int, default=16, help="clients sending at once (default 16)")
    load.add_argument("--requests", type=_positive_int, default=64, help="requests in all (default 64)")
    load.add_argument("--prompt-words", type=_positive_int, default=64, help="words per prompt (default 64)")
    load.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens (vLLM, SGLang, llama.cpp, pdchat)")
    load.add_argument("--endpoint", choices=["chat", "completions"], default="chat", help="which API to load")
    serve = sub.add_parser("serve", parents=[shared], help="OpenAI-compatible HTTP server (127.0.0.1 by default)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=_positive_int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    serve.add_argument("--max-pending", type=_positive_int, default=256,
                       help="requests admitted at once, running and waiting; more get HTTP 503 (default 256)")
    return parser


def engine_config(args: argparse.Namespace) -> Any:
    from pdchat.engine import DEFAULT_MODEL, EngineConfig
    return EngineConfig(model=args.model or DEFAULT_MODEL, device=args.device, dtype=args.dtype,
                        threads=args.threads, kernels=args.kernels, kv_cache=not args.no_kv_cache,
                        prefix_cache=not args.no_prefix_cache, chunk_size=args.chunk_size,
                        kv_cache_mb=args.kv_cache_mb, max_num_seqs=args.max_batch, quant=args.quant,
                        spec=args.spec, spec_tokens=args.spec_tokens, draft_model=args.draft_model)


def sampling_params(args: argparse.Namespace) -> Any:
    from pdchat.engine import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


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
        stream = engine.submit(prompt, params, system=args.system)
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
    files = resolve(args.model or DEFAULT_MODEL)
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
    serve(engine_config(args), host=args.host, port=args.port, api_key=args.api_key, max_pending=args.max_pending)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pdchat.chatapp.app import run_app
    options = {"model": args.model, "device": args.device, "dtype": args.dtype,
               "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
               "top_k": args.top_k, "seed": args.seed, "system": args.system,
               "kv_cache": not args.no_kv_cache, "prefix_cache": not args.no_prefix_cache,
               "chunk_size": args.chunk_size, "spec": args.spec, "draft_model": args.draft_model,
               "spec_tokens": args.spec_tokens, "quant": args.quant, "backend": args.backend}
    return run_app({k: v for k, v in options.items() if v is not None})


COMMANDS: dict[str | None, Callable[[argparse.Namespace], int]] = {
    None: cmd_chat, "run": cmd_run, "pull": cmd_pull, "models": cmd_models, "info": cmd_info, "bench": cmd_bench,
    "serve": cmd_serve,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
