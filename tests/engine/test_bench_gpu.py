"""`pdchat bench gpu`'s parts that need no GPU: the profile of a decode step read into rows, and
the refusal where there is no GPU (its measurements run under `make gpu-check`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdchat.bench import gpu
from pdchat.engine import EngineConfig
from pdchat.engine.errors import InvalidRequest


def test_a_steps_kernels_come_out_by_device_time_per_step() -> None:
    def avg(key: str, count: int, device_us: float) -> SimpleNamespace:
        return SimpleNamespace(key=key, count=count, device_time_total=device_us)
    averages = [avg("_matvec_kernel", 650, 8201.0), avg("cudaGraphLaunch", 10, 0.0),
                avg("_decode_split_kernel", 160, 555.8), avg("_rope_store_kernel" + "x" * 80, 160, 270.4),
                avg("Memcpy DtoD", 10, 15.8)]
    rows = gpu.kernel_rows(averages, replays=10, top=3)
    long_name = ("_rope_store_kernel" + "x" * 80)[:60]
    assert [r["kernel"] for r in rows] == ["_matvec_kernel", "_decode_split_kernel", long_name]
    assert rows[0]["per_step"] == 65 and rows[0]["us_per_step"] == pytest.approx(820.1)
    assert all(r["us_per_step"] > 0 for r in gpu.kernel_rows(averages, replays=10, top=10))   # host calls left out


def test_without_a_gpu_the_suite_says_so(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)     # (a GPU machine checks it too)
    with pytest.raises(InvalidRequest, match="CUDA GPU"):
        next(gpu.parts(EngineConfig(model="random:tiny"), quick=True, progress=lambda *a: None))
