"""The C CPU kernels against kernels.reference, in every variant this CPU runs (the `ops` fixture of
conftest.py), on the strided views and ragged batches the engine feeds them."""
from __future__ import annotations

import ctypes
import platform
import re
import shutil
import subprocess

import pytest
import torch

from pdchat import kernels
from pdchat.kernels import cpu, cpu_products, reference

from .batch import Batch

TOL = dict(atol=1e-5, rtol=1e-4)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def chose(monkeypatch, ops, what: str, in_c: bool) -> None:
    """Set this build's timed choice (cpu_products.chosen_once) of where `what` ("products",
    "attention") past the fast rows runs, for one test."""
    monkeypatch.setitem(cpu_products._IN_C, (ops.lib._name, what), in_c)


# 48 and 144: the fast rows of AVX-512 and of 256-bit x86 builds (pd_fast_rows); past them C or
# BLAS, as the machine's timing chose
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 8, 9, 12, 24, 40, 48, 64, 144, 145])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [192, 197])     # 197: the transposition's k past its blocks of 8
def test_linear_matches_reference(ops, rows, bias, width):
    x, w = rand(rows, width), rand(81, width, seed=1)      # an odd row count: the last one unpaired
    b = rand(81, seed=2) if bias else None
    torch.testing.assert_close(ops.linear(x, w, b), reference.linear(x, w, b), **TOL)


@pytest.mark.parametrize("rows", [5, 24, 40, 48])
def test_wide_outputs_go_by_spans_with_the_same_sums(ops, rows):
    """The strips' sums wait in a thread's buffer for a span of weight rows (OUTER_SPAN_ROWS) and
    reach y row by row: 1,101 outputs make several spans per thread and a ragged last one (not a
    whole block of 8), and each output still gets the sums it gets in a narrow product."""
    x, w, b = rand(rows, 192), rand(1101, 192, seed=1), rand(1101, seed=2)
    wide = ops.linear(x, w, b)
    torch.testing.assert_close(wide, reference.linear(x, w, b), **TOL)
    for lo, hi in ((0, 81), (1016, 1101)):
        assert torch.equal(wide[:, lo:hi], ops.linear(x, w[lo:hi].contiguous(), b[lo:hi].contiguous()))


def exact_blocks(N: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w, q, scales): w in the form of a GGUF Q8_0 matrix read as fp32, every 32 weights of a row
    an fp16 scale times integers in -127..127, each block reaching 127 in magnitude (as quantizing
    makes it)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-126, 127, (N, K // 32, 32), generator=g, dtype=torch.int8)
    q[:, :, 5] = torch.where(torch.rand(N, K // 32, generator=g) < 0.5, -127, 127).to(torch.int8)
    scales = (torch.rand(N, K // 32, generator=g) * 0.02 + 1e-3).half().float()
    w = (q.float() * scales[..., None]).view(N, K)
    return w, q.view(N, K), scales


# 0: a forward that samples no row (a prefill worker's); 1-3: a dot product a weight row at a time
# (4 too on AVX-512); from there the strips; 145: past every build's fast rows (in C by chunks of
# them, or BLAS on weights rebuilt a slice at a time).
def test_only_matrices_of_exact_blocks_are_held_as_them(ops):
    w = exact_blocks(8, 64)[0]
    assert ops.exact_int8_blocks(torch.zeros(4, 64)) is not None          # a block of zeros: scale 0
    assert ops.exact_int8_blocks(w[:, :48].contiguous()) is None          # rows not whole blocks
    assert ops.exact_int8_blocks(w[:, ::2]) is None                       # not contiguous
    assert ops.exact_int8_blocks(w.double()) is None
    step = w[3, 32:64].abs().max() / 127
    for spoil in (lambda v: torch.nextafter(v, torch.tensor(1.0)),       # one ulp off
                  lambda v: v + step / 2,                                 # half a step of its block
                  lambda v: -0.0 * v.abs()):                              # -0: an integer rebuilds +0
        bad = w.clone()
        bad[3, 40] = spoil(bad[3, 40])
        assert ops.exact_int8_blocks(bad) is None
    with pytest.raises(ValueError, match="whole blocks of 32"):      # rows the C code cannot take
        ops.linear_exact_int8(rand(1, 48), torch.zeros(1, 8, 48, dtype=torch.int8), torch.ones(1, 8, 1))


def exact_q4_blocks(N: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w, q, dm): w in the form of a GGUF Q4_1 matrix read as fp32, every 32 weights of a row
    d * u + m with an fp16 d and m and u in 0..15, each group reaching 0 and 15 (as quantizing
    makes it); q the nibbles (int4 layout), dm the (d, m) pairs."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (N, K // 32, 32), generator=g, dtype=torch.uint8)
    u[:, :, 3], u[:, :, 20] = 0, 15
    d = (torch.rand(N, K // 32, generator=g) * 0.01 + 1e-4).half().float()
    m = (-torch.rand(N, K // 32, generator=g) * 0.05).half().float()
    w = (u.float() * d[..., None] + m[..., None]).view(N, K)      # d * u exact: one rounding
    return w, reference.pack_int4(u.view(N, K)), torch.stack([d, m], dim=-1)


def fp32_products(ops, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
                  by_panels: bool) -> torch.Tensor:
    """What exact blocks' products give: ops.linear on their fp32 weights, where held by panels
    (every count of rows) each row's sums in k order, as the strips of 5 rows or more add them
    (fewer rows go by dot products in four chains there): the rows computed beside zero rows."""
    if not by_panels or x.shape[0] >= 5:
        return ops.linear(x, w, b)
    return ops.linear(torch.cat([x, x.new_zeros(5, x.shape[1])]), w, b)[:x.shape[0]]


@pytest.fixture
def fp32_sums(ops):
    """The build's exact blocks summed as its fp32 products sum them: off AMX tiles, where the build
    takes them there (pd_exact_amx: on again after the test, the default)."""
    ops.lib.pd_exact_amx(0)
    yield ops
    ops.lib.pd_exact_amx(1)


# Each form of exact blocks: the matrix maker, the ops' search and product, the reference's rebuild.
EXACT_FORMS = {
    "int8": (exact_blocks, "exact_int8_blocks", "linear_exact_int8", reference.dequantize_exact_int8),
    "q4": (exact_q4_blocks, "exact_q4_blocks", "linear_exact_q4", reference.dequantize_exact_q4),
}


@pytest.mark.parametrize("form", sorted(EXACT_FORMS))
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 40, 48, 145])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("many_in_c", [True, False])
@pytest.mark.parametrize("outputs", [83, 96])     # 96: whole panels of 16 (the panel products, AVX-512)
def test_exact_blocks_give_the_fp32_products_bit_for_bit(fp32_sums, form, rows, bias, many_in_c, outputs, monkeypatch):
    ops = fp32_sums
    make, find, product, rebuild = EXACT_FORMS[form]
    chose(monkeypatch, ops, "products", many_in_c)
    w, q, scales = make(outputs, 192, seed=rows)
    found = getattr(ops, find)(w)
    assert found is not None and all(map(torch.equal, reference.exact_rows(*found), (q, scales)))
    assert torch.equal(rebuild(q, scales), w)
    x, b = rand(rows, 192, seed=1), rand(outputs, seed=2) if bias else None
    got = getattr(ops, product)(x, *found, b)
    if rows <= ops.fast_rows.limit or many_in_c:
        assert torch.equal(got, fp32_products(ops, x, w, b, by_panels=found[0].shape[0] == 2))
    else:
        torch.testing.assert_close(got, reference.linear(x, w, b), **TOL)
    torch.testing.assert_close(got, reference.linear(x, rebuild(q, scales), b), **TOL)


AMX_MIN_ROWS = 4        # cpu_amx.h: fewer rows stay on the AVX-512 panels


def on_tiles(ops) -> bool:
    """Whether this build puts exact blocks on AMX tiles (x86 with AMX and AVX-512 BF16, Linux granting the tiles)."""
    return bool(ops.lib.pd_exact_amx(-1))


def test_exact_blocks_go_on_amx_tiles_only_where_the_cpu_has_them(ops):
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu.cpu_flags():
        assert not on_tiles(ops)
    was = on_tiles(ops)
    assert ops.lib.pd_exact_amx(0) == 0
    assert ops.lib.pd_exact_amx(1) == was


@pytest.mark.parametrize("form", sorted(EXACT_FORMS))
@pytest.mark.parametrize("bias", [False, True])
def test_exact_blocks_on_amx_tiles_sum_each_row_alone_within_fp32_rounding(ops, form, bias):
    """On AMX tiles from AMX_MIN_ROWS rows (activations as three exact bf16 parts, each group's
    products summed by the tile, its scale applied in fp32): a row's results are the same bits
    whatever rows share its product and wherever it sits among them, and as close to the exact
    sums as the fp32 products' are; fewer rows keep the fp32 products' bits."""
    if not on_tiles(ops):
        pytest.skip("no AMX tiles in this build (an x86 CPU with amx_tile, amx_bf16 and avx512_bf16, "
                    "and Linux granting the tiles)")
    make, find, product, _ = EXACT_FORMS[form]
    w, _, _ = make(96, 320, seed=11)
    held = getattr(ops, find)(w)
    x, b = rand(150, 320, seed=3), rand(96, seed=4) if bias else None
    full = getattr(ops, product)(x, *held, b)
    for rows in (AMX_MIN_ROWS, 5, 16, 17, 40):
        assert torch.equal(getattr(ops, product)(x[:rows].contiguous(), *held, b), full[:rows])
    assert torch.equal(getattr(ops, product)(x[61:66].contiguous(), *held, b), full[61:66])
    for rows in range(1, AMX_MIN_ROWS):
        assert torch.equal(getattr(ops, product)(x[:rows].contiguous(), *held, b),
                           fp32_products(ops, x[:rows], w, b, by_panels=True))
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    scale = x.double().abs() @ w.double().abs().T          # the size of what each sum adds
    ops.lib.pd_exact_amx(0)
    try:
        fp32 = getattr(ops, product)(x, *held, b)
    finally:
        ops.lib.pd_exact_amx(1)
    assert not torch.equal(full, fp32)                     # the tiles did the sums
    tiles_error = ((full.double() - exact).abs() / scale).max().item()
    fp32_error = ((fp32.double() - exact).abs() / scale).max().item()
    assert tiles_error <= max(fp32_error, 2 ** -24)        # (a part of x left out: ~2^-17 or worse)


def test_exact_q4_blocks_rebuild_for_blas_as_the_reference_does(ops):
    w, q, dm = exact_q4_blocks(37, 96, seed=5)
    out = torch.empty(37, 96)
    ops.lib.pd_unpack_exact_q4(q.data_ptr(), dm.data_ptr(), out.data_ptr(), 37, 96, 2)
    assert torch.equal(out, w)


def test_only_matrices_of_exact_q4_blocks_are_held_as_them(ops):
    w, _, dm = exact_q4_blocks(8, 64)
    flat = ops.exact_q4_blocks(torch.full((4, 64), 0.375))                 # one value a group: d = 0
    assert flat is not None and torch.equal(reference.exact_rows(*flat)[1][..., 0], torch.zeros(4, 2))
    fp32_d = w.clone()                              # a d of 16 significant bits, not fp16's 11: d * u still exact
    fp32_d[0, :32] = torch.arange(32).remainder(16).float() * ((1 + 2 ** -15) / 64) - 0.5
    assert ops.exact_q4_blocks(fp32_d) is not None
    assert ops.exact_q4_blocks(w[:, :48].contiguous()) is None             # rows not whole groups
    assert ops.exact_q4_blocks(w[:, ::2]) is None                          # not contiguous
    assert ops.exact_q4_blocks(w.double()) is None
    step = dm[3, 1, 0]
    for spoil in (lambda v: torch.nextafter(v, torch.tensor(1.0)),        # one ulp off
                  lambda v: v + step / 2,                                  # half a step of its group
                  lambda v: v + 16 * step):                                # past u = 15
        bad = w.clone()
        bad[3, 40] = spoil(bad[3, 40])
        assert ops.exact_q4_blocks(bad) is None
    wide = w.clone()         # d * u not exact in fp32 (d of 24 bits): a fused rebuild would round once, not twice
    d = torch.tensor((1.0 + 2.0 ** -23) / 1024)    # 3 * d needs 25 bits
    wide[5, :32] = (torch.arange(32).remainder(16).float() * d).to(torch.float32)
    assert ops.exact_q4_blocks(wide) is None
    negative_zero = torch.zeros(2, 32)
    negative_zero[1, 7] = -0.0                       # a -0 beside +0s: d = 0 rebuilds +0
    assert ops.exact_q4_blocks(negative_zero) is None
    with pytest.raises(ValueError, match="whole blocks of 32"):
        ops.linear_exact_q4(rand(1, 48), torch.zeros(1, 8, 24, dtype=torch.uint8), torch.ones(1, 8, 1, 2))


def test_exact_blocks_are_held_by_panels_where_the_build_multiplies_by_them(ops):
    """x86 builds with AVX2 and FMA hold a matrix of whole panels (16 outputs) a second time by
    panels, for the products the strips took (from 4 or 5 rows); the rows' layout stays first (the decode
    rows, BLAS)."""
    panels = {"avx2", "fma"} <= cpu.cpu_flags() and platform.machine().lower() in ("x86_64", "amd64")
    assert bool(ops.lib.pd_exact_panels(48)) == panels and not ops.lib.pd_exact_panels(40)
    w, q, dm = exact_q4_blocks(48, 64, seed=3)
    held = ops.exact_q4_blocks(w)
    assert held[0].shape == (2 if panels else 1, 48, 32) and held[1].shape == (2 if panels else 1, 48, 2, 2)
    assert ops.exact_q4_blocks(w[:40].contiguous())[0].shape[0] == 1      # not whole panels: rows only
    w8, q8, s8 = exact_blocks(48, 64, seed=4)
    held8 = ops.exact_int8_blocks(w8)
    assert held8[0].shape == (2 if panels else 1, 48, 64) and held8[1].shape == (2 if panels else 1, 48, 2)
    if panels:         # panel 1's group 0
        u = reference.unpack_int4(q).view(48, 2, 32)   # Q4: output 16 + j's weights at k = 2i and 2i + 1 in byte 16i + j
        assert torch.equal(held[0][1].view(-1)[2 * 256:3 * 256], (u[16:32, 0, 0::2] | u[16:32, 0, 1::2] << 4).T.reshape(-1))
        assert torch.equal(held[1][1].view(-1)[2 * 32:3 * 32], torch.cat([dm[16:32, 0, 0], dm[16:32, 0, 1]]))
        assert torch.equal(held8[0][1].view(-1)[2 * 512:3 * 512], q8[16:32, :32].T.reshape(-1))   # int8: k-major
        assert torch.equal(held8[1][1].view(-1)[2 * 16:3 * 16], s8[16:32, 0])


def builds_the_choice(choice: str) -> bool:
    """Whether this CPU's build has the choice pd_outer_choose times: how 48 rows go and whether
    rows past 16 go by whole strips of 16 (AVX-512 builds), or whether the 8 rows past the strips
    of 16 pair their weight blocks (256-bit x86)."""
    flags = cpu.cpu_flags()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if choice in ("narrow_48", "pad_16"):
        return "avx512f" in flags
    return "avx" in flags and "avx512f" not in flags


@pytest.mark.parametrize("choice,rows", [("narrow_48", 41), ("narrow_48", 48), ("pad_16", 17), ("pad_16", 24),
                                         ("pad_16", 40), ("pair_8", 24), ("pair_8", 40)])
def test_the_choices_timed_at_load_give_the_same_sums_either_way(ops, choice, rows):
    """pd_outer_choose picks by time how 48 rows go (one strip or three), whether 17-48 rows go by
    whole strips of 16 (the rows past them zero) and whether the last 8 rows take two weight
    blocks at once; either way each sum adds its k in order, so a choice changes the speed and
    never a bit of the result."""
    lib = ops.lib
    setting = getattr(lib, f"pd_outer_{choice}")
    x, w = rand(rows, 192), rand(81, 192, seed=1)      # 81: pairs of 6-row blocks and a lone last one
    # pd_outer_choose below times every choice again: each is put back as the ops were built with
    # it (a close call flipped pad_16, and the next test's fast rows no longer matched the build's)
    chosen = {name: getattr(lib, f"pd_outer_{name}")(-1) for name in ("narrow_48", "pad_16", "pair_8")}
    built = builds_the_choice(choice)
    try:
        got = []
        for value in (0, 1):
            setting(value)
            got.append(ops.linear(x, w))
        assert setting(-1) == (1 if built else -1)           # (-1: a build without that choice)
        assert torch.equal(got[0], got[1])
        torch.testing.assert_close(got[0], reference.linear(x, w), **TOL)
        # (bits: how 48 rows go and the strips of 16 on AVX-512 builds, the pairs on 256-bit ones)
        bits = 2 if builds_the_choice("pad_16") else 1 if builds_the_choice("pair_8") else 0
        assert lib.pd_outer_choose() in range(1 << bits)
    finally:
        for name, value in chosen.items():
            getattr(lib, f"pd_outer_{name}")(value)


def test_a_row_gets_the_same_sums_whatever_strips_its_product_takes(ops):
    """From a few rows (OUTER_MIN_ROWS in cpu_kernels.c, 5 at most) the product goes by strips of
    8, 16, 24, 32 or 48 rows as the row count makes them; each sum adds its k in order in any strip,
    so a row's result does not depend on how many rows share its step (a prompt slice of any
    size, any number of streams beside it), up to the build's fast rows."""
    limit = ops.fast_rows.limit
    x, w, b = rand(limit, 192), rand(81, 192, seed=1), rand(81, seed=2)
    whole = ops.linear(x, w, b)
    for rows in range(5, limit):
        assert torch.equal(ops.linear(x[:rows], w, b), whole[:rows]), rows


def test_the_fast_rows_follow_the_build(ops):
    """One C call up to 48 rows with AVX-512 (three vectors of 16) and on targets not measured,
    144 on x86 builds of 256-bit vectors, where BLAS at a few dozen rows was far slower (README);
    the products' cost rises by the panels' tiles where exact blocks go by panels (16 rows with
    AVX-512, 8 with AVX2), else by 8 rows, or by 16 where the rows past 16 go by strips of 16."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = cpu.cpu_flags()
    wide = x86 and "avx2" in flags and "avx512f" not in flags
    if x86 and {"avx2", "fma"} <= flags:
        granule = 16 if "avx512f" in flags else 8
    else:
        granule = 16 if ops.lib.pd_outer_pad_16(-1) == 1 else 8
    assert ops.fast_rows == kernels.FastRows(144 if wide else 48, granule)
    assert ops.lib.pd_row_granule() == granule
    assert min(ops.quant_max_rows.values()) >= ops.fast_rows.limit


def test_products_past_the_fast_rows_go_where_the_machine_chose(ops, monkeypatch):
    """Past the fast rows a product is BLAS's, or the C code's by chunks of the fast rows, where
    each row gets the sums it gets in a small product (the same bits whatever the prompt's length
    or slicing)."""
    limit = ops.fast_rows.limit
    x, w, b = rand(2 * limit + 13, 64), rand(32, 64, seed=1), rand(32, seed=2)
    chose(monkeypatch, ops, "products", False)
    assert torch.equal(ops.linear(x, w, b), reference.linear(x, w, b))
    chose(monkeypatch, ops, "products", True)
    got = ops.linear(x, w, b)
    torch.testing.assert_close(got, reference.linear(x, w, b), **TOL)
    for lo, hi in ((0, 5), (limit - 3, limit + 9), (2 * limit, 2 * limit + 13)):
        assert torch.equal(got[lo:hi], ops.linear(x[lo:hi], w, b)), (lo, hi)


def test_a_choice_goes_to_the_faster_run_on_its_best_times():
    now = [0.0]
    costs = {"c": [9.0, 2.0, 2.5, 2.2], "blas": [1.0, 3.0, 2.1, 2.4]}   # the first round is left out

    def run(name):
        return lambda: now.__setitem__(0, now[0] + costs[name].pop(0))
    assert cpu_products.faster_in_c(run("c"), run("blas"), clock=lambda: now[0])
    costs = {"c": [1.0, 3.0, 2.2, 2.4], "blas": [9.0, 2.0, 2.5, 2.1]}
    assert not cpu_products.faster_in_c(run("c"), run("blas"), clock=lambda: now[0])


def test_a_choice_is_timed_once_per_build(ops, monkeypatch):
    monkeypatch.setattr(cpu_products, "_IN_C", {})
    made = []

    def make_runs():
        made.append(1)
        return (lambda: None), (lambda: None)
    first = cpu_products.chosen_once(ops.lib, "a test", make_runs)
    assert cpu_products.chosen_once(ops.lib, "a test", make_runs) == first and len(made) == 1
    assert ops._in_c(ops.fast_rows.limit) and not cpu_products._IN_C.get((ops.lib._name, "products"))
    long_attention, long_products = ops.long_attention_in_c(), ops._in_c(10 ** 4)     # timed here, kept
    assert set(cpu_products._IN_C) == {(ops.lib._name, w) for w in ("a test", "attention", "products")}
    assert (cpu_products._IN_C[(ops.lib._name, "attention")], cpu_products._IN_C[(ops.lib._name, "products")]) \
        == (long_attention, long_products)


# 1 and 5: dot-product kernels; 16 and 33: the outer-product one on AVX-512 VNNI and AVX-VNNI,
# on AVX2 the fp32 one on unpacked weights; 53: the integer one on AVX-512 VNNI, BLAS on unpacked
# weights on other AVX-512 builds, as 33 elsewhere; 153 and 300: past every build's fast rows.
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 53, 153, 300])
def test_int8_product_is_as_exact_as_fp32_activations(ops, rows):
    w = rand(96, 256, seed=3) * torch.linspace(0.1, 4, 96)[:, None]
    q, scales = quantize(w)
    x = rand(rows, 256, seed=4)
    x[:, 7] *= 50                                   # an outlier channel, as LLM activations have
    packed, packed_scales = ops.pack_int8(q, scales, torch.float32)
    assert packed.dtype == torch.uint8
    bias = rand(96, seed=5)
    exact = x @ (q.float() * scales[:, None]).T + bias
    got = ops.linear_int8(x, packed, packed_scales, bias)
    # Two-part int8 activations: error ~1e-5 of the row's largest value (one part alone: ~4e-3).
    assert (got - exact).abs().max() < 1e-4 * exact.abs().max()
    back_q, back_scales = ops.unpack_int8(packed, packed_scales)
    assert torch.equal(back_q, q) and torch.equal(back_scales, scales)


def test_int8_product_at_full_scale_is_exact(ops):
    """Every weight and activation at +-127: a pair of products is 2 * 127 * 127 = 32,258, the
    most a 16-bit lane (AVX2's maddubs) must hold; integer sums are exact, so the result is too."""
    signs = torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0)
    w = torch.stack([signs, -signs, torch.ones(128), -torch.ones(128)]) * 0.5
    q, scales = quantize(w)
    assert q.abs().min() == 127
    x = torch.stack([torch.full((128,), 2.0), signs * 3.0, -signs])     # each block at +-its maximum
    packed, packed_scales = ops.pack_int8(q, scales, torch.float32)
    exact = x.double() @ (q.double() * scales.double()[:, None]).T
    got = ops.linear_int8(x, packed, packed_scales)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-5)


def test_int8_width_not_a_multiple_of_64_uses_aten(ops):
    q, scales = quantize(rand(16, 40))
    packed, packed_scales = ops.pack_int8(q, scales, torch.float32)
    assert packed.dtype == torch.int8                # the reference layout
    x = rand(2, 40, seed=1)
    torch.testing.assert_close(ops.linear_int8(x, packed, packed_scales),
                               reference.linear_int8(x, packed, packed_scales))


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from pdchat.engine.quant import quantize_int8
    return quantize_int8(w)


def quantize4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from pdchat.engine.quant import quantize_int4
    return quantize_int4(w)


def int4_product_in_integers(x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """What the C int4 product computes, in float64: activations to int8 in blocks of 32 (round
    half to even, as lrintf), then per group d * xs * <u, xq> + m * xs * sum(xq)."""
    G = reference.INT4_GROUP
    M, K = x.shape
    blocks = x.double().view(M, K // G, G)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    xs = (amax.float() / 127).double()
    xq = torch.round(blocks * torch.where(amax > 0, 127 / amax.float(), 0).double())
    u = reference.unpack_int4(packed).double().view(packed.shape[0], K // G, G)
    d, m = params.double().unbind(dim=2)
    dots = torch.einsum("mgi,ngi->mng", xq, u)
    return (dots * d[None] * xs[:, None, :, 0] + m[None] * (xs[..., 0] * xq.sum(dim=2))[:, None]).sum(dim=2)


def test_int4_round_trip_is_within_half_a_step_of_each_group():
    w = rand(48, 256, seed=3) * torch.linspace(0.01, 3, 48)[:, None] + 0.2    # off-centre groups
    packed, params = quantize4(w)
    assert packed.shape == (48, 128) and params.shape == (48, 8, 2) and params.dtype == torch.bfloat16
    back = reference.dequantize_int4(packed, params, torch.float32)
    step = params[:, :, 0].float().repeat_interleave(reference.INT4_GROUP, dim=1)
    # Half a step, plus what bf16's rounding of the step can cost at the top of the range.
    assert ((back - w).abs() <= 0.55 * step + 1e-6).all()
    u = reference.unpack_int4(packed)
    assert torch.equal(reference.pack_int4(u), packed) and u.max() == 15 and u.min() == 0


# whole tiles of 4 rows and ragged ends; from 8 rows the outer-product kernel on (AVX-512) VNNI;
# "fast": the build's fast rows, the most that every build multiplies in integers
@pytest.mark.parametrize("rows", [1, 4, 5, 7, 8, 17, 33, 48, "fast"])
def test_int4_product_is_exact_integer_arithmetic(ops, rows):
    rows = ops.fast_rows.limit if rows == "fast" else rows
    w = rand(80, 320, seed=3) * torch.linspace(0.1, 4, 80)[:, None]
    packed, params = quantize4(w)
    x = rand(rows, 320, seed=4)
    x[:, 7] *= 50                                   # an outlier channel: it spoils its block only
    bias = rand(80, seed=5)
    got = ops.linear_int4(x, packed, params, bias)
    want = int4_product_in_integers(x, packed, params) + bias.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
    # And close to the product with fp32 activations (one-part int8 activations: ~1e-2).
    exact = reference.linear_int4(x, packed, params, bias)
    assert (got - exact).abs().max() < 2e-2 * exact.abs().max()


@pytest.mark.parametrize("out_rows", [1, 3, 83])
def test_int4_decode_of_any_number_of_weight_rows(ops, out_rows):
    """A decode takes weight rows four at a time where the path has a decode kernel: counts that
    are not a multiple of four (the last rows of the matrix, of a thread's share) and widths with
    two groups past the last block of four (320 = 10 groups) give each row its own product."""
    w = rand(out_rows, 320, seed=13) * torch.linspace(0.1, 4, out_rows)[:, None]
    packed, params = quantize4(w)
    x, bias = rand(1, 320, seed=14), rand(out_rows, seed=15)
    want = int4_product_in_integers(x, packed, params) + bias.double()
    got = ops.linear_int4(x, packed, params, bias)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_int4_product_at_the_extremes_is_exact(ops):
    """Weights at 0 and 15 only and activations at +-127 of their block: maddubs pairs reach
    2 * 15 * 127, the integer sums stay exact, and so does the result."""
    K = 128
    u = torch.where(torch.arange(K) % 2 == 0, 15, 0).to(torch.uint8).repeat(6, 1)
    u[3] = 15 - u[3]
    params = torch.tensor([[0.5, -3.0]], dtype=torch.bfloat16).repeat(6, K // reference.INT4_GROUP, 1)
    packed = reference.pack_int4(u)
    signs = torch.where(torch.arange(K) % 3 == 0, -1.0, 1.0)
    x = torch.stack([torch.full((K,), 2.0), signs * 3.0, -signs])
    want = x.double() @ reference.dequantize_int4(packed, params, torch.float64).T
    torch.testing.assert_close(ops.linear_int4(x, packed, params).double(), want, rtol=1e-6, atol=1e-4)


def test_int4_rows_of_any_width_are_computed(ops):
    """A row's params are widened inside the product loop, so no width is too wide for the
    kernel (it once kept a row's params on its stack and refused rows over 64K)."""
    K = 65536 + 128
    w, x = rand(2, K, seed=11) * 0.02, rand(1, K, seed=12)
    packed, params = quantize4(w)
    want = int4_product_in_integers(x, packed, params)
    torch.testing.assert_close(ops.linear_int4(x, packed, params).double(), want, rtol=1e-5,
                               atol=1e-4 * want.abs().max().item())


def quantized_product(ops, fmt: str, w: torch.Tensor, bias: torch.Tensor):
    """x -> x @ w^T + bias on w quantized to `fmt` as the engine stores it, and that stored form."""
    if fmt == "int8":
        packed, scales = ops.pack_int8(*quantize(w), torch.float32)
        return (lambda v: ops.linear_int8(v, packed, scales, bias)), packed, scales
    packed, params = quantize4(w)
    return (lambda v: ops.linear_int4(v, packed, params, bias)), packed, params


@pytest.mark.parametrize("rows,width", [(6, 320), (8, 320), (17, 320), ("fast", 320), ("fast", 16384)])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_prefill_slice_gets_the_numbers_of_its_rows_one_by_one(ops, fmt, rows, width):
    """Up to the build's fast rows ("fast": all of them) the builds multiply quantized weights in
    integers, by whichever kernel suits the row count (AVX-512 VNNI and AVX-VNNI: an outer-product
    one from 8 rows, which at 16,384 wide takes the rows in two panels; AVX2's int4 from 6):
    the same quantized activations and exact integer sums as a decode's, so a prompt slice and the
    same tokens decoded one at a time agree to float rounding. AVX2's int8 from pd_u8_dequant_rows()
    on multiplies fp32 activations instead (its integer product is slower than fp32 there): exact to
    fp32, the decode within its ~1e-5."""
    rows = ops.fast_rows.limit if rows == "fast" else rows
    w = rand(37, width, seed=21) * torch.linspace(0.1, 2, 37)[:, None] * 0.05    # 37: a ragged tile
    x, bias = rand(rows, width, seed=22), rand(37, seed=23)
    x[:, 5] *= 40
    product, packed, scales = quantized_product(ops, fmt, w, bias)
    together = product(x)
    one_by_one = torch.cat([product(x[i:i + 1]) for i in range(rows)])
    dequantized_from = ops.lib.pd_u8_dequant_rows() if fmt == "int8" else 0
    if dequantized_from and rows >= dequantized_from:
        q, q_scales = ops.unpack_int8(packed, scales)
        exact = x.double() @ (q.double() * q_scales.double()[:, None]).T + bias.double()
        assert (together.double() - exact).abs().max() < 5e-6 * exact.abs().max()     # fp32 rounding
        assert (one_by_one.double() - exact).abs().max() < 1e-4 * exact.abs().max()
    else:
        assert (together - one_by_one).abs().max() < 2e-6 * one_by_one.abs().max()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_whole_prompt_in_integers_gets_the_numbers_of_its_rows_one_by_one(ops, fmt):
    """Where a build multiplies whole prompts in integers (pd_quant_max_rows: the VNNI ones, and
    AVX2's int4), its tiles go by panels of activation rows, blocks of 64 weight rows and chunks of
    512 bytes of K, with the sums kept between chunks. 150 rows (panels of 32 int8 rows at this
    width, 96 int4), 133 weight rows (three blocks, the last with a ragged tile: one thread takes
    them all) and a width of 4,160 (eight chunks and a short one) still give every row what it gets
    decoded alone."""
    rows, width, out_rows = 150, 4160, 133
    if ops.quant_max_rows[fmt] < rows:
        pytest.skip("this build multiplies long prompts on weights unpacked for BLAS (the next test)")
    w = rand(out_rows, width, seed=31) * torch.linspace(0.1, 2, out_rows)[:, None] * 0.05
    x, bias = rand(rows, width, seed=32), rand(out_rows, seed=33)
    product, _, _ = quantized_product(ops, fmt, w, bias)
    one_by_one = torch.cat([product(x[i:i + 1]) for i in range(rows)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # two threads would split the rows into ranges of 16
    try:
        together = product(x)
    finally:
        torch.set_num_threads(threads)
    assert (together - one_by_one).abs().max() < 2e-6 * one_by_one.abs().max()


@pytest.mark.parametrize("slice_rows", [None, 7])          # None: one slice; 7: eleven and a ragged end
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_prefill_sized_quantized_products_unpack_to_blas_slice_by_slice(ops, fmt, slice_rows, monkeypatch):
    limit = ops.quant_max_rows[fmt]
    if limit >= 1 << 20:
        pytest.skip(f"this build multiplies {fmt} weights in integers at every row count (pd_quant_max_rows)")
    if slice_rows is not None:
        monkeypatch.setattr(cpu_products, "UNPACK_FLOATS", 192 * slice_rows)
    w, bias = rand(80, 192, seed=6), rand(80, seed=8)
    x = rand(limit + 3, 192, seed=7)
    if fmt == "int4":
        packed, params = quantize4(w)
        for _ in range(2):                                        # the second call reuses the buffer
            torch.testing.assert_close(ops.linear_int4(x, packed, params, bias),
                                       reference.linear_int4(x, packed, params, bias), rtol=1e-5, atol=1e-5)
    else:
        q, scales = quantize(w)
        q8, s8 = ops.pack_int8(q, scales, torch.float32)
        for _ in range(2):
            torch.testing.assert_close(ops.linear_int8(x, q8, s8, bias), x @ (q.float() * scales[:, None]).T + bias,
                                       rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("T", [5, 40])
def test_norms_match_reference(ops, T):
    x, delta, w = rand(T, 96), rand(T, 96, seed=1), rand(96, seed=2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), **TOL)
    want_sum, want_norm = reference.add_rms_norm(x, delta, w, 1e-6)
    got_sum, got_norm = ops.add_rms_norm(x.clone(), delta, w, 1e-6)
    torch.testing.assert_close(got_sum, want_sum, **TOL)
    torch.testing.assert_close(got_norm, want_norm, **TOL)


@pytest.mark.parametrize("T", [6, 33])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (8, 2, 16)])
def test_rope_on_views_of_a_fused_projection(ops, heads, kv_heads, head_dim, T):
    qkv = rand(T, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(T, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    check_rope(ops, q, k, seed=1)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)   # v untouched


def check_rope(ops, q: torch.Tensor, k: torch.Tensor, seed: int) -> None:
    """ops.rope in place on q and k against the reference, at random angles."""
    angles = rand(q.shape[0], q.shape[2] // 2, seed=seed)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    want_q, want_k = reference.rope(q.clone(), k.clone(), cos, sin)
    got_q, got_k = ops.rope(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(got_k, want_k, **TOL)


@pytest.mark.parametrize("T", [3, 20])
def test_silu_mul_matches_reference(ops, T):
    gate_up = rand(T, 2 * 48) * 4
    gate_up[0, :6] = torch.tensor([-100.0, -87.5, -20.0, 20.0, 88.5, 100.0])   # exp's clamped range
    torch.testing.assert_close(ops.silu_mul(gate_up), reference.silu_mul(gate_up), **TOL)


def test_prefill_sized_elementwise_runs_split_over_threads_alike(ops):
    """Above 2^18 elements the elementwise kernels split tokens over the pool's threads."""
    assert torch.get_num_threads() >= 2, "the split needs two threads"
    T, D = 70, 4096
    x, delta, w = rand(T, D), rand(T, D, seed=1), rand(D, seed=2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), **TOL)
    want_sum, want_norm = reference.add_rms_norm(x, delta, w, 1e-6)
    got_sum, got_norm = ops.add_rms_norm(x.clone(), delta, w, 1e-6)
    torch.testing.assert_close(got_sum, want_sum, **TOL)
    torch.testing.assert_close(got_norm, want_norm, **TOL)
    gate_up = rand(T, 2 * D) * 4
    torch.testing.assert_close(ops.silu_mul(gate_up), reference.silu_mul(gate_up), **TOL)
    heads, kv_heads, head_dim = 32, 8, 128
    check_rope(ops, rand(T, heads, head_dim, seed=3), rand(T, kv_heads, head_dim, seed=4), seed=5)


def test_store_kv_skips_padding_slots_and_reads_strided_rows(ops):
    qkv = rand(4, 3 * 2 * 8)
    k = qkv[:, 16:32].view(4, 2, 8)
    v = qkv[:, 32:].view(4, 2, 8)
    slots = torch.tensor([5, -1, 0, 11])
    caches = [torch.zeros(3, 4, 2, 8) for _ in range(4)]
    reference.store_kv(k, v, caches[0], caches[1], slots)
    ops.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].view(-1, 2, 8)[1:5].abs().sum() == 0     # the skipped row wrote nothing


def check_attention(ops, qlens: list[int], clens: list[int], kv_heads: int, group: int, head_dim: int,
                    block_size: int, seed: int = 0) -> None:
    """ops' paged attention over a ragged batch against the reference's."""
    batch = Batch(qlens, clens, kv_heads, group, head_dim, block_size=block_size, dtype=torch.float32, seed=seed)
    scale = head_dim ** -0.5
    out = ops.paged_attention(*batch.args("cpu"), scale, query_lens_host=qlens, context_lens_host=clens)
    torch.testing.assert_close(out, batch.expected(scale), **TOL)


@pytest.mark.parametrize("qlens,clens", [
    ([1], [1]),                                     # first decode step
    ([1, 1, 1], [17, 3, 40]),                       # decode batch, ragged contexts
    ([5, 1, 16], [5, 33, 48]),                      # prefill from scratch, decode, 16-token verify
    ([3, 2], [20, 2]),                              # chunks over a cached prefix
])
@pytest.mark.parametrize("kv_heads,group,head_dim", [(2, 1, 16), (1, 4, 32), (3, 3, 64)])
def test_paged_attention_matches_reference(ops, qlens, clens, kv_heads, group, head_dim):
    check_attention(ops, qlens, clens, kv_heads, group, head_dim, block_size=8)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads,group,head_dim", [(3, 3, 64), (2, 4, 40), (1, 8, 16)])
def test_tiled_attention_over_full_key_tiles_matches_reference(ops, block_size, kv_heads, group, head_dim):
    # Blocks of 16 keys or more give the tile kernel full tiles (its unrolled path); a prefill
    # slice over a long cached prefix, a short prompt from scratch, a decode and a 4-query verify.
    qlens, clens = [37, 6, 1, 4], [300, 6, 50, 77]
    assert all(map(ops.attention_in_c, qlens))
    check_attention(ops, qlens, clens, kv_heads, group, head_dim, block_size=block_size)


@pytest.mark.parametrize("kv_heads,group,head_dim", [
    (3, 3, 64),     # the default model's heads (an inlined head size)
    (2, 7, 64),     # Qwen2.5-0.5B's group
    (1, 12, 128),   # a group past the 8 heads taken at once, the other inlined head size
    (2, 4, 40),     # a head size 16 does not divide: its last chunk padded
    (4, 2, 24),
])
def test_decodes_and_short_verifies_over_long_contexts_match_reference(ops, kv_heads, group, head_dim):
    # Sequences of 1-3 queries go one (token, KV head) at a time over the whole context, keys
    # fetched ahead: contexts of many blocks, one ending mid-block, one shorter than a block.
    check_attention(ops, [1, 3, 1, 2, 1], [700, 301, 5, 129, 16], kv_heads, group, head_dim, block_size=16, seed=7)


@pytest.mark.parametrize("kv_heads,group,head_dim,context", [
    (3, 3, 64, 700),     # the default model: its 3 (token, KV head) items would load two threads 2 : 1
    (3, 3, 64, 513),     # ranges that do not end on a block
    (1, 12, 128, 1500),
    (2, 4, 40, 900),     # two items fill two threads: not split
    (3, 3, 64, 511),     # too few keys to split
])
def test_a_lone_decode_split_by_keys_over_two_threads_matches_reference(ops, kv_heads, group, head_dim, context):
    # Too few (token, KV head) items to fill the threads evenly: each token's keys go in ranges,
    # their partial sums merged afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = Batch([1], [context], kv_heads, group, head_dim, block_size=16, dtype=torch.float32, seed=3)
        scale = head_dim ** -0.5
        out = ops.paged_attention(*batch.args("cpu"), scale, query_lens_host=[1], context_lens_host=[context])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, batch.expected(scale), **TOL)


@pytest.mark.parametrize("qlens,clens,kv_heads,group,head_dim", [
    ([15], [1000], 3, 3, 64),          # the default model's slice: its 3 passes would load two threads 2 : 1
    ([15, 1], [1000, 700], 3, 3, 64),  # a slice beside a decode: each split, the parts merged apart
    ([15], [530], 3, 3, 64),           # ranges that do not end on a block, the queries near the second
    ([20], [1500], 1, 12, 128),        # 15 tiles (5 passes) of a group past 8 heads
    ([16], [900], 2, 4, 40),           # 8 tiles in 4 passes fill two threads: not split
    ([15], [511], 3, 3, 64),           # too few keys to split
])
def test_a_slice_split_by_keys_over_two_threads_matches_reference(ops, qlens, clens, kv_heads, group, head_dim):
    # A prefill slice's passes of tiles too few to fill the threads evenly: each pass's keys go in
    # ranges, their partial sums merged afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = Batch(qlens, clens, kv_heads, group, head_dim, block_size=16, dtype=torch.float32, seed=5)
        scale = head_dim ** -0.5
        out = ops.paged_attention(*batch.args("cpu"), scale, query_lens_host=qlens, context_lens_host=clens)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, batch.expected(scale), **TOL)


def test_a_rows_attention_is_the_same_whatever_tile_it_falls_in(ops):
    # The default model's heads (GQA of 3): a 7-token slice's 21 rows are a tile of 16 and 5 rows
    # (one vector's work where tiles have two), while the same queries as the last 7 of an
    # 11-token slice fall at rows 12-32 (tiles of 16, 16 and 1). Each row's sums are its own, so on
    # one thread (no keys split between threads) the results are the same bits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batch = Batch([11], [300], 3, 3, 64, block_size=16, dtype=torch.float32, seed=9)
        q, k_cache, v_cache, tables, starts, lens = batch.args("cpu")
        whole = ops.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.125,
                                    query_lens_host=[11], context_lens_host=[300])
        last = ops.paged_attention(q[4:], k_cache, v_cache, tables, torch.tensor([0, 7], dtype=torch.int32), lens,
                                   0.125, query_lens_host=[7], context_lens_host=[300])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(last, whole[4:])
    torch.testing.assert_close(whole, batch.expected(0.125), **TOL)


@pytest.mark.parametrize("long_in_c", [True, False])
def test_long_query_runs_go_where_the_machine_chose(ops, long_in_c, monkeypatch):
    chose(monkeypatch, ops, "attention", long_in_c)
    qlens = [ops.fast_rows.limit + 16]
    assert ops.attention_in_c(qlens[0]) == long_in_c
    batch = Batch(qlens, qlens, 1, 2, 16, block_size=8, dtype=torch.float32)
    out = ops.paged_attention(*batch.args("cpu"), 0.25)
    if long_in_c:
        torch.testing.assert_close(out, batch.expected(0.25), **TOL)
    else:
        assert torch.equal(out, batch.expected(0.25))           # flash SDPA's own result


def test_mixed_step_sends_each_sequence_to_its_kernel(ops, monkeypatch):
    # decodes (C), a long chunk (SDPA, where the machine chose it), a verify (C), a verify over a
    # long context (C, by tiles)
    chose(monkeypatch, ops, "attention", False)
    qlens, clens = [1, ops.fast_rows.limit + 16, 4, 1, 9], [30, 300, 90, 7, 1900]
    assert list(map(ops.attention_in_c, qlens)) == [True, False, True, True, True]
    batch = Batch(qlens, clens, 2, 3, 32, block_size=8, dtype=torch.float32)
    out = ops.paged_attention(*batch.args("cpu"), 0.2, query_lens_host=qlens, context_lens_host=clens)
    torch.testing.assert_close(out, batch.expected(0.2), **TOL)


@pytest.mark.parametrize("qlens, clens", [
    ([1, 1, 2, 160], [30, 7, 90, 300]),       # decodes then a chunk: each kernel's rows are one run
    ([160, 1, 300, 1], [300, 30, 1200, 7]),   # interleaved: the rows are gathered (160: past every
                                              # build's fast rows)
])
def test_mixed_step_rows_in_one_run_or_interleaved(ops, qlens, clens):
    batch = Batch(qlens, clens, 2, 3, 32, block_size=8, dtype=torch.float32)
    out = ops.paged_attention(*batch.args("cpu"), 0.2, query_lens_host=qlens, context_lens_host=clens)
    torch.testing.assert_close(out, batch.expected(0.2), **TOL)


def test_backend_table_fills_gaps_with_reference(tmp_path):
    torch_ops, cpu_ops = kernels.load("torch"), kernels.load("cpu", tmp_path)
    assert torch_ops.rms_norm is reference.rms_norm
    assert cpu_ops.rms_norm.__self__.__class__ is cpu.CpuKernels
    assert set(kernels.OPS) <= set(vars(cpu_ops))
    with pytest.raises(ValueError):
        kernels.load("cuda-magic")


def test_build_failure_is_a_typed_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu.KernelsUnavailable):
        cpu.build(tmp_path)


def test_the_build_turns_off_only_the_fma_chain_tunings_its_compiler_knows(tmp_path, monkeypatch):
    # A compiler that takes no such flag (Clang; one that fails everything here) gets none; a GCC
    # for x86 gets one that names only tunings it takes, and the library builds with it.
    refuses = tmp_path / "refuses"
    refuses.write_text("#!/bin/sh\nexit 1\n")
    refuses.chmod(0o755)
    assert cpu.fused_sums(str(refuses)) == ()
    cc = compiler_or_skip()
    flags = cpu.fused_sums(cc)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version or platform.machine().lower() not in ("x86_64", "amd64"):
        assert flags == ()
        return
    (flag,) = flags
    names = flag.removeprefix("-mtune-ctrl=").split(",")
    assert "^avoid_fma_chains" in names and all(n.removeprefix("^") in cpu.FMA_CHAIN_TUNINGS for n in names)
    assert compile_kernels(tmp_path / "fused.so", "-march=native", flag).returncode == 0
    # ...and a build compiles with what it says (a name the compiler refuses fails the build)
    monkeypatch.setattr(cpu, "fused_sums", lambda cc: ("-mtune-ctrl=^no_such_tuning",))
    with pytest.raises(cpu.KernelsUnavailable):
        cpu.build(tmp_path / "refused")


def test_info_names_the_build_or_why_there_is_none(tmp_path, monkeypatch):
    from pdchat.engine.info import info
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path / "ok"))
    best = cpu.int8_path(cpu.library(tmp_path / "ok" / "probe"))
    assert info()["cpu kernels"].startswith(f"C, int8 and int4 products on {best.title}")
    assert best == cpu.runnable_int8_paths()[-1]             # the best this CPU has
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path / "broken"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert info()["cpu kernels"].startswith("unavailable (no C compiler")


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA GPU"):
        kernels.choose("triton", "cpu", fp32=True)               # would fail every request later
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.choose("triton", "cpu", fp32=True) == "triton"   # interpreted, as the tests do
    assert kernels.choose("auto", "cuda", fp32=False) == "triton"
    assert kernels.choose("auto", "cpu", fp32=True) == "cpu"
    assert kernels.choose("auto", "cpu", fp32=False) == "torch"      # bf16 on CPU: PyTorch's ops
    assert kernels.choose("torch", "cpu", fp32=True) == "torch"
    for name, device in [("cpu", "cuda"), ("nonsense", "cpu")]:
        with pytest.raises(ValueError):
            kernels.choose(name, device, fp32=True)


def test_engine_turns_an_impossible_backend_into_a_readable_error():
    from pdchat.engine import Engine
    from pdchat.engine.errors import InvalidRequest
    with pytest.raises(InvalidRequest, match="fp32 on the CPU only"):
        Engine(model="random:tiny", dtype="bfloat16", kernels="cpu", telemetry=False)


# ---- the worker pool behind the products ---------------------------------------------------

def _big_product(ops, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = rand(3, 256, seed=seed), rand(1024, 256, seed=seed + 1)
    return ops.linear(x, w), reference.linear(x, w)


def test_products_from_several_threads_at_once(ops):
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda s: _big_product(ops, s), range(16)))
    for got, want in results:
        torch.testing.assert_close(got, want, **TOL)


def test_pool_workers_sleep_when_idle(ops):
    import ctypes
    import time
    x, w = rand(3, 256, seed=1), rand(1024, 256, seed=2)
    y = torch.empty(3, 1024)
    ops.lib.pd_linear_f32(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), 3, 1024, 256, 2)   # starts a worker
    workers, sleeping = ctypes.c_int(), ctypes.c_int()
    deadline = time.monotonic() + 10          # they spin for well under a millisecond
    while True:
        ops.lib.pd_pool_counts(ctypes.byref(workers), ctypes.byref(sleeping))
        if workers.value > 0 and sleeping.value == workers.value:
            break
        assert time.monotonic() < deadline, (f"{workers.value - sleeping.value} of {workers.value} workers "
                                             f"still awake 10 s after the last job: spinning")
        time.sleep(0.01)


def test_a_forked_child_computes_without_the_parents_workers(ops):
    import os
    import time
    _big_product(ops, 0)                                   # the parent's workers exist
    x, w = rand(3, 256, seed=1), rand(1024, 256, seed=2)
    want = reference.linear(x, w)
    pid = os.fork()
    if pid == 0:  # child: two threads asked for, so the pool is used (OpenMP itself is not fork-safe)
        y = torch.empty(3, 1024)
        ops.lib.pd_linear_f32(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), 3, 1024, 256, 2)
        os._exit(0 if torch.allclose(y, want, atol=1e-4, rtol=1e-4) else 3)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WEXITSTATUS(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError("the forked child hung in a product")


def compiler_or_skip() -> str:
    """The C compiler the build would use; the test skips, saying why, where there is none."""
    try:
        return cpu.compiler()
    except cpu.KernelsUnavailable as e:
        pytest.skip(str(e))


def compile_kernels(out, *flags: str) -> subprocess.CompletedProcess:
    """cpu_kernels.c built into `out` with the library's code flags and `flags`: the compiler's run
    (its status and errors). Skips where there is no compiler."""
    cc = compiler_or_skip()
    return subprocess.run([cc, *cpu.CODE_FLAGS, "-shared", "-fPIC", *flags, str(cpu.SOURCE), "-o", str(out), "-lm"],
                          capture_output=True, text=True, timeout=300)


def test_a_256_bit_x86_build_matches_reference_here_too(tmp_path):
    """The kernels as an AVX2 machine builds them (16 vector registers of 256 bits: products by
    blocks of 6 weight rows, attention in vectors of 8 lanes), built and run on this CPU where it has
    AVX2 and FMA: the fixture's builds take this machine's own width."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not {"avx2", "fma"} <= cpu.cpu_flags():
        pytest.skip("a 256-bit x86 build: this CPU does not run AVX2 with FMA")
    out = tmp_path / "haswell.so"
    done = compile_kernels(out, "-march=haswell")
    assert done.returncode == 0, done.stderr[-1500:]
    ops = cpu.CpuKernels(cpu.bind(ctypes.CDLL(str(out))))
    for rows in (1, 4, 9, 24, 40):
        x, w = rand(rows, 197, seed=rows), rand(93, 197, seed=100 + rows)
        torch.testing.assert_close(ops.linear(x, w), reference.linear(x, w), **TOL)
        for make, find, product, _ in EXACT_FORMS.values():       # their 256-bit rebuilds, bit for bit
            for outputs in (83, 96):                              # 96: by half-panels of 8 from 5 rows
                w, _, _ = make(outputs, 192, seed=rows)
                x = rand(rows, 192, seed=rows)
                held = getattr(ops, find)(w)
                assert held[0].shape[0] == (2 if outputs == 96 else 1)
                assert torch.equal(getattr(ops, product)(x, *held), fp32_products(ops, x, w, by_panels=outputs == 96))
    for qlens, clens, kv_heads, group, head_dim in [
        ([1, 3, 1, 2], [700, 301, 5, 129], 3, 3, 64),      # decodes and verifies: heads grouped
        ([1], [1500], 1, 12, 128),                         # a group in parts, keys split over threads
        ([37, 6, 1, 4], [300, 6, 50, 77], 2, 4, 40),       # tiles, a head size 8 divides but 16 does not
        ([15], [1500], 3, 3, 64),                          # a slice beside a long prefix
    ]:
        check_attention(ops, qlens, clens, kv_heads, group, head_dim, block_size=16, seed=3)


def fetches_in(asm: str, *functions: str) -> int:
    """Prefetch instructions (x86 prefetch*, Arm prfm) in the disassembled bodies of `functions`
    (their compiler-made clones too: name.part.0, name.constprop.0; Mach-O's leading underscore
    aside)."""
    count, inside = 0, False
    for line in asm.splitlines():
        header = re.match(r"^[0-9a-f]+ <_?([^>]+)>:$", line)
        if header:
            inside = header.group(1).split(".")[0] in functions
        elif inside and re.search(r"\s(prefetch\w*|prfm)\s", line):
            count += 1
    return count


@pytest.mark.parametrize("march", ["native", "haswell"])
def test_the_attention_tiles_fetch_their_next_keys_in_the_built_code(tmp_path, march):
    """A slice's tiles fetch the next keys' rows while they score the current ones. The fetch is
    invisible to results, and GCC once deleted it (a helper whose only effects were prefetches
    counted as pure): 22-32% of a slice's attention. Built and disassembled, not run."""
    if march == "haswell" and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("an x86 target: this is not an x86-64 machine")
    if not shutil.which("objdump"):
        pytest.skip("no objdump to read the built code")
    out = tmp_path / f"{march}.so"
    done = compile_kernels(out, f"-march={march}")
    assert done.returncode == 0, done.stderr[-1500:]
    asm = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True).stdout
    assert fetches_in(asm, "attend_pass", "attention_tiles") > 0
    assert fetches_in(asm, "attend_heads", "attention_groups") > 0      # the decodes' (always there)


def multiply_adds_in(asm: str, function: str) -> list[str]:
    """The fused multiply-add instructions in the disassembled body of `function` (and its clones)."""
    found, inside = [], False
    for line in asm.splitlines():
        header = re.match(r"^[0-9a-f]+ <_?([^>]+)>:$", line)
        if header:
            inside = header.group(1).split(".")[0] == function
        elif inside and re.search(r"\svfmadd\w+\s", line):
            found.append(line)
    return found


@pytest.mark.parametrize("march,strips,width", [("znver1", ["outer_strip_16", "outer_strip_8_pair"], "ymm"),
                                                ("skylake-avx512", ["outer_strip_16", "outer_strip_48"], "zmm")])
def test_the_products_strips_keep_their_sums_in_full_width_registers(tmp_path, march, strips, width):
    """GCC's tuning for a Zen 1 prefers 128-bit vectors and for a Skylake-X 256-bit ones; a strip
    whose sums fill the registers only at the build's full width then spilled them, and its
    multiply-adds read the stack (16-row products 1.4x slower on a Zen 1). Built for those CPUs
    and disassembled, not run."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 targets: this is not an x86-64 machine")
    if not shutil.which("objdump"):
        pytest.skip("no objdump to read the built code")
    out = tmp_path / f"{march}.so"
    done = compile_kernels(out, f"-march={march}")
    if done.returncode != 0 and ("bad value" in done.stderr or "unknown target CPU" in done.stderr):
        pytest.skip(f"{done.args[0]} does not know -march={march}")
    assert done.returncode == 0, done.stderr[-1500:]
    if "clang" in subprocess.run([done.args[0], "--version"], capture_output=True, text=True).stdout.lower():
        pytest.skip("clang: the width is GCC's target attribute (cpu_kernels.c, FULL_WIDTH)")
    asm = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True).stdout
    for strip in strips:
        fmas = multiply_adds_in(asm, strip)
        assert fmas and all(f"%{width}" in line for line in fmas), strip
        assert not [line for line in fmas if "(%rsp)" in line], strip     # no sum read back from the stack


X86_TARGETS = {"avx2": ["-mavx2", "-mfma"], "avx-vnni": ["-mavx2", "-mfma", "-mavxvnni"],
               "avx512-vnni": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vnni"]}


@pytest.mark.parametrize("path", list(X86_TARGETS))
def test_every_x86_int8_path_compiles_even_where_this_cpu_cannot_run_it(tmp_path, path):
    """Built for a generic x86-64 plus the path's instructions and disassembled, not run: a CPU
    without them would stop on the first one."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 paths: this is not an x86-64 machine")
    out = tmp_path / f"{path}.so"
    done = compile_kernels(out, "-march=x86-64", *X86_TARGETS[path], cpu.int8_define(path))
    if done.returncode != 0 and ("unrecognized" in done.stderr or "unknown argument" in done.stderr):
        pytest.skip(f"{done.args[0]} does not know {' '.join(X86_TARGETS[path])}")
    assert done.returncode == 0, done.stderr[-1500:]
    if shutil.which("objdump"):
        asm = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True).stdout
        assert ("vpdpbusd" if "vnni" in path else "vpmaddubsw") in asm      # the path's own instruction


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (16, 49152), (3, 37), (5, 1)])
def test_the_greedy_pick_is_the_references_row_for_row(ops, rows, vocab):
    """Each row's first largest logit, NO_TOKEN where the row holds a NaN, whatever else it holds:
    ties (the first wins), infinities, a row of -inf only, rows big enough to go on the pool."""
    logits = rand(rows, vocab, seed=rows)
    if vocab > 1:
        logits[0, vocab // 2] = logits[0, vocab - 1] = logits[0].max() + 1     # a tie: the first wins
    if rows > 1:
        logits[1, vocab - 1] = float("nan")
    if rows > 2:
        logits[2] = float("-inf")
        if vocab > 4:
            logits[2, 3] = float("inf")
    got = ops.greedy(logits)
    assert got.dtype == torch.long and torch.equal(got, reference.greedy(logits))
    if vocab > 1:
        assert got[0] == vocab // 2
    if rows > 1:
        assert got[1] == reference.NO_TOKEN
    assert torch.equal(ops.greedy(logits[:, ::2]), reference.greedy(logits[:, ::2]))   # not contiguous: torch's
