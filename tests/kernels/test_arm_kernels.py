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

from pdchat.engine.quant import quantize_int8
from pdchat.kernels import cpu, reference

from .conftest import record_variant

CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
DRIVER = Path(__file__).with_name("arm_driver.c")
TOL = dict(atol=1e-5, rtol=1e-4)
# Operation codes of arm_driver.c
LINEAR_U8, LINEAR_F32, RMS_NORM, ADD_RMS_NORM, SILU_MUL, ROPE, DECODE_ATTENTION = range(1, 8)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@dataclass
class Job:
    op: int
    dims: tuple[int, ...]
    inputs: list[torch.Tensor]
    expected: list[torch.Tensor]      # what the driver writes back, in its order
    tol: dict
    max_rel: float | None = None      # instead of tol: largest error / largest value


def int8_job(x: torch.Tensor, w: torch.Tensor, tol: dict, max_rel: float | None = None) -> Job:
    q, scales = quantize_int8(w)
    bias = rand(w.shape[0], seed=9)
    exact = x.double() @ (q.double() * scales.double()[:, None]).T + bias.double()
    packed = (q.view(torch.uint8) ^ 0x80).contiguous()
    return Job(LINEAR_U8, (x.shape[0], w.shape[0], x.shape[1]), [x, packed, scales, bias], [exact.float()], tol,
               max_rel)


def jobs() -> list[Job]:
    x = rand(5, 256, seed=1)
    x[:, 7] *= 50                                              # an outlier channel
    w = rand(96, 256, seed=2) * torch.linspace(0.1, 4, 96)[:, None]
    signs = torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0)
    full_w = torch.stack([signs, -signs, torch.ones(128), -torch.ones(128)]) * 0.5   # every q at +-127
    full_x = torch.stack([torch.full((128,), 2.0), signs * 3.0, -signs])
    wf, bf = rand(40, 96, seed=3), rand(40, seed=4)
    xf = rand(6, 96, seed=5)
    xn, dn, wn = rand(70, 4096, seed=6), rand(70, 4096, seed=7), rand(4096, seed=8)   # split over threads
    gu = rand(9, 2 * 48, seed=10) * 4
    gu[0, :6] = torch.tensor([-100.0, -87.5, -20.0, 20.0, 88.5, 100.0])
    T, H, KVH, D = 5, 6, 2, 32
    q, k = rand(T, H, D, seed=11), rand(T, KVH, D, seed=12)
    angles = rand(T, D // 2, seed=13)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    want_q, want_k = reference.rope(q.clone(), k.clone(), cos, sin)
    summed, normed = reference.add_rms_norm(xn.clone(), dn, wn, 1e-5)
    return [
        int8_job(x, w, {}, max_rel=1e-4),          # two-part int8 activations: ~1e-5 of the largest value
        int8_job(full_x, full_w, {"atol": 1e-5, "rtol": 1e-6}),
        Job(LINEAR_F32, (6, 40, 96), [xf, wf, bf], [reference.linear(xf, wf, bf)], TOL),
        Job(RMS_NORM, (70, 4096), [xn, wn], [reference.rms_norm(xn, wn, 1e-5)], TOL),
        Job(ADD_RMS_NORM, (70, 4096), [xn, dn, wn], [summed, normed], TOL),
        Job(SILU_MUL, (9, 48), [gu], [reference.silu_mul(gu)], TOL),
        Job(ROPE, (T, H, KVH, D), [q, k, cos, sin], [want_q, want_k], TOL),
        decode_job(H=8, KVH=2, D=64, length=37),
    ]


def decode_job(H: int, KVH: int, D: int, length: int) -> Job:
    bs = 4
    blocks = -(-length // bs)
    q, kc, vc = rand(1, H, D, seed=20), rand(blocks, bs, KVH, D, seed=21), rand(blocks, bs, KVH, D, seed=22)
    want = reference.paged_attention(q, kc, vc, torch.arange(blocks, dtype=torch.int32)[None],
                                     torch.tensor([0, 1], dtype=torch.int32), torch.tensor([length], dtype=torch.int32),
                                     D ** -0.5)
    return Job(DECODE_ATTENTION, (H, KVH, D, length), [q, kc, vc], [want], TOL)


def write_jobs(path: Path, todo: list[Job]) -> None:
    with path.open("wb") as f:
        f.write(struct.pack("<i", len(todo)))
        for job in todo:
            f.write(struct.pack("<5i", job.op, *job.dims, *[0] * (4 - len(job.dims))))
            for t in job.inputs:
                f.write(t.contiguous().numpy().tobytes())


def read_results(path: Path, todo: list[Job]) -> tuple[int, list[list[torch.Tensor]]]:
    data = path.read_bytes()
    path_code, at, results = struct.unpack_from("<i", data)[0], 4, []
    for job in todo:
        outs = []
        for want in job.expected:
            n = want.numel()
            outs.append(torch.frombuffer(bytearray(data[at:at + 4 * n]), dtype=torch.float32).view(want.shape))
            at += 4 * n
        results.append(outs)
    assert at == len(data), "the driver wrote more than the jobs asked for"
    return path_code, results


def build(tmp: Path, int8: str | None) -> Path:
    if shutil.which(CC) is None or shutil.which(QEMU) is None:
        reason = "needs the Debian packages gcc-aarch64-linux-gnu and qemu-user"
        record_variant("neon-dot", f"not run under qemu: {reason}")
        pytest.skip(f"aarch64 kernels: {reason}")
    flags = [f for f in cpu.FLAGS if f not in ("-march=native", "-shared", "-fPIC")]
    forced = [f"-DPDCHAT_INT8_PATH={[p.name for p in cpu.INT8_PATHS].index(int8)}"] if int8 else []
    exe = tmp / f"arm_driver_{int8 or 'best'}"
    done = subprocess.run([CC, *flags, "-march=armv8.2-a+dotprod", "-static", *forced,
                           f"-I{Path(cpu.SOURCE).parent}", str(DRIVER), "-o", str(exe), "-lm", "-lpthread"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return exe


@pytest.mark.parametrize("int8, expected_path", [(None, "neon-dot"), ("portable", "portable")])
def test_aarch64_kernels_match_the_reference_under_qemu(tmp_path, int8, expected_path):
    exe = build(tmp_path, int8)
    todo = jobs()
    write_jobs(tmp_path / "in.bin", todo)
    ran = subprocess.run([QEMU, str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    code, results = read_results(tmp_path / "out.bin", todo)
    assert cpu.INT8_PATHS[code].name == expected_path          # the default build takes the NEON path
    for job, outs in zip(todo, results):
        for got, want in zip(outs, job.expected):
            if job.max_rel is not None:
                assert (got - want).abs().max() < job.max_rel * want.abs().max(), f"op {job.op}"
            else:
                torch.testing.assert_close(got, want, **job.tol, msg=lambda m: f"op {job.op}: {m}")
    if expected_path == "neon-dot":
        record_variant("neon-dot", "built and tested under qemu-aarch64")
