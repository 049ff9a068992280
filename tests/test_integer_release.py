"""``integer_release_`` (csrc/include/bpclip_fast/integer_release.h): the integer release of a
buffer of clipped sums, the second stage of docs/design.md's "Integer noise".

- bit for bit the Python replica (``tests/dgauss_ref.py``) on the CPU op and the emulated kernel;
- the coupled rounding: for one word, two data sets' integers differ by less than their grid values
  plus 1 on every coordinate (so by at most ``||a - a'|| + sqrt(d)`` in l2), monotone, unbiased;
- the noise is exactly ``discrete_gaussian_``'s draw; the clamp, NaN and the infinities;
- the argument errors.

Integer and IEEE-double arithmetic only: the same numbers on every machine.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from bpclip_fast import _ops

import dgauss_ref

sys.path.insert(0, str(Path(__file__).parent / "emulator"))
import harness  # noqa: E402

SPECIALS = [0.0, -0.0, 1e-45, -1e-300, 5e-324, 1.0, -1.0, 0.5, 3.0, 1e30, -1e30, 1e300, math.inf, -math.inf,
            math.nan]


def _buffer(dtype, n=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.logspace(-8, 8, n, dtype=torch.float64)
    specials = torch.tensor(SPECIALS, dtype=torch.float64)
    return torch.cat([x, specials]).to(dtype)


def _release(buf, *args):
    out = buf.clone()
    _ops.integer_release_(out, *args)
    return out


CASES = [  # first, multiplier, grid_exp, sigma, scale
    (0, 1.0, -26, 0, 1.0),
    (0, 2.5, -26, 1 << 27, 0.4),
    (1 << 33, 256.0, -40, 1000, 1 / 3),
    (7, 3.7, 0, 1, 1.0),
    (0, 1.0, 5, 17, 2.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
def test_the_op_is_the_replica_bit_for_bit(dtype, case):
    first, multiplier, grid_exp, sigma, scale = case
    seed, offset = -0x61C8864680B583EB, (1 << 62) + 12345
    buf = _buffer(dtype, seed=grid_exp & 0xFF)
    got = _release(buf, seed, offset, first, multiplier, grid_exp, sigma, scale)
    want = torch.tensor([dgauss_ref.integer_release_value(float(x), seed, offset, first + i, multiplier, grid_exp, sigma,
                                                          scale)
                         for i, x in enumerate(buf.tolist())], dtype=torch.float64).to(dtype)
    assert torch.equal(got.view(torch.int32 if dtype == torch.float32 else torch.int64),
                       want.view(torch.int32 if dtype == torch.float32 else torch.int64))


def _integers(buf, seed, offset, multiplier, grid_exp):
    """k of every element: the release without noise, scale 1, read back off the grid (exact in float64)."""
    out = _release(buf.double(), seed, offset, 0, multiplier, grid_exp, 0, 1.0)
    k = out * 2.0 ** -grid_exp
    assert torch.equal(k, k.round())
    return k


def _grid(buf, multiplier, grid_exp):
    return torch.tensor([dgauss_ref.grid_value(float(x), multiplier, grid_exp) for x in buf.double().tolist()],
                        dtype=torch.float64)


@pytest.mark.parametrize("multiplier, grid_exp", [(1.0, -26), (2.5, -30), (1.0, 3)])
def test_coupled_rounding_moves_less_than_the_data_plus_one(multiplier, grid_exp):
    gen = torch.Generator().manual_seed(1)
    n = 4096
    x = torch.randn(n, generator=gen, dtype=torch.float64) * 2.0 ** (grid_exp + 8)
    # neighbours: small moves, moves of about one grid step, and moves that just cross a cell edge
    moves = torch.cat([torch.randn(n // 2, generator=gen, dtype=torch.float64) * 2.0 ** (grid_exp - 4),
                       torch.randn(n // 2, generator=gen, dtype=torch.float64) * 2.0 ** (grid_exp + 1)])
    x2 = x + moves
    seed, offset = 77, 88
    k, k2 = _integers(x, seed, offset, multiplier, grid_exp), _integers(x2, seed, offset, multiplier, grid_exp)
    a, a2 = _grid(x, multiplier, grid_exp), _grid(x2, multiplier, grid_exp)
    assert bool(((k - a).abs() < 1).all())  # k - a in (-1, 1)
    assert bool(((k - k2).abs() < (a - a2).abs() + 1).all())
    assert float((k - k2).norm()) <= float((a - a2).norm()) + math.sqrt(n)
    # monotone in the data, for the same word
    lo, hi = torch.minimum(x, x2), torch.maximum(x, x2)
    assert bool((_integers(lo, seed, offset, multiplier, grid_exp) <= _integers(hi, seed, offset, multiplier,
                                                                                   grid_exp)).all())


def test_coupled_rounding_is_unbiased():
    # Every element holds a = 0.3 grid steps: k is 0 or 1, 1 with probability 0.3 (to 2^-53).
    n = 1 << 18
    k = _integers(torch.full((n,), 0.3 * 2.0 ** -20, dtype=torch.float64), 5, 6, 1.0, -20)
    assert set(k.unique().tolist()) <= {0.0, 1.0}
    p = float(k.mean())
    assert abs(p - 0.3) <= 6 * math.sqrt(0.3 * 0.7 / n)


def test_the_noise_is_discrete_gaussians_draw():
    n, sigma, seed, offset, grid_exp = 3000, 1 << 27, 41, 42, -26
    buf = torch.randn(n, dtype=torch.float64)
    k = _integers(buf, seed, offset, 1.0, grid_exp)
    noised = _release(buf, seed, offset, 0, 1.0, grid_exp, sigma, 1.0) * 2.0 ** -grid_exp
    y = torch.empty(n, dtype=torch.int64)
    _ops.discrete_gaussian_(y, seed, offset, sigma)
    assert torch.equal(noised - k, y.double())


def test_clamp_nan_and_infinities():
    buf = torch.tensor([1e300, -1e300, math.inf, -math.inf, math.nan], dtype=torch.float64)
    k = _integers(buf, 3, 4, 1.0, -26)
    # the clamp holds a = +-2^52, whose fraction is 0: k = a but for a word of 0 (2^-53)
    assert k.tolist()[:4] == [2.0 ** 52, -(2.0 ** 52), 2.0 ** 52, -(2.0 ** 52)]
    assert k.tolist()[4] in (0.0, 1.0)
    out = _release(buf, 3, 4, 0, 1.0, -26, 1 << 27, 1.0)
    assert bool(out.isfinite().all())


def test_positions_are_row_major_whatever_the_strides():
    base = torch.randn(6, 5, dtype=torch.float64)
    view = base.t()
    want = _release(view.contiguous().reshape(-1), 9, 10, 0, 1.5, -20, 100, 0.5)
    _ops.integer_release_(view, 9, 10, 0, 1.5, -20, 100, 0.5)
    assert torch.equal(view.reshape(-1), want)


@pytest.mark.parametrize("bad, match", [
    (dict(buf=torch.zeros(3, dtype=torch.float16)), r"buf must be float32 or float64"),
    (dict(buf=torch.zeros(3, dtype=torch.bfloat16)), r"buf must be float32 or float64"),
    (dict(multiplier=0.0), r"multiplier must be finite and > 0"),
    (dict(multiplier=math.nan), r"multiplier must be finite and > 0"),
    (dict(grid_exp=1001), r"grid_exp must be in \[-1000, 1000\]"),
    (dict(sigma=-1), r"sigma must be an integer in \[0, 2\^52\]"),
    (dict(scale=0.0), r"scale must be finite and > 0"),
    (dict(scale=math.inf), r"scale must be finite and > 0"),
    (dict(first=-1), r"elements first \.\. first \+ numel"),
    (dict(first=(1 << 56) - 2), r"elements first \.\. first \+ numel"),
])
def test_argument_errors(bad, match):
    args = dict(buf=torch.zeros(3), seed=1, offset=2, first=0, multiplier=1.0, grid_exp=-20, sigma=5, scale=1.0) | bad
    with pytest.raises(RuntimeError, match=match):
        _ops.integer_release_(**args)


@pytest.mark.parametrize("name", ["first", "grid_exp", "sigma"])
def test_non_integer_arguments_are_refused(name):
    args = dict(buf=torch.zeros(3), seed=1, offset=2, first=0, multiplier=1.0, grid_exp=-20, sigma=5, scale=1.0)
    args[name] = 2.5
    with pytest.raises(TypeError, match=f"{name} must be an integer"):
        _ops.integer_release_(**args)


@pytest.fixture(scope="module")
def sim():
    s = harness.Simt(harness.build_library())
    harness.SESSION.append(s)
    return s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("blocks", [0, 1, 3])
@pytest.mark.parametrize("case", CASES[:3])
def test_emulated_device_releases_the_same_bits(sim, dtype, blocks, case):
    sim.schedule("random", blocks * 7 + len(case))
    buf = _buffer(dtype, n=300, seed=blocks)
    assert harness.compare_integer_release(sim, buf, -5, 1 << 40, *case, blocks) == []


def test_first_shifts_the_element_words():
    # a buffer released from element 10 on is the tail of one released from element 0 on
    buf = torch.randn(30, dtype=torch.float64)
    whole = _release(buf, 3, 4, 0, 1.0, -20, 50, 1.0)
    assert torch.equal(_release(buf[10:], 3, 4, 10, 1.0, -20, 50, 1.0), whole[10:])


def test_coupled_rounding_is_exact_just_below_zero():
    """For a in (-1/2, 0), a - floor(a) = a + 1 rounds in double (review 46 F4): a = v - 1 - 2^-55, just
    below the cell edge v - 1, must give k = floor(a - v) + 1 = -1, where the rounded fraction said 0."""
    seed, offset = 31, 32
    v = [(dgauss_ref.rounding_word(seed, offset, i) >> 11) * 2.0 ** -53 for i in range(400)]
    picks = [i for i, vi in enumerate(v) if vi > 0.75][:40]
    a = torch.zeros(400, dtype=torch.float64)
    for i in picks:
        a[i] = (v[i] - 1.0) - 2.0 ** -55  # exact: |a| < 1/4, whose ulp is at most 2^-55
        assert a[i] - (v[i] - 1.0) == -(2.0 ** -55) and (a[i] + 1.0) == v[i]  # the rounding that misled
    k = _integers(a * 2.0 ** -20, seed, offset, 1.0, -20)
    assert all(k[i] == -1 for i in picks)
    assert all(k[i] == dgauss_ref.coupled_round(float(a[i]), dgauss_ref.rounding_word(seed, offset, i))
               for i in range(400))
