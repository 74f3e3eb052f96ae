"""llama.cpp as an optional peer in `pdchat bench baseline`: our int4 decode against its Q4_0.

Why: Hugging Face `generate()` is a low bar on CPU; llama.cpp is what people actually run models
with there. The peer runs the *same weights* as ours, quantized to Q4_0 by llama.cpp's own
quantizer (gguf_export.py: the default model's source GGUF requantized, a random model exported),
with the same thread count, on the same prompt token ids, so its tok/s sit next to ours in one
table.

Why a child process: in one process llama.cpp's OpenMP build shares torch's `libgomp.so.1`, and
once pdchat's engine thread has its own OpenMP team, libgomp throttles spin-waiting (more threads
than cores), so every ggml barrier sleeps in the kernel and llama.cpp runs at about half its
speed. Measured alone, as its users run it, it is not handicapped. Each measurement is timed
inside the child; the parent only asks for it, so the peer still takes turns with ours.

Optional: `llama-cpp-python` (`pip install 'pdchat[peer]'`, a from-source C++ build) is not a
dependency. When it is not importable (`missing`), llama.cpp rejects the file (`open_peer`), or
no file can be made for the model (gguf_export.ExportUnavailable), the bench gets a reason
instead and runs without the peer. This file is also the child's script (stdlib imports
only at the top, so it runs without the pdchat package).
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

GOAL = ">= 1.0x (int4 decode vs Q4_0)"
INSTALL_HINT = "pip install 'pdchat[peer]' (llama-cpp-python)"
STARVED = 0.8      # llama.cpp's spin barriers collapse when it gets fewer cores than threads


class Rate(NamedTuple):
    tok_s: float
    cores: float       # CPU seconds / wall seconds of the child while timed: ~threads when it had the machine


class LlamaCppPeer:
    """llama.cpp on one GGUF in a child process, spoken to in JSON lines."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        self.gguf, self.threads = gguf, threads
        self._log = tempfile.TemporaryFile()         # the child's stderr: llama.cpp must not tear the UI
        # -P: the script's folder (bench/: spec.py, svg_plot.py, …) must not shadow top-level modules.
        self._proc = subprocess.Popen([sys.executable, "-P", __file__], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True)
        try:
            info = self._call(op="load", gguf=str(gguf), threads=threads, n_ctx=n_ctx)
        except Exception:
            self.close()
            raise
        self.version: str = info["version"]
        self.gguf_type: str | None = _file_type_name(info["file_type"])

    def decode(self, prompt: list[int], tokens: int) -> Rate:
        """Batch-1 greedy decode speed: `tokens` steps after the first token, never stopping at EOS."""
        return Rate(*self._call(op="decode", prompt=prompt, tokens=tokens))

    def prefill(self, prompt: list[int]) -> Rate:
        """Prompt tokens per second of time to first token (evaluate the prompt, sample one token)."""
        return Rate(*self._call(op="prefill", prompt=prompt))

    def greedy(self, prompt: list[int], tokens: int) -> list[int]:
        """The first `tokens` greedy token ids (for warm-up and checks, not timing)."""
        return self._call(op="greedy", prompt=prompt, tokens=tokens)

    def tokenize(self, text: str) -> list[int]:
        return self._call(op="tokenize", text=text)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()                 # end of input: the child exits
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc.stdout.close()
        self._log.close()

    def _call(self, **msg: Any) -> Any:
        try:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except OSError:
            line = ""
        if not line:
            self._log.seek(0)
            tail = self._log.read().decode(errors="replace").strip()[-600:]
            raise RuntimeError(f"the llama.cpp process exited (code {self._proc.poll()}): {tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["value"]


def missing() -> str | None:
    """Why llama.cpp cannot run here (llama-cpp-python not importable), or None."""
    try:
        importlib.import_module("llama_cpp")     # installed, and its library loads (the child uses it)
    except (ImportError, OSError, RuntimeError) as e:
        return f"llama-cpp-python is not installed ({e}); {INSTALL_HINT}"
    return None


def open_peer(gguf: Path, *, threads: int, n_ctx: int = 2048) -> tuple[LlamaCppPeer | None, str | None]:
    """(peer, None) when llama.cpp runs `gguf` here, else (None, why not)."""
    reason = missing()
    if reason is not None:
        return None, reason
    try:
        return LlamaCppPeer(gguf, threads, n_ctx), None
    except Exception as e:  # llama.cpp rejects the file (an architecture it does not know, a bad file)
        return None, f"llama.cpp could not load {gguf}: {e}"


def section(peer: LlamaCppPeer | None, reason: str | None, decode: list[Rate], prefill: list[Rate], *,
            ours_decode: dict[str, list[float]], ours_prefill: list[float]) -> dict[str, Any]:
    """The "llamacpp" section of the baseline result: medians of the peer's runs and our ratios to
    them, each the median of the rounds' ratios (ours_decode: tok/s per round by weight precision,
    e.g. float32, int8, int4; ours_prefill: fp32 prefill tok/s per round; round i of each list ran
    beside the peer's round i).

    If llama.cpp did not get its cores while decoding (another process was busy), its tok/s are
    still reported but no verdict is given: it degrades far worse than torch under contention."""
    from pdchat.bench import median, paired_ratio
    pd = median([r.tok_s for r in decode]) if peer and decode else None
    pp = median([r.tok_s for r in prefill]) if peer and prefill else None
    cores = median([r.cores for r in decode]) if peer and decode else None
    peer_decode = [r.tok_s for r in decode] if peer else []
    ratios = {f"pdchat_{name}_decode_ratio": paired_ratio(tok_s, peer_decode) for name, tok_s in ours_decode.items()}
    r4 = ratios.get("pdchat_int4_decode_ratio")
    if cores is not None and cores < STARVED * peer.threads:
        reason = (f"llama.cpp got {cores:.2f} of its {peer.threads} threads' cores while decoding: another "
                  f"process was busy, so no verdict (rerun on a quiet machine)")
    return {
        "version": peer.version if peer else None, "gguf": str(peer.gguf) if peer else None,
        "gguf_type": peer.gguf_type if peer else None, "threads": peer.threads if peer else None,
        "llamacpp_decode_tok_s": pd, "llamacpp_prefill_tok_s": pp, "llamacpp_decode_cores_busy": cores,
        **ratios, "pdchat_prefill_ratio": paired_ratio(ours_prefill, [r.tok_s for r in prefill] if peer else []),
        "goal": GOAL, "met": None if r4 is None or reason else r4 >= 1.0,
        "reason": reason,
    }


def _file_type_name(value: Any) -> str | None:
    """The GGUF's weight type by name (e.g. MOSTLY_Q4_1) from its `general.file_type`."""
    if value is None:
        return None
    try:
        from gguf import LlamaFileType
        return LlamaFileType(int(value)).name
    except (ImportError, ValueError):
        return str(value)


# ---- the child process ---------------------------------------------------------------------------

def _generate(llm: Any, prompt: list[int]) -> Any:
    llm.reset()                                      # no KV reuse from the previous call
    return llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=False)


def _decode(llm: Any, prompt: list[int], tokens: int) -> tuple[float, float]:
    gen = _generate(llm, prompt)
    next(gen)                                        # prefill + first token (not counted, as for pdchat)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(tokens):
        next(gen)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    gen.close()
    return tokens / dt, dc / dt


def _prefill(llm: Any, prompt: list[int]) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    gen = _generate(llm, prompt)
    next(gen)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    gen.close()
    return len(prompt) / dt, dc / dt


def _greedy(llm: Any, prompt: list[int], tokens: int) -> list[int]:
    gen = _generate(llm, prompt)
    out = [next(gen) for _ in range(tokens)]
    gen.close()
    return out


def _serve() -> None:
    """Answer one JSON request per line on stdin until it closes."""
    reply_to = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                                    # anything llama.cpp prints goes to the log
    import llama_cpp
    llm = None
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        try:
            if op == "load":
                llm = llama_cpp.Llama(model_path=msg["gguf"], n_threads=msg["threads"],
                                      n_threads_batch=msg["threads"], n_ctx=msg["n_ctx"], verbose=False)
                value: Any = {"version": llama_cpp.__version__,
                              "file_type": llm.metadata.get("general.file_type")}
            elif op == "decode":
                value = _decode(llm, msg["prompt"], msg["tokens"])
            elif op == "prefill":
                value = _prefill(llm, msg["prompt"])
            elif op == "greedy":
                value = _greedy(llm, msg["prompt"], msg["tokens"])
            elif op == "tokenize":
                value = llm.tokenize(msg["text"].encode(), add_bos=False, special=False)
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"value": value}
        except Exception as e:
            reply = {"error": f"{op}: {type(e).__name__}: {e}"}
        reply_to.write(json.dumps(reply) + "\n")
        reply_to.flush()
    if llm is not None:
        llm.close()


if __name__ == "__main__":
    _serve()
