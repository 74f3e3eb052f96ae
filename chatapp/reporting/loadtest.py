"""`pdchat bench serve`: load-test any OpenAI-compatible server with N clients sending M requests.

Reported as vLLM's serving benchmark (benchmarks/benchmark_serving.py) does, so figures compare:
TTFT, TPOT (per request: (latency - TTFT) / (output tokens - 1), requests of one token left out),
ITL (every gap between streamed chunks, pooled over requests) and E2E latency, each as mean and
p50/p90/p99 (numpy's linear percentiles) over successful requests; request, output-token and total
token throughput over the wall time of the whole run; failed requests are counted, not timed.
"""
from __future__ import annotations

import asyncio
import datetime
import platform
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import numpy as np

from pdchat.chatapp.backends.base import Settings
from pdchat.chatapp.backends.metrics_parsers import parse_metrics
from pdchat.chatapp.backends.openai_client import (TIMEOUT, Endpoint, RemoteError, Reply, SSEDecoder, connect_error, error_message,
                            model_ids, request_body, stream_events)

PERCENTILES = (50, 90, 99)
Progress = Callable[[str, float], None]
# Varied words so prompts tokenize like text, and differ per request so the prefix cache does
# not turn the test into a cache benchmark.
WORDS = ("the system memory cache request token model layer decode prefill batch user answer question "
         "engine block table paper graph kernel fast slow river mountain city light data value number "
         "story history science music garden window morning evening").split()


@dataclass
class LoadSpec:
    endpoint: Endpoint
    model: str | None
    concurrency: int
    requests: int
    max_tokens: int
    temperature: float
    prompt_words: int
    ignore_eos: bool
    chat: bool = True
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None


def make_prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}. Continue this text: " + " ".join(rng.choice(WORDS) for _ in range(words))
            for i in range(n)]


async def _one(client: httpx.AsyncClient, spec: LoadSpec, model: str, prompt: str) -> Reply | str:
    """One streamed request: the Reply, or the error as text."""
    message: str | list[dict[str, str]] = [{"role": "user", "content": prompt}] if spec.chat else prompt
    body = request_body(model, chat=spec.chat, prompt=message, max_tokens=spec.max_tokens,
                        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, min_p=spec.min_p,
                        seed=spec.seed, ignore_eos=spec.ignore_eos)
    url = f"{spec.endpoint.v1}/{'chat/completions' if spec.chat else 'completions'}"
    reply = Reply(time.perf_counter())
    try:
        async with client.stream("POST", url, json=body, headers=spec.endpoint.headers()) as r:
            if r.status_code != 200:
                return error_message(r.status_code, await r.aread())
            sse = SSEDecoder()
            async for chunk in r.aiter_bytes():
                for event in stream_events(sse, chunk):
                    reply.feed(event, time.perf_counter())
    except httpx.HTTPError as e:
        return str(connect_error(spec.endpoint, e))
    except RemoteError as e:
        return str(e)
    reply.t_end = time.perf_counter()
    return reply if reply.finish_reason else "the stream ended without a finish reason"


async def _get(client: httpx.AsyncClient, endpoint: Endpoint, path: str) -> httpx.Response:
    try:
        return await client.get(endpoint.root + path, headers=endpoint.headers())
    except httpx.HTTPError as e:
        raise connect_error(endpoint, e) from None


async def _server_snapshot(client: httpx.AsyncClient, endpoint: Endpoint) -> dict[str, Any]:
    r = await _get(client, endpoint, "/metrics")
    return parse_metrics(r.text if r.status_code == 200 else "")


async def _model(client: httpx.AsyncClient, endpoint: Endpoint, wanted: str | None) -> str:
    r = await _get(client, endpoint, "/v1/models")
    if r.status_code != 200:
        raise RemoteError(f"/v1/models: {error_message(r.status_code, r.content)}")
    if wanted:
        return wanted                  # the server may serve names it does not list (aliases)
    ids = model_ids(endpoint, r.content)
    if not ids:
        raise RemoteError(f"{endpoint.root} lists no models; name one with --model")
    return ids[0]


async def run_load(spec: LoadSpec, progress: Progress) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        model = await _model(client, spec.endpoint, spec.model)
        prompts = make_prompts(spec.requests, spec.prompt_words)
        results: list[Reply | str] = []
        pending = iter(prompts)

        async def client_loop() -> None:
            for prompt in pending:        # one shared iterator: each prompt is sent once
                results.append(await _one(client, spec, model, prompt))
                progress(f"{len(results)}/{spec.requests} requests", len(results) / spec.requests)

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(spec.concurrency)))
        duration = time.perf_counter() - t0
        after = await _server_snapshot(client, spec.endpoint)
    return report(spec, model, results, duration, after)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def report(spec: LoadSpec, model: str, results: list[Reply | str], duration: float,
           server: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in results if isinstance(r, Reply)]
    errors = [r for r in results if isinstance(r, str)]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [(r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1) for r in ok
            if r.output_tokens > 1 and r.ttft_ms is not None and r.e2e_ms is not None]
    itl = [gap for r in ok for gap in r.itl_ms]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    input_tokens = sum((r.usage or {}).get("prompt_tokens") or 0 for r in ok)
    cached = [((r.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") for r in ok]
    output_tokens = sum(r.output_tokens for r in ok)
    rows = [{"metric": name, **_stats(values)} for name, values in
            (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("E2E", e2e))]
    result: dict[str, Any] = {
        "suite": "serve", "model": model, "device": server.get("device") or spec.endpoint.root,
        "machine": _machine(),
        "setup": {"backend": spec.endpoint.root, "server": server.get("server"),
                  "endpoint": "chat" if spec.chat else "completions", "concurrency": spec.concurrency,
                  "requests": spec.requests, "max_tokens": spec.max_tokens, "prompt_words": spec.prompt_words,
                  "temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k, "min_p": spec.min_p,
                  "seed": spec.seed, "ignore_eos": spec.ignore_eos},
        "summary": {"successful_requests": len(ok), "failed_requests": len(errors),
                    "first_error": errors[0] if errors else None, "duration_s": duration,
                    "total_input_tokens": input_tokens,
                    # prefix-cache hits, when the server reports them (usage.prompt_tokens_details)
                    "cached_input_tokens": None if None in cached else sum(cached),
                    "total_output_tokens": output_tokens,
                    "request_throughput_req_s": len(ok) / duration,
                    "output_throughput_tok_s": output_tokens / duration,
                    "total_token_throughput_tok_s": (input_tokens + output_tokens) / duration},
        "latency_ms": {"rows": rows, "itl_samples": len(itl)},
    }
    if server.get("server"):
        result["server_after"] = {k: server.get(k) for k in
                                  ("running", "waiting", "kv_blocks_used", "kv_usage", "prefix_hit_rate")}
    return result


def _machine() -> dict[str, Any]:
    """The client machine (the server may be elsewhere)."""
    info: dict[str, Any] = {"date": datetime.date.today().isoformat(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or None
    return info


def run_from_args(args: Any, progress: Progress) -> dict[str, Any]:
    """`pdchat bench serve`, from the parsed command line."""
    from pdchat.chatapp.cli.flags import SAMPLING_FLAGS, given
    if not args.backend:
        raise RemoteError("bench serve load-tests a server: give --backend URL "
                          "(e.g. start `pdchat serve` and pass --backend http://127.0.0.1:8000)")
    sampling = Settings(**given(args, SAMPLING_FLAGS))       # the flags' defaults, as `pdchat run` has them
    spec = LoadSpec(endpoint=Endpoint.parse(args.backend), model=getattr(args, "model", None),
                    concurrency=args.concurrency, requests=args.requests, max_tokens=sampling.max_tokens,
                    temperature=sampling.temperature, prompt_words=args.prompt_words, ignore_eos=args.ignore_eos,
                    chat=args.endpoint == "chat", top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
                    seed=sampling.seed)
    return asyncio.run(run_load(spec, progress))
