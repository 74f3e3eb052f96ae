"""DeviceMonitor against a fake NVML: real readings pass through, any failure is None, never a guess."""
from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from pdchat.engine import telemetry
from pdchat.engine.telemetry import (DeviceMonitor, DeviceSnapshot, HISTORY_LEN, achieved_bandwidth,
                                     peak_bandwidth)

GIB = 2**30
DEVICE_FIELDS = ("device_name", "device_util_pct", "device_mem_used", "device_mem_total",
                 "device_power_w", "sm_clock_mhz")


class FakeNVMLError(Exception):
    """Stands in for pynvml.NVMLError."""


class FakeNVML:
    """The pynvml functions DeviceMonitor calls; any name listed in `fail` raises FakeNVMLError."""
    NVMLError = FakeNVMLError
    NVML_CLOCK_SM = 1

    def __init__(self, *fail: str, name: str | bytes = "NVIDIA H100 80GB HBM3"):
        self.fail = set(fail)
        self.name = name
        self.calls: list[str] = []

    def _call(self, fn: str) -> None:
        self.calls.append(fn)
        if fn in self.fail:
            raise FakeNVMLError(fn)

    def nvmlInit(self) -> None:
        self._call("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetHandleByPciBusId(self, bus: str) -> str:
        self._call("nvmlDeviceGetHandleByPciBusId")
        return f"handle@{bus}"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self._call("nvmlDeviceGetHandleByIndex")
        return f"handle#{index}"

    def nvmlDeviceGetName(self, handle: str) -> str | bytes:
        self._call("nvmlDeviceGetName")
        return self.name

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        self._call("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        self._call("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(used=30 * GIB, total=80 * GIB, free=50 * GIB)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        self._call("nvmlDeviceGetPowerUsage")
        return 312_500                                  # milliwatts

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        self._call("nvmlDeviceGetClockInfo")
        assert clock == self.NVML_CLOCK_SM
        return 1980


class FakeProcess:
    def __init__(self, rss: int | None = 123 * 2**20):
        self.rss = rss

    def memory_info(self) -> SimpleNamespace:
        if self.rss is None:
            raise ProcessLookupError("gone")
        return SimpleNamespace(rss=self.rss)


@pytest.fixture(autouse=True)
def fake_cpu_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry.psutil, "cpu_percent", lambda interval=None: 42.5)


@pytest.fixture(autouse=True)
def no_cuda_props(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests' CUDA device is imaginary: device index -> NVML goes through CUDA_VISIBLE_DEVICES.
    monkeypatch.setattr(telemetry, "_pci_bus_id", lambda index: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def cuda_monitor(nvml: FakeNVML, device: str = "cuda:0") -> DeviceMonitor:
    return DeviceMonitor(torch.device(device), nvml=nvml, process=FakeProcess())


def test_normal_readings() -> None:
    m = cuda_monitor(FakeNVML())
    m.sample()
    s = m.sample()
    assert s.device_name == "NVIDIA H100 80GB HBM3"
    assert s.device_util_pct == 87.0
    assert s.device_mem_used == 30 * GIB and s.device_mem_total == 80 * GIB
    assert s.device_power_w == pytest.approx(312.5)
    assert s.sm_clock_mhz == 1980.0
    assert s.cpu_util_pct == 42.5
    assert s.rss_bytes == 123 * 2**20
    assert [h.device_util_pct for h in s.history] == [87.0, 87.0]
    assert m.snapshot() is s


def test_name_as_bytes_is_decoded_and_asked_once() -> None:
    nv = FakeNVML(name=b"NVIDIA L4")
    m = cuda_monitor(nv)
    m.sample()
    m.sample()
    assert m.snapshot().device_name == "NVIDIA L4"
    assert nv.calls.count("nvmlDeviceGetName") == 1
    assert nv.calls.count("nvmlInit") == 1


@pytest.mark.parametrize("failing, fields", [
    ("nvmlDeviceGetName", ("device_name",)),
    ("nvmlDeviceGetUtilizationRates", ("device_util_pct",)),
    ("nvmlDeviceGetMemoryInfo", ("device_mem_used", "device_mem_total")),
    ("nvmlDeviceGetPowerUsage", ("device_power_w",)),
    ("nvmlDeviceGetClockInfo", ("sm_clock_mhz",)),
])
def test_one_failing_call_blanks_only_its_fields(failing: str, fields: tuple[str, ...]) -> None:
    good = cuda_monitor(FakeNVML()).sample()
    s = cuda_monitor(FakeNVML(failing)).sample()
    for f in DEVICE_FIELDS:
        if f in fields:
            assert getattr(s, f) is None, f
        else:
            assert getattr(s, f) == getattr(good, f) and getattr(s, f) is not None, f


def test_init_failure_blanks_every_device_field_but_keeps_cpu_figures() -> None:
    nv = FakeNVML("nvmlInit")
    m = cuda_monitor(nv)
    m.sample()
    s = m.sample()
    assert all(getattr(s, f) is None for f in DEVICE_FIELDS)
    assert s.cpu_util_pct == 42.5 and s.rss_bytes == 123 * 2**20
    assert nv.calls == ["nvmlInit"]                  # tried once, not on every sample
    m.stop()
    assert "nvmlShutdown" not in nv.calls           # never started, so never shut down


def test_missing_pynvml_blanks_device_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)    # makes `import pynvml` raise ImportError
    s = DeviceMonitor(torch.device("cuda"), process=FakeProcess()).sample()
    assert all(getattr(s, f) is None for f in DEVICE_FIELDS)
    assert s.rss_bytes == 123 * 2**20


def test_no_handle_blanks_device_fields() -> None:
    s = cuda_monitor(FakeNVML("nvmlDeviceGetHandleByIndex")).sample()
    assert all(getattr(s, f) is None for f in DEVICE_FIELDS)


def test_handle_prefers_pci_bus_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "_pci_bus_id", lambda index: f"0:{index + 0x3b:x}:0.0")
    nv = FakeNVML()
    m = cuda_monitor(nv, "cuda:1")
    m.sample()
    assert m._handle == "handle@0:3c:0.0"
    assert "nvmlDeviceGetHandleByIndex" not in nv.calls


@pytest.mark.parametrize("visible, index, expected", [
    (None, 1, 1), ("", 0, 0), ("2,3", 1, 3), ("2,3", 2, None), ("GPU-1234abcd", 0, None),
])
def test_nvml_index_follows_cuda_visible_devices(visible: str | None, index: int, expected: int | None) -> None:
    assert telemetry._nvml_index(index, visible) == expected


def test_handle_by_index_honours_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    m = cuda_monitor(FakeNVML(), "cuda:1")
    m.sample()
    assert m._handle == "handle#7"


def test_cpu_device_fills_cpu_figures_only() -> None:
    m = DeviceMonitor(torch.device("cpu"), nvml=FakeNVML(), process=FakeProcess(rss=7 * 2**20))
    m.sample()
    s = m.sample()
    assert s.cpu_util_pct == 42.5 and s.rss_bytes == 7 * 2**20
    assert all(getattr(s, f) is None for f in DEVICE_FIELDS if f != "device_name")
    assert s.device_name == telemetry.cpu_model_name()
    assert [h.cpu_util_pct for h in s.history] == [None, 42.5]


def test_first_cpu_reading_is_unknown() -> None:
    # psutil's non-blocking cpu_percent returns a meaningless 0.0 on its first call.
    m = DeviceMonitor(torch.device("cpu"), process=FakeProcess())
    assert m.sample().cpu_util_pct is None
    assert m.sample().cpu_util_pct == 42.5


def test_vanished_process_gives_no_rss() -> None:
    s = DeviceMonitor(torch.device("cpu"), process=FakeProcess(rss=None)).sample()
    assert s.rss_bytes is None


def test_snapshot_before_first_sample_is_all_unknown() -> None:
    s = cuda_monitor(FakeNVML()).snapshot()
    assert s == DeviceSnapshot()


def test_history_is_bounded_and_ordered() -> None:
    m = DeviceMonitor(torch.device("cpu"), process=FakeProcess())
    for _ in range(HISTORY_LEN + 5):
        m.sample()
    h = m.snapshot().history
    assert len(h) == HISTORY_LEN
    assert all(a.t <= b.t for a, b in zip(h, h[1:]))


def test_thread_samples_and_stop_joins() -> None:
    nv = FakeNVML()
    m = DeviceMonitor(torch.device("cuda:0"), interval_s=0.005, nvml=nv, process=FakeProcess())
    sampled = threading.Event()
    real_sample = m.sample

    def sample() -> DeviceSnapshot:
        snap = real_sample()
        if len(snap.history) >= 3:
            sampled.set()
        return snap

    m.sample = sample                                  # type: ignore[method-assign]
    m.start()
    thread = m._thread
    assert thread is not None and thread.daemon
    assert sampled.wait(5)
    m.stop()
    assert not thread.is_alive()
    assert m._thread is None
    assert nv.calls[-1] == "nvmlShutdown"
    assert m.snapshot().device_util_pct == 87.0


def test_achieved_bandwidth() -> None:
    assert achieved_bandwidth(270_000_000, 30_000_000, 100.0) == pytest.approx(3.0e10)
    assert achieved_bandwidth(1, 0, 0.0) == 0.0


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 3.35e12),
    ("NVIDIA H100 PCIe", 2.0e12),
    ("NVIDIA H200", 4.8e12),
    ("NVIDIA A100-SXM4-80GB", 2.0e12),
    ("NVIDIA A100-PCIE-40GB", 1.56e12),
    ("NVIDIA L4", 3.0e11),
    ("NVIDIA L40S", None),
    ("NVIDIA GeForce RTX 4090", 1.0e12),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
    ("AMD EPYC 7B13", None),
    (None, None),
])
def test_peak_bandwidth(name: str | None, peak: float | None) -> None:
    assert peak_bandwidth(name) == peak
