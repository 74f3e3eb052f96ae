"""The prefill worker: a process of its own, pinned to its own cores, that computes prompts' K/V and
hands them to the decoding engine (link.py). It holds the same model in the same precision and a KV
pool with prefix caching, so a prompt that shares a head with an earlier one computes only the rest.

It takes one prompt at a time, whole: no stream runs here, so nothing needs a prompt cut in slices,
and on a CPU every extra forward re-reads all the weights. It computes every prompt token but the
last: the engine computes that one in its next decode step, which samples the first token, so all
sampling, stop checks and text stay on one side. Messages to the engine (over the control pipe):
  ("ready", notices) · ("started", rid, cached, t) · ("layer", rid, done, layers, t) ·
  ("kv", ...) (link.py) · ("failed", rid, why) · ("fatal", why)
and from it: ("prefill", rid, token ids, namespace) · ("cancel", rid) · ("settings", quant, prefix cache) · ("stop",)
"""
from __future__ import annotations

import sys
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import torch

from ..block_manager import BlockManager
from ..config import EngineConfig, SamplingParams
from ..loader import load, pick_device, pick_dtype
from ..model_runner import ModelRunner, Work
from ..model_source import resolve
from ..output_processor import LAYER_PROGRESS_TOKENS
from ..paths import cache_dir
from ..precision import WeightPrecision, unsupported
from ..resources import kernel_backend, kv_pool_blocks
from ..sequence import Sequence
from .cores import pin_process, threads_for
from .link import KvSender


def log_file() -> str:
    """Where the worker's own output goes (a chat UI owns the terminal)."""
    return str(cache_dir() / "prefill-worker.log")


def main(argv: list[str]) -> None:
    """The worker process (started by coordinator.py as `python -m` this module, with the control
    pipe's and the acknowledgements' descriptors): read the set-up, pin, load, say ready, then
    serve until told to stop or the engine goes away."""
    control = Connection(int(argv[0]))
    config, cores, link = control.recv()
    pin_process(cores)
    torch.set_num_threads(threads_for(cores, config.threads))      # (this thread runs the forwards)
    try:
        worker = PrefillWorker(config, KvSender.connect(link, control, int(argv[1]) if len(argv) > 1 else None),
                               control)
    except Exception as e:
        traceback.print_exc()
        control.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    control.send(("ready", worker.notices))
    try:
        worker.serve()
    except (EOFError, OSError):            # the engine went away
        pass
    except Exception as e:
        traceback.print_exc()
        control.send(("fatal", f"{type(e).__name__}: {e}"))


class PrefillWorker:
    def __init__(self, cfg: EngineConfig, sender: KvSender, control: Connection):
        self.sender, self.control = sender, control
        self.notices: list[str] = []
        self.device = pick_device(cfg.device)
        dtype = pick_dtype(cfg.dtype, self.device)
        ops = kernel_backend(cfg.kernels, self.device, dtype, self.notices)
        files = resolve(cfg.model, lambda msg: print(msg, flush=True))
        quant_mode = cfg.quant if unsupported(cfg.quant, ops, self.device) is None else "none"
        loaded = load(files, self.device, dtype, seed=cfg.seed, ops=ops, quant_mode=quant_mode)
        mc = loaded.config
        max_len = min(cfg.max_model_len or mc.max_position, mc.max_position)
        self.precision = WeightPrecision(loaded, self.device, dtype)
        self.precision.set(cfg.quant, self.notices)
        num_blocks = kv_pool_blocks(cfg, self.device, mc.kv_bytes_per_token(dtype), max_len)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.prefix_cache)
        self.runner = ModelRunner(loaded.model, mc, self.device, dtype, num_blocks, cfg.block_size, max_len)
        self.layers = mc.num_layers if self.device.type == "cpu" else 0
        self.queue: deque[tuple[str, list[int], Any]] = deque()

    def serve(self) -> None:
        while True:
            # Block for the next message when idle; between prompts take every message waiting
            # (a cancel of a queued prompt, a settings change) before starting the next one.
            while not self.queue or self.control.poll():
                if not self._handle(self.control.recv()):
                    return
            self._prefill(*self.queue.popleft())

    def _handle(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "prefill":
            self.queue.append(message[1:])
        elif kind == "cancel":
            self.queue = deque(q for q in self.queue if q[0] != message[1])
        elif kind == "settings":
            _, quant, prefix_cache = message
            if quant != self.precision.mode:
                self.precision.set(quant, self.notices)
                self.blocks.set_prefix_cache(False)   # K/V of other weights must not be reused
            self.blocks.set_prefix_cache(prefix_cache)
        return kind != "stop"

    @torch.inference_mode()
    def _prefill(self, request_id: str, token_ids: list[int], namespace: Any) -> None:
        seq = Sequence(request_id, token_ids, SamplingParams(max_tokens=1), namespace=namespace)
        n = len(token_ids) - 1                     # the engine computes the last one
        try:
            seq.num_computed_tokens = cached = self.blocks.match_prefix(seq)
            self.control.send(("started", request_id, cached, time.perf_counter()))
            if not self.blocks.ensure_capacity(seq, n):
                raise RuntimeError(f"the prefill worker's KV pool cannot hold {n} tokens")
            if n > cached:
                self.runner.forward([Work(token_ids[cached:n], cached, seq.block_table)], [[]],
                                    self._on_layer(request_id, n - cached))
            self.blocks.commit(seq, n)
            t_done = time.perf_counter()             # the hand-off starts: reading K/V into the link's area
            k = self.runner.k_cache
            kv = self.runner.read_kv(seq.block_table, n, self.sender.area((2, k.shape[0], n, *k.shape[3:]), k.dtype))
            self.sender.send(request_id, kv, cached, t_done)
        except (EOFError, OSError):
            raise
        except Exception as e:                     # this prompt fails, the worker goes on
            traceback.print_exc()
            self.control.send(("failed", request_id, f"prefill worker: {type(e).__name__}: {e}"))
        finally:
            self.blocks.free_seq(seq)

    def _on_layer(self, request_id: str, tokens: int):
        if not self.layers or tokens < LAYER_PROGRESS_TOKENS:
            return None
        return lambda done: self.control.send(("layer", request_id, done, self.layers, time.perf_counter()))


if __name__ == "__main__":
    main(sys.argv[1:])
