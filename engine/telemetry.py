"""Device telemetry: GPU (NVML) and CPU/process figures, sampled on a side thread.

Every field is a real reading or None: an NVML call that fails leaves its own field None and the
others untouched; without NVML (or on a CPU device) all device_* fields are None. The CPU figures
(machine-wide cpu_util_pct, this process's process_cpu_pct and rss_bytes) are filled on every device.

An idle process is sampled less often (idle_interval_s): its figures barely move, and an idle app
should cost about no CPU, the sampler's included.
"""
from __future__ import annotations

import os
import platform
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Callable, NamedTuple, TypeVar

import psutil
import torch

HISTORY_LEN = 64          # ~16 s at 4 Hz (~64 s idle): enough for a sparkline, small to copy
IDLE_CORE_PCT = 5.0       # this process below this share of one core counts as idle

T = TypeVar("T")


class Sample(NamedTuple):
    """One history point; utilizations in percent, None where unmeasured."""
    t: float                       # time.monotonic()
    device_util_pct: float | None
    cpu_util_pct: float | None


@dataclass(frozen=True)
class DeviceSnapshot:
    device_name: str | None = None
    device_util_pct: float | None = None
    device_mem_used: int | None = None      # bytes
    device_mem_total: int | None = None     # bytes
    device_power_w: float | None = None
    sm_clock_mhz: float | None = None
    cpu_util_pct: float | None = None       # whole machine, % of all its logical CPUs
    process_cpu_pct: float | None = None    # this process (all threads), on the same scale
    rss_bytes: int | None = None            # this process
    history: tuple[Sample, ...] = ()        # oldest first, at most HISTORY_LEN


def _try(fn: Callable[[], T]) -> T | None:
    # Telemetry must never kill its thread nor guess: whatever a driver or psutil raises (NVMLError,
    # a bad decode, a vanished process) turns that one reading into "unknown".
    try:
        return fn()
    except Exception:
        return None


def cpu_model_name() -> str | None:
    """The CPU's marketing name, from /proc/cpuinfo where there is one, else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def _pci_bus_id(index: int) -> str | None:
    """The CUDA device's PCI address in NVML's format; None where torch cannot say."""
    try:
        p = torch.cuda.get_device_properties(index)
        return f"{p.pci_domain_id:x}:{p.pci_bus_id:x}:{p.pci_device_id:x}.0"
    except Exception:
        return None


def _nvml_index(index: int, visible: str | None) -> int | None:
    """NVML enumerates every GPU, CUDA only the visible ones: map through CUDA_VISIBLE_DEVICES."""
    if not visible:
        return index
    entries = [e.strip() for e in visible.split(",")]
    if index >= len(entries) or not entries[index].isdigit():
        return None                # a UUID or MIG entry: no safe guess
    return int(entries[index])


class ProcessFamily:
    """This process and the ones it started (a prefill worker, with --disaggregate) as one, with
    psutil.Process's cpu_percent contract (% of one core since the previous call; the first call
    starts the clock) and this process's own memory_info. A worker is pdchat's own load, not
    another program's: the panel's "machine busy" and the lab's noise check must not count it."""

    def __init__(self, process: psutil.Process | None = None):
        self.process = process or psutil.Process()
        self._last: tuple[float, float] | None = None

    def memory_info(self) -> Any:
        return self.process.memory_info()

    def cpu_percent(self, interval: float | None = None) -> float:
        now, seconds = time.monotonic(), self._cpu_seconds()
        last, self._last = self._last, (now, seconds)
        if last is None or now <= last[0]:
            return 0.0
        return max(0.0, seconds - last[1]) / (now - last[0]) * 100

    def _cpu_seconds(self) -> float:
        t = self.process.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system     # (children that ended)
        for child in self.process.children(recursive=True):
            try:
                c = child.cpu_times()
                total += c.user + c.system
            except psutil.Error:            # ended meanwhile: counted once it is waited for
                pass
        return total


class DeviceMonitor:
    """Samples `device` every `interval_s` seconds (`idle_interval_s` while this process idles) on a
    daemon thread; snapshot() is lock-free."""

    def __init__(self, device: torch.device, interval_s: float = 0.25, nvml: ModuleType | Any | None = None,
                 process: Any = None, idle_interval_s: float = 1.0):
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s
        self._nvml = nvml
        self._process = process or ProcessFamily()
        self._handle: Any = None
        self._nvml_ready: bool | None = None      # None: not tried yet; init happens on first sample
        self._cpu_primed = False
        self._cpus = psutil.cpu_count() or None
        self._idle = False                        # this process used under IDLE_CORE_PCT last time
        self._history: deque[Sample] = deque(maxlen=HISTORY_LEN)
        name = cpu_model_name() if self.device.type == "cpu" else None
        self._latest = DeviceSnapshot(device_name=name)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pdchat-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 4 * self.interval_s))
            self._thread = None
        if self._nvml_ready:
            _try(self._nvml.nvmlShutdown)
            self._nvml_ready = None
            self._handle = None

    def snapshot(self) -> DeviceSnapshot:
        """The latest sample (all None before the first one); safe from any thread."""
        return self._latest

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.idle_interval_s if self._idle else self.interval_s):
                return

    # ---- one reading ------------------------------------------------------------------------
    def sample(self) -> DeviceSnapshot:
        """Take one reading now, store it as the latest snapshot and return it."""
        snap = self._read_device()
        cpu = psutil.cpu_percent(interval=None)
        own = _try(lambda: self._process.cpu_percent(interval=None))     # % of one core
        # psutil's non-blocking forms measure since their previous call; the first call has no
        # previous one and returns a meaningless 0.0.
        primed, self._cpu_primed = self._cpu_primed, True
        cpu_util = float(cpu) if primed else None
        own_pct = own / self._cpus if primed and own is not None and self._cpus else None
        self._idle = own is not None and primed and own < IDLE_CORE_PCT
        snap = replace(snap, cpu_util_pct=cpu_util, process_cpu_pct=own_pct,
                       rss_bytes=_try(lambda: self._process.memory_info().rss))
        self._history.append(Sample(time.monotonic(), snap.device_util_pct, cpu_util))
        self._latest = replace(snap, history=tuple(self._history))
        return self._latest

    def _read_device(self) -> DeviceSnapshot:
        if self.device.type != "cuda":
            return DeviceSnapshot(device_name=self._latest.device_name)
        nv = self._init_nvml()
        h = self._handle
        if nv is None or h is None:
            return DeviceSnapshot()
        mem = _try(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        power_mw = _try(lambda: nv.nvmlDeviceGetPowerUsage(h))
        clock = _try(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        util = _try(lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu)
        return DeviceSnapshot(
            device_name=self._device_name(nv, h),
            device_util_pct=None if util is None else float(util),
            device_mem_used=None if mem is None else int(mem.used),
            device_mem_total=None if mem is None else int(mem.total),
            device_power_w=None if power_mw is None else power_mw / 1000.0,
            sm_clock_mhz=None if clock is None else float(clock),
        )

    def _device_name(self, nv: Any, h: Any) -> str | None:
        if self._latest.device_name is None:
            name = _try(lambda: nv.nvmlDeviceGetName(h))
            return name.decode() if isinstance(name, bytes) else name
        return self._latest.device_name         # a GPU's name does not change: ask once

    def _init_nvml(self) -> Any:
        """NVML module with self._handle set, or None when NVML is missing or fails to start."""
        if self._nvml_ready is None:
            self._nvml_ready = False
            if self._nvml is None:
                try:
                    import pynvml                  # the nvidia-ml-py distribution
                except ImportError:
                    return None
                self._nvml = pynvml
            nv = self._nvml
            try:
                nv.nvmlInit()
            except Exception:
                return None
            self._nvml_ready = True
            self._handle = self._find_handle(nv)
        return self._nvml if self._nvml_ready else None

    def _find_handle(self, nv: Any) -> Any:
        index = self.device.index if self.device.index is not None else _try(torch.cuda.current_device) or 0
        bus = _pci_bus_id(index)
        if bus is not None:
            handle = _try(lambda: nv.nvmlDeviceGetHandleByPciBusId(bus))
            if handle is not None:
                return handle
        nvml_index = _nvml_index(index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        return None if nvml_index is None else _try(lambda: nv.nvmlDeviceGetHandleByIndex(nvml_index))


def achieved_bandwidth(weight_bytes: int, kv_bytes_read: int, steps_per_s: float) -> float:
    """Memory traffic a decode step implies, in bytes/s: every weight and the KV read once per step."""
    return float(weight_bytes + kv_bytes_read) * steps_per_s


# Datasheet peak memory bandwidths (bytes/s), matched against NVML/torch device names in order.
_PEAK_BANDWIDTH: tuple[tuple[re.Pattern[str], float], ...] = tuple(
    (re.compile(p), bw) for p, bw in (
        (r"H100.*PCIE", 2.0e12),
        (r"H100.*(SXM|HBM3)", 3.35e12),      # NVML calls the SXM part "NVIDIA H100 80GB HBM3"
        (r"H200", 4.8e12),
        (r"A100.*80GB", 2.0e12),
        (r"A100.*40GB", 1.56e12),
        (r"\bL4\b", 3.0e11),                 # not L40 / L40S
        (r"RTX 4090(?!.*LAPTOP)", 1.0e12),   # the laptop part has about half
    ))


def peak_bandwidth(device_name: str | None) -> float | None:
    """Peak memory bandwidth in bytes/s for a known device name, else None."""
    if not device_name:
        return None
    name = device_name.upper()
    return next((bw for pattern, bw in _PEAK_BANDWIDTH if pattern.search(name)), None)
