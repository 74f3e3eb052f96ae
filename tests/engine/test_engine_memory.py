"""Closing an engine gives its memory back to the operating system, so a chat session that
switches models (or loads a draft) again and again stays the size of one model."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pdchat.engine import Engine, SamplingParams
from pdchat.engine.random_models import PRESETS

# ~115 MB of fp32 weights: the layers' tensors (1-3 MB) live in glibc's heap, which keeps freed
# pages unless asked; the two 32 MB vocabulary matrices are mappings of their own.
MID = {**PRESETS["tiny"], "vocab_size": 16384, "hidden_size": 512, "intermediate_size": 1536,
       "num_hidden_layers": 4}
CYCLES = 4


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def load_answer_close(**options) -> int:
    """One model switch as the chat app does it: load on another thread, answer, close, drop.
    Returns the weights' size in bytes."""
    loaded: list[Engine] = []
    loader = threading.Thread(target=lambda: loaded.append(
        Engine(model="random:mid", device="cpu", telemetry=False, kv_cache_mb=32, **options)))
    loader.start()
    loader.join()
    engine = loaded.pop()
    size = engine.loaded.model.weight_bytes()
    done = engine.submit("hello there", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)).result(60)
    assert len(done.token_ids) == 8                # the KV pool and the step's buffers were used too
    engine.close()
    return size


def cycles(options: dict) -> tuple[int, list[int]]:
    """The weights' size, and how far RSS grew past the first cycle after each later one."""
    PRESETS["mid"] = MID
    size = load_answer_close(**options)        # the first pays one-time costs (kernels, pools, caches)
    gc.collect()
    base = rss()
    after = []
    for _ in range(CYCLES):
        load_answer_close(**options)
        gc.collect()
        after.append(rss() - base)
    return size, after


@pytest.mark.parametrize("options", [{}, {"spec": "draft"}], ids=["model", "model and draft"])
def test_closed_engines_give_their_memory_back(options):
    # In a fresh interpreter: what hundreds of earlier tests left in this process's heap must not
    # decide the figure.
    code = f"import json; from tests.engine.test_engine_memory import cycles; print(json.dumps(cycles({options!r})))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    size, after = json.loads(proc.stdout.strip().splitlines()[-1])
    # Without the release each cycle keeps a whole model (4 cycles: 4 x size). With it, glibc still
    # holds on to freed memory in the arenas of the threads that loaded (a new one each cycle): on
    # the 2-core AMD EPYC 0-32 MB on 1 of 4 runs; on the 2-core Intel Xeon 19-57 MB by the fourth
    # cycle, 6 runs of the code of 2026-11-26 and 45-54 MB for 6 runs of the code before that day's
    # changes (the 112 MB model here). So the bound is one model: a model kept per cycle, or half
    # of one, still ends far above it.
    assert max(after) < size, (f"after each load/close the process had grown by "
                               f"{[round(a / 2**20) for a in after]} MB (one model: {size / 2**20:.0f} MB)")


def test_stats_say_what_the_model_holds_in_each_precision():
    with Engine(model="random:tiny", device="cpu", telemetry=False) as engine:
        model = engine.precision.loaded.model
        params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        buffers = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()}
        full = sum({**params, **buffers}.values())
        assert engine.stats().model_bytes == full > 0
        norms = sum(p.numel() * 4 for name, p in model.named_parameters() if "norm" in name)
        for mode in ("int8", "int4"):
            engine.update(quant=mode)
            held = sum(q.weight.numel() * q.weight.element_size() + q.scales.numel() * q.scales.element_size()
                       for m in model.modules() for q in getattr(m, "quantized", {}).values())
            # Quantized matrices, the norms, inv_freq: nothing in full precision beside them.
            assert engine.stats().model_bytes == held + norms + model.inv_freq.nbytes
            assert held < full / (3 if mode == "int8" else 4)
        engine.update(quant="none")
        assert engine.stats().model_bytes == full                # the quantized weights are gone
