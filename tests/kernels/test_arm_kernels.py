"""The CPU kernels built for aarch64 (NEON dot-product int8 path, and the portable one) and run
under qemu-user, against the PyTorch reference on this host. Needs the Debian packages
gcc-aarch64-linux-gnu and qemu-user; without them the tests skip and say so."""
from __future__ import annotations

import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pdchat.engine.quant import quantize_int4, quantize_int8
from pdchat.kernels import cpu, reference

from .batch import Batch
from tests.kernel_variants import record_variant
from .test_cpu_kernels import exact_blocks, exact_q4_blocks, int4_product_in_integers

TOOLS = {"aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu", "qemu-aarch64": "qemu-user"}   # -> Debian package
CC, QEMU = TOOLS
DRIVER = Path(__file__).with_name("arm_driver.c")
TOL = dict(atol=1e-5, rtol=1e-4)                  # as test_cpu_kernels
# Operation codes and header size of arm_driver.c
(LINEAR_U8, LINEAR_F32, RMS_NORM, ADD_RMS_NORM, SILU_MUL, ROPE, ATTENTION, LINEAR_Q4, LINEAR_EXACT,
 LINEAR_EXACT_Q4) = range(1, 11)
DIMS = 7


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@dataclass
class Job:
    """One kernel call of the driver: its inputs and what it must write back, in the driver's order."""
    name: str
    op: int
    dims: tuple[int, ...]
    inputs: list[torch.Tensor]
    expected: list[torch.Tensor]
    tol: dict
    max_rel: float | None = None      # instead of tol: largest error / largest expected value


def int8_job(name: str, x: torch.Tensor, w: torch.Tensor, tol: dict, max_rel: float | None = None) -> Job:
    q, scales = quantize_int8(w)
    bias = rand(w.shape[0], seed=9)
    exact = x.double() @ (q.double() * scales.double()[:, None]).T + bias.double()
    packed = q.view(torch.uint8) ^ 0x80             # as CpuKernels.pack_int8 stores it
    return Job(name, LINEAR_U8, (x.shape[0], w.shape[0], x.shape[1]), [x, packed, scales, bias], [exact.float()],
               tol, max_rel)


def int8_jobs() -> list[Job]:
    """test_cpu_kernels' int8 cases: an outlier channel (1 row and several), and full scale."""
    x = rand(5, 256, seed=1)
    x[:, 7] *= 50
    w = rand(96, 256, seed=2) * torch.linspace(0.1, 4, 96)[:, None]
    signs = torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0)
    full_w = torch.stack([signs, -signs, torch.ones(128), -torch.ones(128)]) * 0.5   # every q at +-127
    full_x = torch.stack([torch.full((128,), 2.0), signs * 3.0, -signs])            # every block at +-its max
    assert quantize_int8(full_w)[0].abs().min() == 127
    # Two-part int8 activations: error ~1e-5 of the largest value; integer sums at full scale are exact.
    return [int8_job("int8 1 row", x[:1], w, {}, max_rel=1e-4), int8_job("int8 5 rows", x, w, {}, max_rel=1e-4),
            int8_job("int8 full scale", full_x, full_w, {"atol": 1e-5, "rtol": 1e-6})]


def int4_jobs() -> list[Job]:
    """test_cpu_kernels' int4 cases: the C arithmetic (int8 activations in blocks of 32) exactly,
    for one row and several, and weights and activations at their extremes."""
    x = rand(5, 320, seed=1)
    x[:, 7] *= 50
    w = rand(80, 320, seed=2) * torch.linspace(0.1, 4, 80)[:, None]
    packed, params = quantize_int4(w)
    bias = rand(80, seed=9)
    u = torch.where(torch.arange(128) % 2 == 0, 15, 0).to(torch.uint8).repeat(4, 1)
    u[1] = 15 - u[1]
    ext_params = torch.tensor([[0.5, -3.0]], dtype=torch.bfloat16).repeat(4, 4, 1)
    signs = torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0)
    ext_x = torch.stack([torch.full((128,), 2.0), signs * 3.0, -signs])

    def job(name: str, x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor, bias: torch.Tensor) -> Job:
        want = int4_product_in_integers(x, packed, params) + bias.double()
        return Job(name, LINEAR_Q4, (x.shape[0], packed.shape[0], x.shape[1]),
                   [x, packed, params.view(torch.int16), bias], [want.float()], {}, max_rel=1e-5)
    return [job("int4 1 row", x[:1], packed, params, bias), job("int4 5 rows", x, packed, params, bias),
            job("int4 extremes", ext_x, reference.pack_int4(u), ext_params, torch.zeros(4))]


def exact_jobs() -> list[Job]:
    """Exact int8 and Q4 blocks against fp32 on their rebuilt weights, at a few rows (the dot path,
    int8 widened by NEON) and at strips; each pair's results must be equal bit for bit (the test)."""
    out = []
    for form, op, (w, q, scales) in (("int8", LINEAR_EXACT, exact_blocks(40, 96, seed=15)),
                                     ("Q4", LINEAR_EXACT_Q4, exact_q4_blocks(40, 96, seed=18))):
        bias = rand(40, seed=16)
        for rows in (2, 9):
            x = rand(rows, 96, seed=17)
            want = [reference.linear(x, w, bias)]
            out += [Job(f"linear f32, {rows} rows of exact {form} weights", LINEAR_F32, (rows, 40, 96),
                        [x, w, bias], want, TOL),
                    Job(f"exact {form} blocks, {rows} rows", op, (rows, 40, 96), [x, q, scales, bias], want, TOL)]
    return out


def fp32_jobs() -> list[Job]:
    """The other kernels of a layer, at test_cpu_kernels' shapes."""
    xf, wf, bf = rand(6, 96, seed=5), rand(40, 96, seed=3), rand(40, seed=4)   # 6 rows: one strip of 8 on NEON
    xo = rand(33, 96, seed=14)      # outer-product strips of 16, 16 and 8 rows; NEON: blocks of 6 weight rows, a last of 4
    xn, dn, wn = rand(70, 4096, seed=6), rand(70, 4096, seed=7), rand(4096, seed=8)   # split over threads
    gu = rand(9, 2 * 48, seed=10) * 4
    gu[0, :6] = torch.tensor([-100.0, -87.5, -20.0, 20.0, 88.5, 100.0])              # exp's clamped range
    T, H, KVH, D = 5, 6, 2, 32
    q, k = rand(T, H, D, seed=11), rand(T, KVH, D, seed=12)
    angles = rand(T, D // 2, seed=13)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return [Job("linear f32", LINEAR_F32, (6, 40, 96), [xf, wf, bf], [reference.linear(xf, wf, bf)], TOL),
            Job("linear f32, 33 rows", LINEAR_F32, (33, 40, 96), [xo, wf, bf], [reference.linear(xo, wf, bf)], TOL),
            Job("rms_norm", RMS_NORM, (70, 4096), [xn, wn], [reference.rms_norm(xn, wn, 1e-5)], TOL),
            Job("add_rms_norm", ADD_RMS_NORM, (70, 4096), [xn, dn, wn],
                list(reference.add_rms_norm(xn.clone(), dn, wn, 1e-5)), TOL),
            Job("silu_mul", SILU_MUL, (9, 48), [gu], [reference.silu_mul(gu)], TOL),
            Job("rope", ROPE, (T, H, KVH, D), [q, k, cos, sin], list(reference.rope(q.clone(), k.clone(), cos, sin)),
                TOL)]


def attention_job(name: str, qlens: list[int], clens: list[int], kv_heads: int, group: int, head_dim: int,
                  block_size: int = 8) -> Job:
    b = Batch(qlens, clens, kv_heads, group, head_dim, block_size=block_size, dtype=torch.float32)
    dims = (len(qlens), kv_heads * group, kv_heads, head_dim, block_size, b.k_cache.shape[0], b.block_tables.shape[1])
    inputs = [b.query_start_loc, b.context_lens, b.block_tables, b.q, b.k_cache, b.v_cache]
    return Job(name, ATTENTION, dims, inputs, [b.expected(head_dim ** -0.5)], TOL)


def jobs() -> list[Job]:
    return [*int8_jobs(), *int4_jobs(), *exact_jobs(), *fp32_jobs(),
            attention_job("decode", [1], [37], 2, 4, 64),                        # serial (below ATTENTION_PAR_MACS)
            attention_job("multi-query", [5, 1, 3], [5, 33, 20], 3, 3, 32),      # on the pool
            attention_job("full tiles", [20, 1, 4], [90, 40, 33], 3, 3, 64, block_size=16)]   # the unrolled path


def write_jobs(path: Path, todo: list[Job]) -> None:
    with path.open("wb") as f:
        f.write(struct.pack("<i", len(todo)))
        for job in todo:
            f.write(struct.pack(f"<{1 + DIMS}i", job.op, *job.dims, *[0] * (DIMS - len(job.dims))))
            for t in job.inputs:
                f.write(t.contiguous().numpy().tobytes())


def read_results(path: Path, todo: list[Job]) -> tuple[int, list[list[torch.Tensor]]]:
    """pd_int8_path() and each job's outputs, shaped as expected."""
    data = path.read_bytes()
    int8_path, at, results = struct.unpack_from("<i", data)[0], 4, []
    for job in todo:
        outs = []
        for want in job.expected:
            n = want.numel()
            outs.append(torch.frombuffer(bytearray(data[at:at + 4 * n]), dtype=torch.float32).view(want.shape))
            at += 4 * n
        results.append(outs)
    assert at == len(data), "the driver wrote other than the jobs ask for"
    return int8_path, results


def build(tmp: Path, int8: str | None) -> Path:
    """The driver, static for qemu-user, with cpu.build's flags for an ARMv8.2 CPU with dot products."""
    missing = [package for tool, package in TOOLS.items() if shutil.which(tool) is None]
    if missing:
        reason = f"needs the Debian package{'s' * (len(missing) > 1)} {' and '.join(missing)}"
        record_variant("neon-dot", f"not run under qemu-aarch64: {reason}")
        pytest.skip(f"aarch64 kernels: {reason}")
    forced = [cpu.int8_define(int8)] if int8 else []
    exe = tmp / "arm_driver"
    done = subprocess.run([CC, *cpu.CODE_FLAGS, "-march=armv8.2-a+dotprod", "-static", *forced, f"-I{cpu.SOURCE.parent}",
                           str(DRIVER), "-o", str(exe), "-lm", "-lpthread"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return exe


@pytest.mark.parametrize("int8, expected_path", [(None, "neon-dot"), ("portable", "portable")])
def test_aarch64_kernels_match_the_reference_under_qemu(tmp_path, int8, expected_path):
    exe = build(tmp_path, int8)
    todo = jobs()
    write_jobs(tmp_path / "in.bin", todo)
    # (a timeout: a deadlocked worker pool would otherwise hang the run)
    ran = subprocess.run([QEMU, str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr[-2000:]
    int8_path, results = read_results(tmp_path / "out.bin", todo)
    assert cpu.INT8_PATHS[int8_path].name == expected_path     # the default build takes the NEON path
    for job, outs in zip(todo, results):
        for got, want in zip(outs, job.expected):
            if job.max_rel is not None:
                err, limit = (got - want).abs().max(), job.max_rel * want.abs().max()
                assert err < limit, job.name
            else:
                torch.testing.assert_close(got, want, **job.tol, msg=lambda m, job=job: f"{job.name}: {m}")
    by_name = {job.name: outs for job, outs in zip(todo, results)}
    for form in ("int8", "Q4"):
        for rows in (2, 9):
            exact = by_name[f"exact {form} blocks, {rows} rows"][0]
            assert torch.equal(exact, by_name[f"linear f32, {rows} rows of exact {form} weights"][0]), (form, rows)
    if expected_path == "neon-dot":
        record_variant("neon-dot", "built and tested under qemu-aarch64")
