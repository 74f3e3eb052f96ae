"""This process's own CPU beside the machine's, and the sampler slowing down while the process idles."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from pdchat.chatapp.backends.local import LocalBackend
from pdchat.engine import Engine
from pdchat.engine import telemetry
from pdchat.engine.telemetry import IDLE_CORE_PCT, DeviceMonitor, DeviceSnapshot


class FakeProcess:
    """psutil.Process's two calls; cpu_percent is % of one core, as psutil's; None makes it fail."""

    def __init__(self, core_pct: float | None):
        self.core_pct = core_pct

    def cpu_percent(self, interval: float | None = None) -> float:
        if self.core_pct is None:
            raise ProcessLookupError("gone")
        return self.core_pct

    def memory_info(self) -> SimpleNamespace:
        return SimpleNamespace(rss=50 * 2**20)


@pytest.fixture(autouse=True)
def four_cpus_at_90(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry.psutil, "cpu_percent", lambda interval=None: 90.0)
    monkeypatch.setattr(telemetry.psutil, "cpu_count", lambda logical=True: 4)


def monitor(core_pct: float | None, **kw) -> DeviceMonitor:
    return DeviceMonitor(torch.device("cpu"), process=FakeProcess(core_pct), **kw)


def test_process_cpu_is_a_share_of_the_whole_machine() -> None:
    m = monitor(150.0)                       # 1.5 cores busy of 4
    first = m.sample()
    assert first.process_cpu_pct is None and first.cpu_util_pct is None   # psutil's first call means nothing
    s = m.sample()
    assert s.process_cpu_pct == pytest.approx(37.5)
    assert s.cpu_util_pct == 90.0            # the same scale: the others use 52.5%


def test_a_failing_process_reading_is_unknown() -> None:
    m = monitor(None)
    m.sample()
    s = m.sample()
    assert s.process_cpu_pct is None and s.cpu_util_pct == 90.0 and s.rss_bytes == 50 * 2**20


class CountingStop:
    """Stands in for the stop event: records each wait and stops the loop after `n` of them."""

    def __init__(self, n: int):
        self.n = n
        self.waits: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return len(self.waits) >= self.n


@pytest.mark.parametrize("core_pct, second_wait", [
    (IDLE_CORE_PCT / 2, 2.0),                # idle: the slow pace
    (IDLE_CORE_PCT * 4, 0.5),                # working: the fast one
    (None, 0.5),                             # unknown: no reason to slow down
])
def test_sampler_slows_down_while_the_process_idles(core_pct: float | None, second_wait: float) -> None:
    m = monitor(core_pct, interval_s=0.5, idle_interval_s=2.0)
    m._stop = CountingStop(2)                # type: ignore[assignment]
    m._run()
    # the first reading has nothing to compare with, so the sampler starts at the fast pace
    assert m._stop.waits == [0.5, second_wait]


class StubMonitor:
    def __init__(self, snap: DeviceSnapshot):
        self.snap = snap

    def snapshot(self) -> DeviceSnapshot:
        return self.snap

    def stop(self) -> None:
        pass


def test_engine_stats_and_the_local_backend_carry_the_process_cpu() -> None:
    engine = Engine(model="random:tiny", device="cpu", telemetry=False, kv_cache_mb=4)
    try:
        engine.monitor = StubMonitor(DeviceSnapshot(cpu_util_pct=88.0, process_cpu_pct=12.5, rss_bytes=7))
        assert (engine.stats().cpu_util_pct, engine.stats().process_cpu_pct) == (88.0, 12.5)
        backend = LocalBackend("random:tiny")
        backend.engine = engine
        stats = backend.stats()
        assert (stats["cpu_util_pct"], stats["process_cpu_pct"], stats["rss_bytes"]) == (88.0, 12.5, 7)
    finally:
        engine.close()


def test_the_process_family_counts_a_child_process_as_its_own():
    """A prefill worker (a child process) busy on a core is pdchat's load: the family's CPU time
    since the last reading covers the child's, where this process's own does not."""
    import subprocess
    import sys
    import time

    import psutil

    from pdchat.engine.telemetry import ProcessFamily
    family, alone = ProcessFamily(), psutil.Process()
    family_before, own = family._cpu_seconds(), alone.cpu_times()
    own_before = own.user + own.system
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    try:
        burner = psutil.Process(child.pid)
        while sum(burner.cpu_times()[:2]) < 0.3:           # until the child has used 0.3 s of CPU
            time.sleep(0.05)
        child_s = sum(burner.cpu_times()[:2])
        own = alone.cpu_times()
        tick = 2 / os.sysconf("SC_CLK_TCK")                 # CPU times come in clock ticks
        assert family._cpu_seconds() - family_before >= child_s - tick
        assert own.user + own.system - own_before < child_s / 2
    finally:
        child.kill()
        child.wait()
