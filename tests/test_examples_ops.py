"""examples_bound and examples_release: the bound and the clipped, noised release of instantiated
per-example gradients (GroupNorm, LayerNorm, PositionalEmbedding, ClassToken; bpclip_fast/examples.py,
DenseExamples; proofs in csrc/include/bpclip_fast/examples.h).

* The bound against the exact norm (fractions): never below it, and within its proved slack above,
  for every dtype, with and without a bias, B = 0 and 1, fp64 squares that underflow, a non-finite
  example (a non-finite bound, counted).
* The release against float64 sums of the clipped values (``scale_rows``, the stored values):
  within the accumulation rounding of the sum and one rounding to the dtype; rows with factor 0 add
  exact zeros whatever they hold.
* The documented order, bit for bit: the sum over the eight parts, then ``philox_noise_``'s
  accumulate (weight at ``offset``, bias at ``offset + 1``), then ``mul_(scale)``, then ``.to``.
* DenseExamples through the layers: its bound is never below the exact norm in fp64 (underflow).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from bpclip_fast import _ops, examples

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DT_IDS = ["f32", "f64", "f16", "bf16"]
V = 2.0 ** -53


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _values(B, shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, *shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _exact_norm(*rows):
    """The exact norm of one example's values (Fractions), as a float64 interval [lo, hi]."""
    s = sum((Fraction(float(v)) ** 2 for r in rows if r is not None for v in r.reshape(-1).tolist()), Fraction(0))
    root = math.sqrt(float(s)) if s > 0 else 0.0
    return s, root


def _check_bound(bound, w, b):
    n = sum(t[0].numel() for t in (w, b) if t is not None) if bound.numel() else 0
    for i in range(bound.shape[0]):
        s, root = _exact_norm(w[i] if w is not None else None, b[i] if b is not None else None)
        got = float(bound[i])
        assert Fraction(got) ** 2 >= s, f"example {i}: bound {got!r} below the exact norm {root!r}"
        # The slack the proof spends: grow(n + 1) and three roundings, plus the fp64 underflow term.
        tiny = n * 2.0 ** -1074 if w is not None and w.dtype == torch.float64 else 0.0
        summed = float(s) * (1 + 2 * (n + 2) * V)  # the double sum's error, generously
        # r = the successor of √grow (up to 2 ulps above it), the sum, root and product roundings
        # (grow applied after the root: a subnormal sum times grow would round grow away)
        ceiling = math.sqrt(summed + tiny) * math.sqrt(1 + 2 * (n + 5) * V) * (1 + 8 * V) + 2.0 ** -1074
        assert got <= ceiling, f"example {i}: bound {got!r} far above the exact norm {root!r}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("B", [0, 1, 5, 11])
@pytest.mark.parametrize("bias", [True, False])
def test_bound_is_above_the_exact_norm_within_its_slack(dtype, B, bias):
    w = _values(B, (7, 3), dtype, 1, 3.0)
    b = _values(B, (7, 3), dtype, 2) if bias else None
    bound = _ops.examples_bound(w, b)
    assert bound.dtype == torch.float64 and bound.shape == (B,)
    _check_bound(bound, w, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_bound_of_a_long_row_crosses_the_partial_sums(dtype):
    # 300 + 300 entries: more than the 256 partial sums, the bias straddling a part boundary.
    w, b = _values(3, (300,), dtype, 3), _values(3, (300,), dtype, 4, 1e-3)
    _check_bound(_ops.examples_bound(w, b), w, b)
    _check_bound(_ops.examples_bound(None, b), None, b)


def test_fp64_squares_that_underflow_still_give_an_upper_bound():
    # x ~ 1e-170: x^2 is below double's smallest subnormal, so a plain sum of squares is 0 (a bound
    # of 0 would clip nothing at any C: the factor is 1 and the example adds its values).
    w = torch.full((2, 40), 1e-170, dtype=torch.float64)
    w[1, 0] = 1.0  # and next to a large entry: 39 squares lost entirely
    w[1, 1:] = 3e-162
    bound = _ops.examples_bound(w, None)
    _check_bound(bound, w, None)
    assert float(bound[0]) > 0


def test_fp64_dense_examples_bound_covers_underflowing_squares():
    """Through DenseExamples (what the layers call): fails on the former linalg.vector_norm bound."""
    gw = torch.full((2, 16), 1e-170, dtype=torch.float64)
    ex = examples.DenseExamples(gw, gw.clone(), torch.float64)
    bound = ex.bound([True, True])
    for i in range(2):
        s, _ = _exact_norm(gw[i], gw[i])
        assert Fraction(float(bound[i])) ** 2 >= s


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_non_finite_example_has_non_finite_bound_and_is_counted(dtype):
    w, b = _values(4, (5,), dtype, 5), _values(4, (5,), dtype, 6)
    w[1, 2] = float("inf")
    b[3, 0] = float("nan")
    counter = torch.zeros(1, dtype=torch.int64)
    bound = _ops.examples_bound(w, b, counter)
    assert not math.isfinite(float(bound[1])) and not math.isfinite(float(bound[3]))
    assert math.isfinite(float(bound[0])) and math.isfinite(float(bound[2]))
    assert int(counter) == 2
    _ops.examples_bound(w[[0, 2]], b[[0, 2]], counter)
    assert int(counter) == 2  # finite examples count nothing


def _truth_release(x, factor):
    """Float64 sum of the stored clipped values RZ_T(c_b x_b) (scale_rows), and sum |terms|."""
    if x.shape[0] == 0:
        z = torch.zeros(x.shape[1:], dtype=torch.float64)
        return z, z
    terms = _ops.scale_rows(x, factor).double()
    return terms.sum(0), terms.abs().sum(0)


def _release_tolerance(dtype, B, truth, mass):
    """|out - truth| for a sum of B terms in the accumulation dtype (any order: (B - 1) u_acc of the
    terms' magnitudes), then one rounding to the dtype (half an ulp: u_T relative, and half the
    smallest subnormal)."""
    u_acc = 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24
    finfo = torch.finfo(dtype)
    u_t = finfo.eps / 2
    tiny = finfo.smallest_normal * finfo.eps / 2
    acc_err = max(B - 1, 0) * u_acc * mass
    return acc_err + u_t * (truth.abs() + acc_err) + tiny


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("B", [0, 1, 3, 9, 20])
@pytest.mark.parametrize("bias", [True, False])
def test_release_without_noise_is_the_float64_clipped_sum(dtype, B, bias):
    w, b = _values(B, (6, 5), dtype, 7, 2.0), (_values(B, (6, 5), dtype, 8) if bias else None)
    factor = torch.rand(B, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(_acc(dtype))
    if B > 2:
        factor[1] = 0
        w[1, 0, 0] = float("nan")  # factor 0: exact zeros, not 0 * NaN
        if bias:
            b[1, 2, 1] = float("inf")
    gw, gb = _ops.examples_release(w, b, factor)
    assert gw.dtype == dtype and gw.shape == (6, 5)
    assert gb.shape == ((6, 5) if bias else (0,))
    for x, out in ((w, gw), (b, gb)) if bias else ((w, gw),):
        truth, mass = _truth_release(x, factor)
        assert torch.isfinite(out).all()
        err = (out.double() - truth).abs()
        assert (err <= _release_tolerance(dtype, B, truth, mass)).all(), float(err.max())
        if B == 1:  # a lone example's release is exactly its stored values
            assert torch.equal(out.double(), truth)


def _documented(x, factor, seed, offset, std, scale):
    """The release as bpclip_fast/examples.h documents it, from other ops: the parts, philox_noise_
    (accumulate), mul_(scale), .to(dtype)."""
    acc = _acc(x.dtype)
    n = x[0].numel() if x.shape[0] else math.prod(x.shape[1:])
    terms = _ops.scale_rows(x, factor).to(acc).reshape(x.shape[0], n)
    parts = [torch.zeros(n, dtype=acc) for _ in range(8)]
    for i in range(x.shape[0]):
        parts[i % 8] = parts[i % 8] + terms[i]
    p = parts
    s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    if std > 0:
        _ops.philox_noise_(s, seed, offset, std, accumulate=True)
    if scale != 1.0:
        s.mul_(scale)
    return s.to(x.dtype).reshape(x.shape[1:])


def _bits(t):
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("B", [0, 1, 7, 8, 19])
@pytest.mark.parametrize("std,scale", [(0.0, 1.0), (0.7, 1.0), (1.3, 0.37), (0.0, 0.1)])
def test_release_is_bit_for_bit_the_documented_order_with_philox_noise(dtype, B, std, scale):
    # 533 weight values: several 512-element CPU spans and a last group of 8 cut short; bias 9.
    w, b = _values(B, (13, 41), dtype, 10), _values(B, (9,), dtype, 11, 5.0)
    factor = torch.rand(B, generator=torch.Generator().manual_seed(12), dtype=torch.float64).to(_acc(dtype))
    if B > 3:
        factor[3] = 0
        w[3] = float("nan")
    seed, offset = 0x1234_5678_9ABC, 77
    gw, gb = _ops.examples_release(w, b, factor, seed, offset, std, scale)
    want_w = _documented(w, factor, seed, offset, std, scale)
    want_b = _documented(b, factor, seed, offset + 1, std, scale)
    assert torch.equal(_bits(gw), _bits(want_w))
    assert torch.equal(_bits(gb), _bits(want_b))
    gw_only, empty = _ops.examples_release(w, None, factor, seed, offset, std, scale)
    assert torch.equal(_bits(gw_only), _bits(want_w)) and empty.numel() == 0
    _, gb_only = _ops.examples_release(None, b, factor, seed, offset, std, scale)
    assert torch.equal(_bits(gb_only), _bits(want_b))  # the bias keeps offset + 1 without a weight


def test_bad_arguments_name_the_rule():
    w = torch.randn(3, 4)
    with pytest.raises(ValueError, match="needs the weight's or the bias's"):
        _ops.examples_bound(None, None)
    with pytest.raises(RuntimeError, match="bias is .* but weight is"):
        _ops.examples_bound(w, w.double())
    with pytest.raises(RuntimeError, match="weight has 3 examples"):
        _ops.examples_bound(w, torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="factor needs 3 entries"):
        _ops.examples_release(w, None, torch.ones(2))
    with pytest.raises(RuntimeError, match="factor must be Float"):
        _ops.examples_release(w, None, torch.ones(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="noise_std must be 0 or between"):
        _ops.examples_release(w, None, torch.ones(3), std=float("inf"))
    with pytest.raises(RuntimeError, match="scale must be finite and > 0 .below 1e30"):  # as every noise op's (review 39 L3)
        _ops.examples_release(w, None, torch.ones(3), scale=1e31)
