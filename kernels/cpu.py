"""The CPU backend: cpu_kernels.c, compiled once per machine and called through ctypes.

Same functions and semantics as `reference` (tests compare them). Each falls back to its reference
twin outside the cases the C code covers: fp32 only; matrix products for small row counts (decode
batches, speculative verification: where BLAS streams weights slowly and per-op overhead
dominates); attention for decodes, verifies and prefill slices. Past the fast rows (a long
prompt), products and attention go to C or to PyTorch (BLAS, flash SDPA), whichever this machine
runs faster, timed once (cpu_products.chosen_once). Where a batch stays inside the fast rows,
`run_layers` runs every block of the forward in one call (pd_layers), so a decode step crosses
from Python into C once.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from . import reference
from .cpu_attention import CpuAttention
from .cpu_products import WEIGHTS_EXACT_INT8, WEIGHTS_EXACT_Q4, weight_columns, weight_format

SOURCE = Path(__file__).with_name("cpu_kernels.c")
HEADERS = (Path(__file__).with_name("cpu_pool.h"), Path(__file__).with_name("cpu_amx.h"))
# What the code needs whatever it is built for. -fopenmp-simd: the `omp simd` pragmas without the
# OpenMP runtime (threads are the C pool's; macOS's clang has no -fopenmp). -fno-trapping-math: the
# kernels never read floating-point exception flags, and GCC, keeping them exact, would not
# vectorize a loop whose comparisons it must evaluate only on some lanes (exp's clamp, the
# softmax's masks) unless the target has masked vectors (AVX-512): AVX2 and NEON builds took every
# exp one float at a time. The same values but for sums now taken by vectors; an -march=haswell
# build here ran SiLU 5x faster and a 15-token slice's attention over 1,500 keys 25% faster (README).
CODE_FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math")
FLAGS = (*CODE_FLAGS, "-march=native", "-shared", "-fPIC")      # the library for this machine
# GCC's tunings for AMD's Zen cores leave a multiply-add unfused where it chains into a sum in a loop
# ("avoid FMA chains"), and which ones depends on how a loop was unrolled: there the attention's
# one- and two-vector tiles rounded the same row's sums differently (2-core AMD EPYC, Zen 3, GCC 12,
# 2026-12-02: a test of a row's bits whatever its tile failed, in the portable and AVX2 builds).
# Turned off, every product that feeds a sum is fused, as other CPUs' tunings do; 30 layers'
# attention there took 0.97-1.03x the time (slices of 15-31 tokens, decodes; alternating runs).
FMA_CHAIN_TUNINGS = ("avoid_fma_chains", "avoid_fma256_chains", "avoid_fma512_chains")



class KernelsUnavailable(RuntimeError):
    """No C compiler, a failed build, or a platform the kernels do not support."""


@dataclass(frozen=True)
class Int8Path:
    """One way the C int8 product runs (PD_INT8_* in cpu_kernels.c, in the same order)."""
    name: str                   # as the tests and `pdchat info` name it
    title: str
    cpu_flags: tuple[str, ...]  # what /proc/cpuinfo lists on a CPU that runs it


# The build picks the last of these its target supports; a forced build takes an earlier one.
INT8_PATHS = (
    Int8Path("portable", "portable C", ()),
    Int8Path("avx2", "AVX2", ("avx2", "fma")),
    Int8Path("avx-vnni", "AVX-VNNI", ("avx_vnni", "fma")),
    Int8Path("avx512-vnni", "AVX-512 VNNI", ("avx512f", "avx512bw", "avx512_vnni")),
    Int8Path("neon-dot", "NEON dot product", ("asimddp",)),
)


def int8_path(lib: ctypes.CDLL) -> Int8Path:
    """The int8 product a loaded build runs."""
    return INT8_PATHS[lib.pd_int8_path()]


def int8_define(name: str) -> str:
    """The compiler flag that forces int8 path `name` (an INT8_PATHS name)."""
    return f"-DPDCHAT_INT8_PATH={[p.name for p in INT8_PATHS].index(name)}"


def missing_flags(path: Int8Path) -> list[str]:
    """The CPU features path needs that this CPU lacks (none: it can run here)."""
    have = cpu_flags()
    return [f for f in path.cpu_flags if f not in have]


def runnable_int8_paths() -> list[Int8Path]:
    """The int8 paths this CPU can run, the build's choice last."""
    return [p for p in INT8_PATHS if not missing_flags(p)]


def compiler() -> str:
    """The C compiler: $CC, else cc or gcc. Raises KernelsUnavailable when there is none."""
    wanted = os.environ.get("CC")
    found = shutil.which(wanted) if wanted else shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise KernelsUnavailable(f"no C compiler found ({'CC=' + wanted if wanted else 'install gcc, or set CC'})")
    return found


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the OS lists them (empty where it does not say)."""
    line = _cpu_identity()
    return set(line.split(":", 1)[1].split()) if line.startswith(("flags", "Features")) else set()


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's feature flags, where the OS tells them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


@functools.cache
def fused_sums(cc: str) -> tuple[str, ...]:
    """The flag that turns GCC's FMA_CHAIN_TUNINGS off, naming those this compiler knows (each GCC
    release knows some; Clang and non-x86 GCC none: they take no such flag and fuse alike)."""
    known = [name for name in FMA_CHAIN_TUNINGS if _compiles(cc, f"-mtune-ctrl=^{name}")]
    return (f"-mtune-ctrl={','.join('^' + name for name in known)}",) if known else ()


def _compiles(cc: str, flag: str) -> bool:
    """Whether the compiler takes `flag` (an empty C file, compiled and thrown away)."""
    try:
        done = subprocess.run([cc, flag, "-x", "c", "-c", "-", "-o", os.devnull], input="", capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def build(cache_dir: Path, int8: str | None = None) -> Path:
    """Compile the kernels for this machine (once; the file name carries a hash of everything that
    matters). int8: force that int8 path (an INT8_PATHS name) instead of the best one."""
    cc = compiler()
    flags = [*FLAGS, *([int8_define(int8)] if int8 is not None else [])]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelsUnavailable(f"C compiler {cc} does not run: {e}") from e
    sources = [f.read_text() for f in (SOURCE, *HEADERS)]
    # (fused_sums depends on the compiler alone, its version in the key: probed only to compile)
    key = hashlib.sha1("\0".join([*sources, version, *flags, *FMA_CHAIN_TUNINGS, _cpu_identity()]).encode()).hexdigest()
    out = cache_dir / "kernels" / f"cpu_kernels-{key[:16]}.so"
    if out.is_file():
        return out
    flags += fused_sums(cc)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        try:
            done = subprocess.run([cc, *flags, str(SOURCE), "-o", str(partial), "-lm"],
                                  capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelsUnavailable(f"building the CPU kernels failed: {e}") from e
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["no output"]
            first = next((line for line in lines if "error" in line), lines[0])
            raise KernelsUnavailable(f"building the CPU kernels failed: {first}")
        os.replace(partial, out)              # atomic: another process never loads half a file
    return out


_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "pd_int8_path": ([], _I),
    "pd_outer_choose": ([], _I),
    "pd_outer_narrow_48": ([_I], _I),
    "pd_outer_pair_8": ([_I], _I),
    "pd_outer_pad_16": ([_I], _I),
    "pd_row_granule": ([], _I),
    "pd_linear_f32": ([_P, _P, _P, _P, _I, _I, _I, _I], _I),
    "pd_linear_u8": ([_P, _P, _P, _P, _P, _I, _I, _I, _I], _I),
    "pd_exact_int8_blocks": ([_P, _L, _I, _P, _P], _I),
    "pd_linear_exact_int8": ([_P, _P, _P, _P, _P, _I, _I, _I, _I], _I),
    "pd_exact_q4_blocks": ([_P, _L, _I, _P, _P, _I], _I),
    "pd_linear_exact_q4": ([_P, _P, _P, _P, _P, _I, _I, _I, _I], _I),
    "pd_unpack_exact_q4": ([_P, _P, _P, _I, _I, _I], None),
    "pd_exact_panels": ([_I], _I),
    "pd_exact_amx": ([_I], _I),
    "pd_exact_q4_panels": ([_P, _P, _I, _I, _P, _P, _I], _I),
    "pd_exact_int8_panels": ([_P, _P, _I, _I, _P, _P, _I], _I),
    "pd_linear_q4": ([_P, _P, _P, _P, _P, _I, _I, _I, _I], _I),
    "pd_unpack_q4": ([_P, _P, _P, _I, _I, _I], None),
    "pd_unpack_u8": ([_P, _P, _P, _I, _I, _I], None),
    "pd_fast_rows": ([], _I),
    "pd_quant_max_rows": ([_I], _I),
    "pd_u8_dequant_rows": ([], _I),
    "pd_rms_norm": ([_P, _P, _P, _I, _I, _F, _I], None),
    "pd_add_rms_norm": ([_P, _P, _P, _P, _I, _I, _F, _I], None),
    "pd_rope": ([_P, _L, _I, _P, _L, _I, _P, _P, _I, _I, _I], None),
    "pd_silu_mul": ([_P, _P, _I, _I, _I], None),
    "pd_store_kv": ([_P, _L, _P, _L, _P, _P, _P, _I, _I, _I], None),
    "pd_paged_attention": ([_P, _L, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _P, _I], None),
    "pd_pool_counts": ([_P, _P], None),
    "pd_pool_spin": ([_I], None),
    "pd_greedy": ([_P, _P, _I, _I, _I], None),
    "pd_layers": ([_P, _F, _P, _P, _P, _P, _P, _P, _P, _P, _L, _P, _I, _P, _P, _I, _I, _F, _I, _I, _P], _I),
}
PTRS_PER_LAYER = 16        # pd_layers: qkv (weight, scales, bias), q/k norm, o (3), norm, gate_up (3), down (3), norm


@dataclass(frozen=True)
class LayerPlan:
    """All blocks' weights as pd_layers reads them; holds the tensors so the pointers stay valid."""
    dims: ctypes.Array
    eps: float
    ptrs: ctypes.Array
    tensors: tuple[torch.Tensor, ...]
    head_dim: int


@functools.cache   # one shared library per process (the loader caches it anyway)
def library(cache_dir: Path, int8: str | None = None) -> ctypes.CDLL:
    """The kernels' shared library, built for this machine (int8: see build)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        raise KernelsUnavailable(f"no CPU kernels for {platform.machine()}")
    try:
        lib = bind(ctypes.CDLL(str(build(cache_dir, int8))))
    except OSError as e:
        raise KernelsUnavailable(f"loading the CPU kernels failed: {e}") from e
    lib.pd_outer_choose()       # how this CPU takes 17-48 (AVX-512) or 24 rows (12-25 ms; the same sums)
    return lib


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """A build of the kernels with each function's argument and result types set."""
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


class CpuKernels(CpuAttention):
    """The backend's functions bound to one build of the library: its matrix products
    (CpuProducts) and attention (CpuAttention), and the norms, RoPE, SiLU, whole layers and the
    greedy pick, one short method per op of the backend interface (kernels/__init__.py), each
    checking that its tensors suit the C code and falling back to the reference otherwise."""

    def __init__(self, lib: ctypes.CDLL):
        super().__init__(lib)
        self._tile_seconds: float | None = None     # the last forward's (tile_seconds)
        self._tile_clock = ctypes.c_double()        # what pd_layers adds them to (one, not one per step)

    # -- elementwise ---------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or not x.is_contiguous() or not self._ok(x, weight):
            return reference.rms_norm(x, weight, eps)
        out = torch.empty_like(x)
        self.lib.pd_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                             torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2 or not (x.is_contiguous() and delta.is_contiguous()) or not self._ok(x, delta, weight):
            return reference.add_rms_norm(x, delta, weight, eps)
        out = torch.empty_like(x)
        # In place on x: the residual stream is an activation the forward owns.
        self.lib.pd_add_rms_norm(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                 x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return x, out

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self._ok(q, k, cos, sin) and self._rows(q) and self._rows(k)
                and cos.is_contiguous() and sin.is_contiguous()):
            return reference.rope(q, k, cos, sin)
        # In place: q and k are fresh projections (views into the qkv output).
        self.lib.pd_rope(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1],
                         cos.data_ptr(), sin.data_ptr(), q.shape[0], q.shape[2], torch.get_num_threads())
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not (self._ok(gate_up) and gate_up.is_contiguous()):
            return reference.silu_mul(gate_up)
        inter = gate_up.shape[1] // 2
        out = gate_up.new_empty(gate_up.shape[0], inter)
        self.lib.pd_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, torch.get_num_threads())
        return out

    # -- whole layers ----------------------------------------------------------------------------
    def prepare_layers(self, layers: list, num_heads: int, num_kv_heads: int, head_dim: int,
                       eps: float) -> LayerPlan | None:
        """The pointer table of pd_layers (PTRS_PER_LAYER per layer, in model.LayerWeights order), or
        None where the C code does not cover the weights (another dtype, int8 not packed as u8)."""
        # each matrix's stored form (PD_WEIGHTS_*), which may differ between matrices: a model held
        # exactly where its weights have the form and in fp32 elsewhere
        formats: list[int] = []
        for layer in layers:
            for weights in (layer.qkv, layer.o, layer.gate_up, layer.down):
                fmt = weight_format(*weights[:2])
                if fmt is None or fmt in (WEIGHTS_EXACT_INT8, WEIGHTS_EXACT_Q4) \
                        and weights[0].shape[0] != self._layouts(weights[0].shape[1]):   # (not this build's)
                    return None
                formats.append(fmt)
        first = layers[0]
        inter = weight_columns(first.down[0], formats[3])
        dims = (len(layers), first.norm_mlp.shape[0], num_heads, num_kv_heads, head_dim, inter, *formats)
        tensors: list[torch.Tensor] = []
        ptrs: list[int | None] = []
        for layer in layers:
            for part in layer:
                linear = isinstance(part, tuple)      # (weight, scales, bias): forms told above
                for i, t in enumerate(part if linear else (part,)):
                    if t is None:
                        ptrs.append(None)
                        continue
                    if not (t.is_cpu and t.is_contiguous()) or (i == 2 or not linear) and t.dtype != torch.float32:
                        return None
                    tensors.append(t)
                    ptrs.append(t.data_ptr())
        if len(ptrs) != PTRS_PER_LAYER * len(layers):    # the C side reads a fixed table
            raise ValueError(f"pd_layers takes {PTRS_PER_LAYER} tensors per layer, got {len(ptrs) // len(layers)}")
        return LayerPlan((ctypes.c_int * len(dims))(*dims), eps, (ctypes.c_void_p * len(ptrs))(*ptrs),
                         tuple(tensors), head_dim)

    def run_layers(self, plan: LayerPlan | None, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, batch) -> bool:
        """All blocks in one C call for batches whose every op the C kernels take: up to
        fast-rows tokens, attention in C for every sequence (decodes, verifies, slices).

        A forward starts here, so this also sets how the C pool waits between jobs until the next:
        spinning while this one call's kernels follow one another, asleep at once in an op-by-op
        forward, where OpenMP's threads (BLAS, SDPA) take turns with the pool: a spinning worker
        would take a core from them."""
        k_cache, v_cache = batch.k_cache, batch.v_cache
        in_c = (plan is not None and x.shape[0] <= self.fast_rows.limit and plan.head_dim <= 512
                and self._ok(x, h, cos, sin, k_cache, v_cache)
                and all(t.is_contiguous() for t in (x, h, cos, sin, k_cache, v_cache))
                and batch.slot_mapping.dtype == torch.int64
                and all(map(self.attention_in_c, batch.query_lens_host)))
        self.lib.pd_pool_spin(in_c)
        self._tile_seconds = None
        if not in_c:
            return False
        T = x.shape[0]
        tables = batch.block_tables.to(torch.int32).contiguous()
        cu_q = batch.query_start_loc.to(torch.int32).contiguous()
        ctx = batch.context_lens.to(torch.int32).contiguous()
        slots = batch.slot_mapping.contiguous()
        self._tile_clock.value = 0.0
        status = self.lib.pd_layers(plan.dims, plan.eps, plan.ptrs, x.data_ptr(), h.data_ptr(), cos.data_ptr(),
                                    sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                    k_cache.stride(0), tables.data_ptr(), tables.shape[1], cu_q.data_ptr(),
                                    ctx.data_ptr(), len(ctx), k_cache.shape[2], batch.scale, T,
                                    torch.get_num_threads(), ctypes.byref(self._tile_clock))
        if status != 0:
            raise MemoryError("CPU layers: out of memory for the activations")
        self._tile_seconds = self._tile_clock.value
        return True

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """reference.greedy in C: each row's first largest value, NO_TOKEN for a row with a NaN."""
        if not (logits.dim() == 2 and self._ok(logits) and logits.is_contiguous() and logits.shape[1] > 0):
            return reference.greedy(logits)
        out = torch.empty(logits.shape[0], dtype=torch.long)
        self.lib.pd_greedy(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1],
                           torch.get_num_threads())
        return out

    def tile_seconds(self) -> float | None:
        """Seconds the last forward spent in the attention of sequences of several queries (the
        tiles: prefill slices, verifies), as pd_layers times it; None after a forward op by op."""
        return self._tile_seconds
