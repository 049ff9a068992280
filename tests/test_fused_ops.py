"""The fused ops of issue 25 (fewer launches per step) against the ops they replace, bit for bit:
philox_noise2_ (a layer's weight and bias noise in one launch) against two philox_noise_ calls and
the Python Philox reference; scale_rows2 (two row scalings in one launch, one of them the exact
modes' input mask) against scale_rows; clip_rows_rescale (the backprop backward's prologue: clip
the upstream gradient, rebuild the clipped input) against clip_rows + scale_rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bpclip_fast import _ops
from philox_ref import philox4x32_10

OPS = torch.ops.bpclip_fast
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DT_IDS = ["f32", "f64", "f16", "bf16"]
_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def bits(t):
    return t.contiguous().view(_INT[t.element_size()])


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# Weight / bias sizes: empty either or both, a single element, under one group of 8, across one warp
# tile (256) and its tail, several tiles with ragged tails on both.
PAIR_SIZES = [(0, 0), (0, 5), (7, 0), (1, 1), (3, 8), (256, 1), (257, 3), (1001, 17), (4099, 264)]


def _start(n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("nw,nb", PAIR_SIZES)
@pytest.mark.parametrize("acc_w,acc_b", [(False, False), (False, True), (True, False), (True, True)])
def test_noise2_is_two_single_calls_bit_for_bit(dtype, nw, nb, acc_w, acc_b):
    seed, offset, std = 0x0123456789ABCDEF + nw, (5 << 20) | (nb << 1), 0.7
    w0, b0 = _start(nw, dtype, nw), _start(nb, dtype, nb + 1)
    w, b = w0.clone(), b0.clone()
    _ops.philox_noise2_(w, b, seed, offset, std, acc_w, acc_b)
    rw, rb = w0.clone(), b0.clone()
    _ops.philox_noise_(rw, seed, offset, std, acc_w)
    _ops.philox_noise_(rb, seed, offset + 1, std, acc_b)
    assert same_bits(w, rw) and same_bits(b, rb)
    if nw and nb:  # the two streams differ (offset and offset + 1), so a swap would show
        assert not torch.equal(w[: min(nw, nb)].double(), b[: min(nw, nb)].double())


def test_noise2_noncontiguous_and_2d_use_row_major_positions():
    w = torch.zeros(6, 8).t()  # a non-contiguous view: the stream is indexed by the row-major position
    b = torch.zeros(20)[::2]
    _ops.philox_noise2_(w, b, 5, 9, 1.0, False, False)
    rw, rb = torch.zeros(8, 6), torch.zeros(10)
    _ops.philox_noise_(rw, 5, 9, 1.0, False)
    _ops.philox_noise_(rb, 5, 10, 1.0, False)
    assert same_bits(w.contiguous(), rw) and same_bits(b.contiguous(), rb)


def _radius_uniform(hi, lo):
    f32 = np.float32
    a = f32(hi >> 1) * f32(2.0 ** -31) + f32(hi & 1) * f32(2.0 ** -32)
    b = f32(lo >> 1) * f32(2.0 ** -63) + f32(lo & 1) * f32(2.0 ** -64)
    return min(float(a + (b + f32(2.0 ** -65))), 1.0 - 2.0 ** -24)  # philox.h: never 1 (r = 0)


def _reference_normals(seed, offset, n):
    """Normals 0..n-1 of stream (seed, offset) from the Python Philox4x32-10 (philox.h's layout:
    group g of 8 normals draws the counter blocks g, g + 2^62, g + 2^63), Box-Muller in float64."""
    mask = 0xFFFFFFFF

    def bm(hi, lo, angle):
        r = math.sqrt(-2.0 * math.log(_radius_uniform(hi, lo)))
        u2 = ((angle >> 9) * 2 + 1) * 2.0 ** -24  # a cell's midpoint: never on an axis
        return r * math.cos(2 * math.pi * u2), r * math.sin(2 * math.pi * u2)

    out = []
    for g in range((n + 7) // 8):
        b0, b1, b2 = (philox4x32_10([blk & mask, blk >> 32, offset & mask, offset >> 32], [seed & mask, seed >> 32])
                      for blk in (g, g + 2 ** 62, g + 2 ** 63))
        out += [*bm(b0[0], b0[1], b2[0]), *bm(b0[2], b0[3], b2[1]), *bm(b1[0], b1[1], b2[2]),
                *bm(b1[2], b1[3], b2[3])]
    return torch.tensor(out[:n], dtype=torch.float64)


def test_noise2_draws_offset_for_the_weight_and_offset_plus_one_for_the_bias():
    seed, offset = 0xDEADBEEF12345, (3 << 33) | 6
    w, b = torch.zeros(45), torch.zeros(19)
    _ops.philox_noise2_(w, b, seed, offset, 1.0, False, False)
    # float32 Box-Muller against float64: a few float32 roundings of values below ~6
    torch.testing.assert_close(w.double(), _reference_normals(seed, offset, 45), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(b.double(), _reference_normals(seed, offset + 1, 19), rtol=2e-6, atol=2e-6)


def test_noise2_rejects_bad_arguments():
    with pytest.raises(RuntimeError, match="std must be 0 or between"):
        _ops.philox_noise2_(torch.zeros(3), torch.zeros(2), 1, 0, float("nan"))
    with pytest.raises(RuntimeError, match="philox_noise2_: .*dtype"):
        _ops.philox_noise2_(torch.zeros(3), torch.zeros(2, dtype=torch.float64), 1, 0, 1.0)
    with pytest.raises(RuntimeError, match="must be float32"):
        _ops.philox_noise2_(torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 1, 0, 1.0)


# ---------------------------------------------------------------- scale_rows2 / clip_rows_rescale

ROW_SHAPES = [(0, 5), (1, 1), (3, 31), (4, 33), (2, 4097), (5, 2, 3, 3)]


def _rows(shape, dtype, seed, nonfinite=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    if nonfinite and shape[0] > 2:
        x.view(shape[0], -1)[0, 0] = float("nan")
        x.view(shape[0], -1)[1, -1] = float("inf")
    return x.to(dtype)


def _factors(b, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    f = (torch.rand(b, generator=gen, dtype=torch.float64) * 3).to(acc)
    if b > 2:
        f[0] = 0  # the NaN row and the Inf row dropped: zeros, never 0 * NaN
        f[1] = 0
    if b > 3:
        f[3] = 0
    return f


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_scale_rows2_is_two_scale_rows(dtype, shape):
    x, y = _rows(shape, dtype, 1), _rows(shape[:1] + (7,), dtype, 2, nonfinite=False)
    fx, fy = _factors(shape[0], dtype, 3), _factors(shape[0], dtype, 4)
    for mask in (False, True):
        ox, oy = _ops.scale_rows2(x, fx, y, fy, mask)
        assert same_bits(ox, _ops.scale_rows(x, fx))
        # the mask: RZ(1 * y) = y where the factor is positive, zeros where it is 0 (what
        # scale_rows(y, sign(f)) gave, in one launch with the other scaling)
        assert same_bits(oy, _ops.scale_rows(y, torch.sign(fy) if mask else fy))
    if shape[0] > 3:
        _, oy = _ops.scale_rows2(x, fx, y, fy, True)
        assert torch.equal(oy[2], y[2]) and not oy[3].any()


def test_scale_rows2_rejects_mismatched_batches():
    with pytest.raises(RuntimeError, match="scale_rows2: .*examples"):
        _ops.scale_rows2(torch.zeros(3, 2), torch.ones(3), torch.zeros(4, 2), torch.ones(4), False)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,norm", [((0, 5), "l2"), ((1, 1), "l2"), ((3, 31), "l2"), ((4, 4097), "l2"),
                                        ((5, 2, 3, 3), "l15"), ((4, 3, 4, 4), "l2")], ids=str)
@pytest.mark.parametrize("clip_fn", ["clip", "normalize"])
def test_clip_rows_rescale_is_clip_rows_and_scale_rows(dtype, shape, norm, clip_fn):
    g = _rows(shape, dtype, 5)
    x = _rows(shape[:1] + (2, 9), dtype, 6)
    fx = _factors(shape[0], dtype, 7)
    c1, c2 = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    gc, gf, gn, xc = _ops.clip_rows_rescale(g, c1, 0.8, norm, clip_fn, 0.01, x, fx)
    rg, rf, rn = _ops.clip_rows(g, c2, 0.8, norm, clip_fn, 0.01)
    assert same_bits(gc, rg) and same_bits(gf, rf) and same_bits(gn, rn) and int(c1) == int(c2)
    assert same_bits(xc, _ops.scale_rows(x, fx))
