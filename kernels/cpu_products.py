"""The CPU backend's matrix products (cpu_kernels.c through ctypes; cpu.py builds and binds the
library): fp32, exact int8 blocks, int8 and int4 weights, each for small row counts in C and past
them in C or by BLAS, with the reference's twin wherever the C code does not cover the tensors."""
from __future__ import annotations

import ctypes
import time
from typing import Callable

import torch

from . import FastRows, reference

# Up to a build's fast rows (pd_fast_rows: 48 with AVX-512, 144 on other x86 builds with AVX2) a
# forward runs in one C call; above them op by op, its fp32 products in C or on BLAS, whichever
# the machine runs faster (many_rows_in_c), and int8 and int4 on weights unpacked slice by slice
# for BLAS, where BLAS's matrix-matrix products win (measured, README; on AVX-512, int4's integer
# kernel up to 96 rows made prompts of 48-96 tokens 0.64-0.87x as fast as fp32 on the default
# model, 2026-11-26), except where the build's integer kernels say they go further
# (pd_quant_max_rows: the VNNI builds' all the way, and AVX2's for int4).
# Rows by which the fp32 products' cost rises (pd_row_granule: the panels' tiles where exact blocks
# go by panels, else outer-product strips of 8, or of 16 past 16 rows where the CPU runs those
# faster, cpu_kernels.c): with 8, 41 rows cost what 48 do, 17 what 24 do. The AVX-512 VNNI integer kernels take rows 16 at a time, so with 8 every other step
# costs nothing there, which the step cost model's price per vector learns.
# How C names a matrix's stored form (PD_WEIGHTS_* in cpu_kernels.c).
WEIGHTS_F32, WEIGHTS_INT8, WEIGHTS_INT4, WEIGHTS_EXACT_INT8, WEIGHTS_EXACT_Q4 = range(5)
UNPACK_FLOATS = 1 << 22    # quantized weights unpacked for BLAS this many at a time (16 MB, one buffer)
QBLOCK = 64                # activation quantization block of the int8 product (cpu_kernels.c)


def weight_format(weight: torch.Tensor, scales: torch.Tensor | None) -> int | None:
    """The C name of a matrix's stored form, told by its tensors' dtypes and shapes; None for a
    form the C products do not read (the reference's int8 packing, another dtype)."""
    fp32 = torch.float32
    if scales is None:
        return WEIGHTS_F32 if weight.dtype == fp32 else None
    if weight.dtype == torch.int8 and weight.dim() == 3 and scales.dtype == fp32 and scales.dim() == 3:
        return WEIGHTS_EXACT_INT8                 # (held as exact_int8_blocks holds them, as Q4's below)
    if weight.dtype == torch.uint8 and weight.dim() == 2:
        if scales.dim() == 1 and scales.dtype == fp32:
            return WEIGHTS_INT8
        if scales.dim() == 3 and scales.dtype == torch.bfloat16:
            return WEIGHTS_INT4
    if weight.dtype == torch.uint8 and weight.dim() == 3 and scales.dim() == 4 and scales.dtype == fp32:
        return WEIGHTS_EXACT_Q4                   # (as exact_q4_blocks holds them: C reads the layouts)
    return None


def weight_columns(weight: torch.Tensor, fmt: int) -> int:
    """A matrix's width (its K) in a stored form: nibble forms hold two weights a byte."""
    return weight.shape[-1] * (2 if fmt in (WEIGHTS_INT4, WEIGHTS_EXACT_Q4) else 1)


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


def faster_in_c(run_c: Callable[[], None], run_torch: Callable[[], None], rounds: int = 4,
                clock: Callable[[], float] = time.perf_counter) -> bool:
    """Whether run_c beats run_torch (the same work in PyTorch: BLAS, flash SDPA): the best of
    `rounds` alternating runs each, the first round left out (it faults pages in and warms the
    caches)."""
    best = {run_c: float("inf"), run_torch: float("inf")}
    for i in range(rounds):
        for run in (run_c, run_torch):
            start = clock()
            run()
            took = clock() - start
            if i > 0:
                best[run] = min(best[run], took)
    return best[run_c] < best[run_torch]


Runs = tuple[Callable[[], None], Callable[[], None]]
_IN_C: dict[tuple[str, str], bool] = {}     # (a build's path, what): timed once a process


def chosen_once(lib: ctypes.CDLL, what: str, make_runs: Callable[[], Runs]) -> bool:
    """Whether `what` runs faster in this build's C code than in PyTorch on this machine:
    faster_in_c on the (C, PyTorch) pair make_runs gives, once per build and process."""
    key = (lib._name, what)
    if key not in _IN_C:
        _IN_C[key] = faster_in_c(*make_runs())
    return _IN_C[key]


def many_rows_in_c(lib: ctypes.CDLL) -> bool:
    """Whether this machine runs fp32 products past the fast rows faster in C (by chunks of them)
    than on BLAS: timed at the first such product, on 288 rows x 576 by 1,536 (a default model's
    shape; two matrices, so the weights come from L3 as in a forward), 43-53 ms on the Zen 5 below. It differs by
    machine: on a 2-core AMD EPYC (Zen 5, 2026-12-02) the C strips ran 1,728 rows at 240-360 GF/s
    and MKL at 140-170, where on a Zen 3 BLAS was as fast past ~150 rows (cpu_kernels.c,
    FAST_ROWS). The sums differ between the two, never by more than fp32 rounding."""
    def make_runs() -> Runs:
        M, N, K, threads = 288, 1536, 576, torch.get_num_threads()
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(M, K, generator=generator)
        weights = [torch.randn(N, K, generator=generator) for _ in range(2)]
        y = torch.empty(M, N)

        def run_c() -> None:
            for w in weights:
                lib.pd_linear_f32(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), M, N, K, threads)

        def run_blas() -> None:
            for w in weights:
                torch.mm(x, w.t(), out=y)
        return run_c, run_blas
    return chosen_once(lib, "products", make_runs)


class CpuProducts:
    """The matrix products of one build of the library (CpuKernels adds the other ops)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        # a forward of up to this many rows can be one C call; its products beat BLAS up to them
        self.fast_rows = FastRows(lib.pd_fast_rows(), lib.pd_row_granule())
        self.sliced = SlicedBlas()                  # quantized products of long prefills
        # rows up to which the C int8 and int4 products beat BLAS on unpacked weights, by format
        self.quant_max_rows = {fmt: max(self.fast_rows.limit, lib.pd_quant_max_rows(code))
                               for fmt, code in (("int8", WEIGHTS_INT8), ("int4", WEIGHTS_INT4))}

    def _in_c(self, rows: int) -> bool:
        """Whether a product of this many fp32 (or exact blocks') rows runs in C."""
        return rows <= self.fast_rows.limit or many_rows_in_c(self.lib)

    @staticmethod
    def _ok(*tensors: torch.Tensor | None) -> bool:
        for t in tensors:     # (a plain loop: this runs ~300 times per decode step)
            if t is not None and (t.dtype is not torch.float32 or not t.is_cpu):
                return False
        return True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not (self._ok(x, weight, bias) and x.is_contiguous() and self._in_c(x.shape[0])):
            return reference.linear(x, weight, bias)
        y = x.new_empty(x.shape[0], weight.shape[0])
        if self.lib.pd_linear_f32(x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
                                  y.data_ptr(), x.shape[0], weight.shape[0], x.shape[1], torch.get_num_threads()):
            raise MemoryError("CPU linear: out of memory for the transposed activations")
        return y

    def _block_input(self, weight: torch.Tensor) -> bool:
        """Whether the C searches for exact blocks can read this weight."""
        return weight.dim() == 2 and self._ok(weight) and weight.is_contiguous() \
            and weight.shape[1] % reference.EXACT_BLOCK == 0

    def exact_int8_blocks(self, weight: torch.Tensor, multiplied: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weight's exact int8 blocks (reference.py) when it has that form, else None: one pass
        that stops at the first block without it."""
        return self._held_exact(weight, multiplied, 1, torch.int8, (), self.lib.pd_exact_int8_blocks,
                                self.lib.pd_exact_int8_panels)

    def exact_q4_blocks(self, weight: torch.Tensor, multiplied: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weight's exact Q4 blocks (reference.py) when it has that form, else None: one
        parallel pass that gives up soon after a group without it."""
        threads = torch.get_num_threads()
        return self._held_exact(weight, multiplied, 2, torch.uint8, (2,),
                                lambda *found_in: self.lib.pd_exact_q4_blocks(*found_in, threads),
                                self.lib.pd_exact_q4_panels)

    def _held_exact(self, weight: torch.Tensor, multiplied: bool, per_byte: int, dtype: torch.dtype,
                    params: tuple[int, ...], find: Callable[..., int],
                    by_panels: Callable[..., int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A form's blocks as held ([layouts, N, K / per_byte] integers, [layouts, N, K / 32, *params]
        scales): by rows, found by `find`, and by panels too (`by_panels`) where the build
        multiplies by them and products will read the matrix (`multiplied`: an untied
        embedding's rows are only looked up)."""
        if not self._block_input(weight):
            return None
        N, K = weight.shape
        layouts = self._layouts(N) if multiplied else 1
        q = torch.empty(layouts, N, K // per_byte, dtype=dtype)
        scales = torch.empty(layouts, N, K // reference.EXACT_BLOCK, *params)
        if not find(weight.data_ptr(), N, K, q.data_ptr(), scales.data_ptr()):
            return None
        if layouts == 2:
            by_panels(q.data_ptr(), scales.data_ptr(), N, K, q[1].data_ptr(), scales[1].data_ptr(),
                      torch.get_num_threads())
        return q, scales

    def _layouts(self, N: int) -> int:
        """The layouts of a matrix of N rows held in exact blocks (reference.py): by rows, and by
        panels too where the C products of a few rows read those (pd_exact_panels)."""
        return 2 if self.lib.pd_exact_panels(N) else 1

    def _linear_exact(self, name: str, c_product: Callable[..., int],
                      unpack: Callable[[int, int, torch.Tensor], None], x: torch.Tensor, q: torch.Tensor,
                      scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T + bias for W held in exact blocks (`name` for errors): C up to the rows this
        machine runs there (every count where they go on AMX tiles: faster than BLAS, and a row's
        sums the same whatever the count), else BLAS on weights rebuilt a slice at a time by
        unpack(n0, n1, out)."""
        N = q.shape[-2]
        if not (self._in_c(x.shape[0]) or (q.shape[0] == 2 and self.lib.pd_exact_amx(-1))):
            return self.sliced.matmul(x, N, unpack, bias)
        y = x.new_empty(x.shape[0], N)
        status = c_product(x.data_ptr(), q.data_ptr(), scales.data_ptr(), bias.data_ptr() if bias is not None else None,
                           y.data_ptr(), x.shape[0], N, x.shape[1], torch.get_num_threads())
        if status == -2:
            raise ValueError(f"{name}: rows of {x.shape[1]} weights are not whole blocks of 32")
        if status != 0:
            raise MemoryError("CPU linear: out of memory for the transposed activations")
        return y

    def _exact_input(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                     q_dtype: torch.dtype) -> bool:
        """Whether the C products for exact blocks can read these tensors: held as exact_*_blocks
        hold them, in the layouts this build reads."""
        return self._ok(x, scales, bias) and q.dtype == q_dtype and q.is_cpu and q.dim() == 3 \
            and q.shape[0] == self._layouts(q.shape[1]) and scales.shape[:2] == q.shape[:2] \
            and x.is_contiguous() and q.is_contiguous() and scales.is_contiguous()

    def linear_exact_int8(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + bias for W held in exact int8 blocks (as exact_int8_blocks holds them: [layouts,
        N, K] and [layouts, N, K / 32]): the same results as pd_linear_f32 on W."""
        if not self._exact_input(x, q, scales, bias, torch.int8):
            return reference.linear_exact_int8(x, q, scales, bias)

        def unpack(n0: int, n1: int, out: torch.Tensor) -> None:      # (past the fast rows only)
            rows, row_scales = reference.exact_rows(q, scales)
            out.copy_(reference.dequantize_exact_int8(rows[n0:n1], row_scales[n0:n1]))
        return self._linear_exact("exact int8 blocks", self.lib.pd_linear_exact_int8, unpack, x, q, scales, bias)

    def linear_exact_q4(self, x: torch.Tensor, q: torch.Tensor, dm: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + bias for W held in exact Q4 blocks (as exact_q4_blocks holds them: [layouts, N,
        K / 2] and [layouts, N, K / 32, 2]): the same results as pd_linear_f32 on W."""
        if not self._exact_input(x, q, dm, bias, torch.uint8):
            return reference.linear_exact_q4(x, q, dm, bias)

        def unpack(n0: int, n1: int, out: torch.Tensor) -> None:      # (past the fast rows only)
            rows, row_params = reference.exact_rows(q, dm)
            self.lib.pd_unpack_exact_q4(rows[n0].data_ptr(), row_params[n0].data_ptr(), out.data_ptr(), n1 - n0,
                                        rows.shape[1] * 2, torch.get_num_threads())
        return self._linear_exact("exact Q4 blocks", self.lib.pd_linear_exact_q4, unpack, x, q, dm, bias)

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
        if x.shape[0] > self.quant_max_rows["int8"]:
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
        if x.shape[0] > self.quant_max_rows["int4"]:
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
