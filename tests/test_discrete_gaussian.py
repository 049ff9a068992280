"""``discrete_gaussian_`` (csrc/include/bpclip_fast/discrete_gaussian.h): the first stage of the
integer release (docs/design.md, "Integer noise").

- bit for bit the Python replica written from the header's comment (``tests/dgauss_ref.py``), on
  the CPU op and on the emulated CUDA kernel, for every grid;
- the pmf of N_Z(0, s^2) by a chi-square test, and the moments at large s; no dependence between
  neighbouring elements or offsets;
- the argument errors.

The draw is integer-only and its stream fixed by (seed, offset), so every number below is the
same on every machine. The statistical thresholds (6 standard errors; chi-square below
k + 6 sqrt(2k)) are exceeded by a correct sampler with probability below 1e-6 per check.
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

SIGMAS = [1, 2, 3, 17, 1000, 1 << 27, 1000003, (1 << 52) - 1, 1 << 52]


def _draw(n, seed, offset, sigma):
    out = torch.empty(n, dtype=torch.int64)
    _ops.discrete_gaussian_(out, seed, offset, sigma)
    return out


@pytest.mark.parametrize("sigma", SIGMAS)
def test_the_op_is_the_replica_bit_for_bit(sigma):
    # seed and offset with their top bits set, as the op's signed 64-bit arguments
    seed, offset = (0x9E3779B97F4A7C15 ^ sigma) - (1 << 64), (0xD1B54A32D192ED03 * sigma) % (1 << 63) - (1 << 63)
    got = _draw(120, seed, offset, sigma).tolist()
    want = [dgauss_ref.discrete_gaussian(seed, offset, i, sigma) for i in range(120)]
    assert got == want


def test_sigma_zero_draws_zeros():
    assert torch.equal(_draw(50, 1, 2, 0), torch.zeros(50, dtype=torch.int64))


def _pmf(s: int, w: int) -> list[float]:
    """N_Z(0, s^2) on [-w, w], normalised over a range whose outside mass is below 1e-300."""
    far = 40 * s + 40
    z = math.fsum(math.exp(-y * y / (2 * s * s)) for y in range(-far, far + 1))
    return [math.exp(-y * y / (2 * s * s)) / z for y in range(-w, w + 1)]


@pytest.mark.parametrize("sigma", [1, 2, 5, 30])
def test_the_pmf_by_chi_square(sigma):
    n = 1 << 20
    y = _draw(n, 0x5EED + sigma, 11, sigma)
    w = 6 * sigma + 2
    p = _pmf(sigma, w)
    counts = torch.bincount((y.clamp(-w - 1, w + 1) + w + 1), minlength=2 * w + 3).tolist()
    inside, outside = counts[1:-1], counts[0] + counts[-1]
    chi, bins, pooled, pooled_p = 0.0, 0, outside, 1.0 - math.fsum(p)
    for c, pk in zip(inside, p):
        if pk * n >= 20:
            chi += (c - pk * n) ** 2 / (pk * n)
            bins += 1
        else:
            pooled, pooled_p = pooled + c, pooled_p + pk
    chi += (pooled - pooled_p * n) ** 2 / (pooled_p * n)
    dof = bins  # bins + the pooled one, less one
    assert chi <= dof + 6 * math.sqrt(2 * dof), (chi, dof)


@pytest.mark.parametrize("sigma", [1 << 20, 1 << 27, 1 << 52])
def test_moments_at_large_sigma(sigma):
    # The variance of N_Z(0, s^2) is s^2 to within 1e-300 relative at these s; its fourth moment 3 s^4.
    n = 1 << 18
    z = _draw(n, 3, sigma, sigma).double() / sigma
    assert abs(float(z.mean())) <= 6 / math.sqrt(n)
    assert abs(float((z * z).mean()) - 1) <= 6 * math.sqrt(2 / n)
    assert abs(float(z.pow(4).mean()) - 3) <= 6 * math.sqrt(96 / n)


def test_no_correlation_between_elements_offsets_or_seeds():
    n, s = 1 << 18, 1 << 30
    a = _draw(n + 1, 21, 5, s).double() / s
    pairs = [(a[:-1], a[1:]), (a[:-1], _draw(n, 21, 6, s).double() / s), (a[:-1], _draw(n, 22, 5, s).double() / s)]
    for x, y in pairs:  # each correlation is ~N(0, 1/n) for independent draws
        assert abs(float((x * y).mean())) <= 6 / math.sqrt(n)


def test_positions_are_row_major_whatever_the_strides():
    base = torch.zeros(6, 5, dtype=torch.int64)
    view = base.t()  # a non-contiguous out: the draw goes to its logical (row-major) positions
    _ops.discrete_gaussian_(view, 9, 10, 1000)
    assert torch.equal(view.reshape(-1), _draw(30, 9, 10, 1000))


@pytest.mark.parametrize("bad, match", [
    (dict(out=torch.zeros(3)), r"discrete_gaussian_: out must be int64"),
    (dict(sigma=-1), r"sigma must be an integer in \[0, 2\^52\]"),
    (dict(sigma=(1 << 52) + 1), r"sigma must be an integer in \[0, 2\^52\]"),
])
def test_argument_errors(bad, match):
    args = dict(out=torch.zeros(3, dtype=torch.int64), seed=1, offset=2, sigma=5) | bad
    with pytest.raises(RuntimeError, match=match):
        _ops.discrete_gaussian_(**args)
    with pytest.raises(TypeError, match=r"sigma must be an integer"):
        _ops.discrete_gaussian_(torch.zeros(3, dtype=torch.int64), 1, 2, 2.5)


@pytest.fixture(scope="module")
def sim():
    s = harness.Simt(harness.build_library())
    harness.SESSION.append(s)
    return s


@pytest.mark.parametrize("sigma", [1, 3, 1 << 27, 1 << 52])
@pytest.mark.parametrize("blocks", [0, 1, 3])
def test_emulated_device_draws_the_same_integers(sim, sigma, blocks):
    sim.schedule("random", sigma % 1000 + blocks)
    assert harness.compare_discrete_gaussian(sim, 700, -5, 1 << 40, sigma, blocks) == []


def test_lemires_rule_is_exactly_uniform_on_small_words():
    """uniform_below's rule (accept x unless (x m mod 2^W) < (2^W - m) mod m, value floor(x m / 2^W))
    gives every value exactly floor(2^W / m) words, for every m of W = 10 bits: the header applies
    it at W = 64, where its rejection path is too rare to meet in a sample."""
    import numpy as np

    w = 10
    x = np.arange(1 << w, dtype=np.int64)
    for m in range(1, 1 << w):
        product = x * m
        threshold = ((1 << w) - m) % m
        kept = product[(product & ((1 << w) - 1)) >= threshold] >> w
        counts = np.bincount(kept, minlength=m)
        assert counts.min() == counts.max() == (1 << w) // m, m
