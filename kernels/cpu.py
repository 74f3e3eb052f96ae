"""The CPU backend: cpu_kernels.c, compiled once per machine and called through ctypes.

Same functions and semantics as `reference` (tests compare them). Each falls back to its reference
twin outside the cases the C code covers: fp32 only; matrix products for small row counts (decode
batches, speculative verification: where BLAS streams weights slowly and per-op overhead
dominates); attention for decodes, verifies and short contexts (the rest goes to PyTorch's
flash SDPA). Where a batch stays inside all of these, `run_layers` runs every block of the
forward in one call (pd_layers), so a decode step crosses from Python into C once.
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
from typing import Callable
from pathlib import Path

import torch

from . import FastRows, reference

SOURCE = Path(__file__).with_name("cpu_kernels.c")
HEADERS = (Path(__file__).with_name("cpu_pool.h"),)
# What the code needs whatever it is built for. -fopenmp-simd: the `omp simd` pragmas without the
# OpenMP runtime (threads are the C pool's; macOS's clang has no -fopenmp). -fno-trapping-math: the
# kernels never read floating-point exception flags, and GCC, keeping them exact, would not
# vectorize a loop whose comparisons it must evaluate only on some lanes (exp's clamp, the
# softmax's masks) unless the target has masked vectors (AVX-512): AVX2 and NEON builds took every
# exp one float at a time. The same values but for sums now taken by vectors; an -march=haswell
# build here ran SiLU 5x faster and a 15-token slice's attention over 1,500 keys 25% faster (README).
CODE_FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math")
FLAGS = (*CODE_FLAGS, "-march=native", "-shared", "-fPIC")      # the library for this machine
# Up to a build's fast rows (pd_fast_rows: 48 with AVX-512, 144 on other x86 builds with AVX2) a
# forward runs in one C call; above them op by op, where BLAS's matrix-matrix products win
# (measured, README), for fp32 and, on weights unpacked slice by slice, for int8 and int4 too (on
# AVX-512, int4's integer kernel up to 96 rows made prompts of 48-96 tokens 0.64-0.87x as fast as
# fp32 on the default model, 2026-11-26), except where the build's integer kernels say they go
# further (pd_quant_max_rows: the VNNI builds', all the way).
# Rows by which the fp32 products' cost rises (outer-product strips of 8, cpu_kernels.c): 41 rows
# cost what 48 do, 17 what 24 do. The AVX-512 VNNI integer kernels take rows 16 at a time, so there
# every other step of 8 costs nothing, which the step cost model's price per vector learns.
ROW_GRANULE = 8
UNPACK_FLOATS = 1 << 22    # quantized weights unpacked for BLAS this many at a time (16 MB, one buffer)
QBLOCK = 64                # activation quantization block of the int8 product (cpu_kernels.c)


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
    key = hashlib.sha1("\0".join([*sources, version, *flags, _cpu_identity()]).encode()).hexdigest()
    out = cache_dir / "kernels" / f"cpu_kernels-{key[:16]}.so"
    if out.is_file():
        return out
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
    "pd_linear_f32": ([_P, _P, _P, _P, _I, _I, _I, _I], _I),
    "pd_linear_u8": ([_P, _P, _P, _P, _P, _I, _I, _I, _I], _I),
    "pd_exact_int8_blocks": ([_P, _L, _I, _P, _P], _I),
    "pd_linear_exact_int8": ([_P, _P, _P, _P, _P, _I, _I, _I, _I], _I),
    "pd_linear_q4": ([_P, _P, _P, _P, _P, _I, _I, _I, _I], _I),
    "pd_unpack_q4": ([_P, _P, _P, _I, _I, _I], None),
    "pd_unpack_u8": ([_P, _P, _P, _I, _I, _I], None),
    "pd_fast_rows": ([], _I),
    "pd_quant_max_rows": ([], _I),
    "pd_u8_dequant_rows": ([], _I),
    "pd_rms_norm": ([_P, _P, _P, _I, _I, _F, _I], None),
    "pd_add_rms_norm": ([_P, _P, _P, _P, _I, _I, _F, _I], None),
    "pd_rope": ([_P, _L, _I, _P, _L, _I, _P, _P, _I, _I, _I], None),
    "pd_silu_mul": ([_P, _P, _I, _I, _I], None),
    "pd_store_kv": ([_P, _L, _P, _L, _P, _P, _P, _I, _I, _I], None),
    "pd_paged_attention": ([_P, _L, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _P, _I], None),
    "pd_pool_counts": ([_P, _P], None),
    "pd_pool_spin": ([_I], None),
    "pd_layers": ([_P, _F, _P, _P, _P, _P, _P, _P, _P, _P, _L, _P, _I, _P, _P, _I, _I, _F, _I, _I, _P], _I),
}
WEIGHTS_INT8, WEIGHTS_INT4 = 1, 2   # how C names a weight format (PD_WEIGHTS_* in cpu_kernels.c)
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
    lib.pd_outer_choose()       # how this CPU takes 48 rows (~12 ms; the same sums either way)
    return lib


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """A build of the kernels with each function's argument and result types set."""
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


class SlicedBlas:
    """x @ W^T (+ bias) with BLAS for a matrix held quantized: W unpacked UNPACK_FLOATS at a time
    into one buffer kept for the next call. Unpacking a whole matrix into new memory per call
    (page faults on hundreds of MB) took 3x the product itself (measured, README)."""

    def __init__(self) -> None:
        self._slice: torch.Tensor | None = None

    def matmul(self, x: torch.Tensor, N: int, unpack: Callable[[int, int, torch.Tensor], None],
               bias: torch.Tensor | None) -> torch.Tensor:
        """unpack(n0, n1, out) writes rows n0:n1 of W, as floats, into out."""
        K = x.shape[1]
        rows = max(1, min(N, UNPACK_FLOATS // K))
        if self._slice is None or self._slice.numel() < rows * K:
            self._slice = torch.empty(rows * K)
        y = x.new_empty(x.shape[0], N)
        for n0 in range(0, N, rows):
            n1 = min(N, n0 + rows)
            w = self._slice[:(n1 - n0) * K].view(n1 - n0, K)
            unpack(n0, n1, w)
            torch.mm(x, w.t(), out=y[:, n0:n1])
        return y.add_(bias) if bias is not None else y


@dataclass
class KernelShare:
    """The sequences of a mixed step that one attention kernel takes: their rows of q (a slice
    when they are one run) and their own batch layout."""
    in_c: bool
    rows: slice | torch.Tensor
    tables: torch.Tensor
    starts: torch.Tensor
    context_lens: torch.Tensor
    qlens: list[int]
    clens: list[int]


def _split_by_kernel(block_tables: torch.Tensor, context_lens: torch.Tensor, qlens: list[int], clens: list[int],
                     in_c: list[bool]) -> list[KernelShare]:
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    shares = []
    for use_c in (True, False):
        seqs = [i for i, flag in enumerate(in_c) if flag == use_c]
        if seqs == list(range(seqs[0], seqs[-1] + 1)):
            rows: slice | torch.Tensor = slice(starts[seqs[0]], starts[seqs[-1] + 1])
        else:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
        sub_qlens = [qlens[i] for i in seqs]
        index = torch.tensor(seqs)
        shares.append(KernelShare(use_c, rows, block_tables[index], torch.tensor([0] + sub_qlens, dtype=torch.int32)
                                  .cumsum(0, dtype=torch.int32), context_lens[index], sub_qlens,
                                  [clens[i] for i in seqs]))
    return shares


class CpuKernels:
    """The backend's functions bound to one build of the library.

    About 270 lines on purpose: one short method per op of the backend interface that
    reference.py and triton_attention.py also implement (kernels/__init__.py), each checking that
    its tensors suit the C code and falling back to the reference otherwise; split, the one
    interface would be scattered over files."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        # a forward of up to this many rows can be one C call; its products beat BLAS up to them
        self.fast_rows = FastRows(lib.pd_fast_rows(), ROW_GRANULE)
        self.sliced = SlicedBlas()                  # quantized products of long prefills
        # rows up to which the C int8 and int4 products beat BLAS on unpacked weights
        self.quant_max_rows = max(self.fast_rows.limit, lib.pd_quant_max_rows())
        self._split: tuple[torch.Tensor, list[KernelShare]] | None = None   # this forward's (paged_attention)
        self._tile_seconds: float | None = None     # the last forward's (tile_seconds)
        self._tile_clock = ctypes.c_double()        # what pd_layers adds them to (one, not one per step)

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _ok(*tensors: torch.Tensor | None) -> bool:
        for t in tensors:     # (a plain loop: this runs ~300 times per decode step)
            if t is not None and (t.dtype is not torch.float32 or not t.is_cpu):
                return False
        return True

    def attention_in_c(self, query_len: int) -> bool:
        """Whether the C kernel rather than flash SDPA attends for one sequence's share of a batch:
        up to the fast rows' queries, over any context, so a batch of that many rows (decodes, a
        verify, a prefill slice beside a stream) runs as one C call. Sequences of 4 or more
        queries go by tiles of 16 (query, head) rows vectorized across the rows: alone, slower
        than flash SDPA from ~32 queries over 1K keys, but a step in one call beats the op-by-op
        forward around SDPA (a 32-token slice over 1K cached tokens: 86-105 vs 115-167 ms; README,
        2026-11-26)."""
        return query_len <= self.fast_rows.limit

    @staticmethod
    def _rows(t: torch.Tensor) -> bool:
        """Rows of contiguous [.., D] blocks at any row stride (views into a fused projection)."""
        return t.stride(-1) == 1 and (t.dim() == 2 or t.stride(1) == t.shape[2])

    # -- matrix products -------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] > self.fast_rows.limit or not self._ok(x, weight, bias) or not x.is_contiguous():
            return reference.linear(x, weight, bias)
        y = x.new_empty(x.shape[0], weight.shape[0])
        if self.lib.pd_linear_f32(x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
                                  y.data_ptr(), x.shape[0], weight.shape[0], x.shape[1], torch.get_num_threads()):
            raise MemoryError("CPU linear: out of memory for the transposed activations")
        return y

    def exact_int8_blocks(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weight's exact int8 blocks (reference.py) when it has that form, else None: one pass
        that stops at the first block without it."""
        if weight.dim() != 2 or not self._ok(weight) or not weight.is_contiguous() \
                or weight.shape[1] % reference.EXACT_BLOCK:
            return None
        N, K = weight.shape
        q = torch.empty(N, K, dtype=torch.int8)
        scales = torch.empty(N, K // reference.EXACT_BLOCK)
        if not self.lib.pd_exact_int8_blocks(weight.data_ptr(), N, K, q.data_ptr(), scales.data_ptr()):
            return None
        return q, scales

    def linear_exact_int8(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + bias for W held in exact int8 blocks: the same results as pd_linear_f32 on W."""
        if not self._ok(x, scales, bias) or q.dtype != torch.int8 or not q.is_cpu \
                or not (x.is_contiguous() and q.is_contiguous() and scales.is_contiguous()):
            return reference.linear_exact_int8(x, q, scales, bias)
        if x.shape[0] > self.fast_rows.limit:      # many rows: BLAS on the weights rebuilt a slice at a time
            def unpack(n0: int, n1: int, out: torch.Tensor) -> None:
                out.copy_(reference.dequantize_exact_int8(q[n0:n1], scales[n0:n1]))
            return self.sliced.matmul(x, q.shape[0], unpack, bias)
        y = x.new_empty(x.shape[0], q.shape[0])
        status = self.lib.pd_linear_exact_int8(x.data_ptr(), q.data_ptr(), scales.data_ptr(),
                                               bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                               x.shape[0], q.shape[0], x.shape[1], torch.get_num_threads())
        if status == -2:
            raise ValueError(f"exact int8 blocks: rows of {x.shape[1]} weights are not whole blocks of 32")
        if status != 0:
            raise MemoryError("CPU linear: out of memory for the transposed activations")
        return y

    def pack_int8(self, q: torch.Tensor, scales: torch.Tensor,
                  act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[1] % QBLOCK or act_dtype != torch.float32 or q.device.type != "cpu":
            return reference.pack_int8(q, scales, act_dtype)
        # Offset binary (q + 128) for the unsigned x signed dot product: flipping the sign bit.
        return q.view(torch.uint8) ^ 0x80, scales.float().contiguous()

    @staticmethod
    def unpack_int8(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if packed.dtype == torch.uint8:
            return (packed ^ 0x80).view(torch.int8), scales.float()
        return reference.unpack_int8(packed, scales)

    def linear_int8(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        if packed.dtype != torch.uint8 or not self._ok(x, bias):
            return reference.linear_int8(x, packed, scales, bias)
        if x.shape[0] > self.quant_max_rows:
            # A long prefill on a build without VNNI: BLAS beats its integer kernel there (measured,
            # README), on weights unpacked in C on the pool (torch's element-wise passes cost a sixth
            # of it).
            def unpack(n0: int, n1: int, out: torch.Tensor) -> None:
                self.lib.pd_unpack_u8(packed[n0].data_ptr(), scales[n0].data_ptr(), out.data_ptr(), n1 - n0,
                                      packed.shape[1], torch.get_num_threads())
            return self.sliced.matmul(x, packed.shape[0], unpack, bias)
        x = x.contiguous()
        y = x.new_empty(x.shape[0], packed.shape[0])
        status = self.lib.pd_linear_u8(x.data_ptr(), packed.data_ptr(), scales.data_ptr(),
                                       bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                       x.shape[0], packed.shape[0], x.shape[1], torch.get_num_threads())
        if status != 0:
            raise MemoryError("int8 matmul: out of memory for the quantized activations")
        return y

    def linear_int4(self, x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self._ok(x, bias) or packed.device.type != "cpu" or params.dtype != torch.bfloat16:
            return reference.linear_int4(x, packed, params, bias)
        N, K = packed.shape[0], packed.shape[1] * 2
        if x.shape[0] > self.quant_max_rows:
            # As for int8, unpacked in C on the pool (torch's element-wise unpacking took longer
            # than the product).
            def unpack(n0: int, n1: int, out: torch.Tensor) -> None:
                self.lib.pd_unpack_q4(packed[n0].data_ptr(), params[n0].data_ptr(), out.data_ptr(), n1 - n0, K,
                                      torch.get_num_threads())
            return self.sliced.matmul(x, N, unpack, bias)
        x = x.contiguous()
        y = x.new_empty(x.shape[0], N)
        status = self.lib.pd_linear_q4(x.data_ptr(), packed.data_ptr(), params.data_ptr(),
                                       bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                       x.shape[0], N, K, torch.get_num_threads())
        if status != 0:
            raise MemoryError("int4 matmul: out of memory for the quantized activations")
        return y

    @staticmethod
    def int8_supported(device: torch.device) -> bool:
        return device.type == "cpu" or reference.int8_supported(device)

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
        None where the C code does not cover the weights (not fp32, int8 not packed as u8)."""
        first = layers[0]
        # pd_layers' format of the quantized weights (PD_WEIGHTS_*): int8 (a scale per row, 1-D) or
        # int4 (bf16 params per group, 3-D); a linear without scales is fp32 whatever the others are.
        linears = (first.qkv, first.o, first.gate_up, first.down)
        int4 = [w[1] is not None and w[1].dim() == 3 for w in linears]
        fmt = WEIGHTS_INT4 if any(int4) else WEIGHTS_INT8 if any(w[1] is not None for w in linears) else 0
        inter = first.down[0].shape[1] * (2 if int4[3] else 1)
        dims = (len(layers), first.norm_mlp.shape[0], num_heads, num_kv_heads, head_dim, inter, fmt)
        tensors: list[torch.Tensor] = []
        ptrs: list[int | None] = []
        for layer in layers:
            for part in layer:
                for t in (part if isinstance(part, tuple) else (part,)):
                    if t is None:
                        ptrs.append(None)
                        continue
                    packed = t.dtype == torch.uint8 and t.dim() == 2
                    int4_params = t.dtype == torch.bfloat16 and t.dim() == 3
                    if not ((packed or int4_params or t.dtype == torch.float32) and t.is_cpu and t.is_contiguous()):
                        return None
                    tensors.append(t)
                    ptrs.append(t.data_ptr())
        if len(ptrs) != PTRS_PER_LAYER * len(layers):    # the C side reads a fixed table
            raise ValueError(f"pd_layers takes {PTRS_PER_LAYER} tensors per layer, got {len(ptrs) // len(layers)}")
        return LayerPlan((ctypes.c_int * 7)(*dims), eps, (ctypes.c_void_p * len(ptrs))(*ptrs), tuple(tensors),
                         head_dim)

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

    def tile_seconds(self) -> float | None:
        """Seconds the last forward spent in the attention of sequences of several queries (the
        tiles: prefill slices, verifies), as pd_layers times it; None after a forward op by op."""
        return self._tile_seconds

    # -- attention -------------------------------------------------------------------------------
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if not (self._ok(k, v, k_cache, v_cache) and self._rows(k) and self._rows(v)
                and k_cache.is_contiguous() and v_cache.is_contiguous()
                and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
            return reference.store_kv(k, v, k_cache, v_cache, slot_mapping)
        self.lib.pd_store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                             v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], k.shape[1], k.shape[2])

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, *,
                        query_lens_host: list[int] | None = None,
                        context_lens_host: list[int] | None = None,
                        num_splits: int | None = None) -> torch.Tensor:
        # num_splits: see reference.paged_attention (these kernels do not split a context)
        qlens, clens = reference.host_lengths(query_start_loc, context_lens, query_lens_host, context_lens_host)
        fits = (q.shape[2] <= 512 and self._ok(q, k_cache, v_cache) and self._rows(q)
                and k_cache.is_contiguous() and v_cache.is_contiguous())
        in_c = [fits and self.attention_in_c(n) for n in qlens]
        if all(in_c):
            return self._attention_c(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)
        if not any(in_c):
            return reference.paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                                             scale, query_lens_host=qlens, context_lens_host=clens)
        # A mixed step (say a prefill slice beside decodes): each sequence to its better kernel. The
        # split is the same in every layer of a forward, so it is made once (tensors of one
        # forward are the key) and a kernel's sequences in one run of rows are a view, not a copy.
        if self._split is None or self._split[0] is not block_tables:
            self._split = (block_tables, _split_by_kernel(block_tables, context_lens, qlens, clens, in_c))
        out = torch.empty_like(q)
        for part in self._split[1]:
            args = (q[part.rows], k_cache, v_cache, part.tables, part.starts, part.context_lens, scale)
            out[part.rows] = (self._attention_c(*args) if part.in_c else reference.paged_attention(
                *args, query_lens_host=part.qlens, context_lens_host=part.clens))
        return out

    def _attention_c(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
        tables = block_tables.to(torch.int32).contiguous()
        cu_q = query_start_loc.to(torch.int32).contiguous()
        ctx = context_lens.to(torch.int32).contiguous()
        T, H, D = q.shape
        out = q.new_empty(T, H, D)
        self.lib.pd_paged_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                    tables.data_ptr(), tables.shape[1], cu_q.data_ptr(), ctx.data_ptr(),
                                    len(ctx), H, k_cache.shape[2], D, k_cache.shape[1], scale,
                                    out.data_ptr(), torch.get_num_threads())
        return out
