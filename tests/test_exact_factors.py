"""exact_factors (bpclip_fast/exact.py ``factors`` and flat's total): bit for bit the factors of
clip_rows on the rounded-up bounds, and a flat total that is an upper bound on the exact root."""

from fractions import Fraction
import math

import pytest
import torch

import bpclip_fast  # noqa: F401
from bpclip_fast import exact

pytestmark = pytest.mark.skipif(not bpclip_fast._ops.extension_loaded(), reason="extension not built")


def _reference_factors(bound, max_norm, clip_fn, gamma, data_dtype):
    """The factors as exact.factors computed them before exact_factors: bound -> rounded up to the
    factor dtype by torch -> clip_rows on rows of one element -> floor."""
    acc = torch.float64 if data_dtype == torch.float64 else torch.float32
    b = bound.to(acc)
    if acc != torch.float64:
        b = torch.where(b.double() < bound, torch.nextafter(b, b.new_tensor(math.inf)), b)
    count = torch.zeros(1, dtype=torch.int64)
    _, factor, _ = torch.ops.bpclip_fast.clip_rows(b.unsqueeze(1), count, float(max_norm), "l2", clip_fn, float(gamma))
    return factor.masked_fill_(factor < exact.FACTOR_FLOOR, 0.0), int(count)


def _edge_bounds():
    f32max = torch.finfo(torch.float32).max
    vals = [0.0, 1e-320, 2.0 ** -149, 1e-30, 0.3, 1.0, 1.0 + 2.0 ** -40, 2.0 ** 59, 2.0 ** 61, 3e20, f32max,
            f32max * (1 + 2.0 ** -30), 1e300, math.inf, math.nan]
    gen = torch.Generator().manual_seed(3)
    rand = torch.exp(torch.randn(400, generator=gen, dtype=torch.float64) * 20)
    return torch.cat([torch.tensor(vals, dtype=torch.float64), rand])


@pytest.mark.parametrize("data_dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("clip_fn,gamma", [("clip", 0.01), ("normalize", 0.3), ("global", 0.01)])
@pytest.mark.parametrize("max_norm", [1.0, 0.37, 1e-3])
def test_factors_bit_for_bit_as_clip_rows(data_dtype, clip_fn, gamma, max_norm):
    bound = _edge_bounds()
    expect, expect_count = _reference_factors(bound, max_norm, clip_fn, gamma, data_dtype)
    count = torch.zeros(1, dtype=torch.int64)
    got = exact.factors(bound, max_norm, clip_fn, gamma, count, data_dtype)
    assert got.dtype == expect.dtype
    assert torch.equal(got.view(torch.int64 if got.dtype == torch.float64 else torch.int32),
                       expect.view(torch.int64 if got.dtype == torch.float64 else torch.int32))
    assert int(count) == expect_count > 0


def _exact_root_below(total, bounds):
    """Whether the double ``total`` is >= sqrt(sum bound^2) computed exactly (rationals)."""
    s = sum(Fraction(b) ** 2 for b in bounds)
    return Fraction(total) ** 2 >= s


def test_flat_total_is_an_upper_bound_of_the_exact_root():
    gen = torch.Generator().manual_seed(11)
    layers = 7
    bounds = [torch.rand(3000, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-5, 5, (3000,),
                                                                                             generator=gen)
              for _ in range(layers)]
    count = torch.zeros(1, dtype=torch.int64)
    _, total = torch.ops.bpclip_fast.exact_factors(bounds, count, 1.0, "clip", 0.01, True)
    rows = torch.stack(bounds, 1).tolist()
    assert all(_exact_root_below(t, r) for t, r in zip(total.tolist(), rows))
    # The plain double root (the old total) falls below the exact one for some of these rows.
    plain = torch.stack(bounds).square().sum(0).sqrt().tolist()
    assert not all(_exact_root_below(t, r) for t, r in zip(plain, rows))
    # and the inflation is tiny: within (L + 4) 2^-53 relative of it
    rel = ((total - torch.tensor(plain, dtype=torch.float64)) / total).abs().max().item()
    assert rel <= (layers + 4) * 2.0 ** -52


def test_one_layer_total_is_the_bound():
    b = _edge_bounds()
    _, total = torch.ops.bpclip_fast.exact_factors([b], torch.zeros(1, dtype=torch.int64), 1.0, "clip", 0.01, False)
    assert torch.equal(total, b) or torch.equal(total.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv2d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norms_ops_count_the_nonfinite_bounds_they_return(conv, dtype):
    """Flat clipping's per-layer count comes from the norms op's own kernel: it must add exactly the
    number of examples whose returned bound is not finite (an inf or NaN upstream gradient, or an
    input that overflows the Gram products), and nothing without a counter."""
    gen = torch.Generator().manual_seed(3)
    if conv:
        x, g = torch.randn(5, 2, 6, 6, generator=gen, dtype=dtype), torch.randn(5, 3, 4, 4, generator=gen, dtype=dtype)
        g[1, 0, 2, 2], g[3, 2, 0, 1] = float("inf"), float("nan")
        call = lambda counter: torch.ops.bpclip_fast.conv2d_grad_norms(  # noqa: E731
            g, x, [3, 3], [1, 1], [0, 0], [1, 1], 1, [True, True], "auto", 1 << 20, True, counter)
    else:
        x, g = torch.randn(5, 7, 4, generator=gen, dtype=dtype), torch.randn(5, 7, 3, generator=gen, dtype=dtype)
        g[1, 2, 0], x[3, 0, 1] = float("inf"), float("nan")
        call = lambda counter: torch.ops.bpclip_fast.linear_grad_norms(  # noqa: E731
            g, x, [True, True], "auto", 1 << 20, True, counter)
    counter = torch.full((1,), 7, dtype=torch.int64)
    _, bound, _, _ = call(counter)
    expected = int((~torch.isfinite(bound)).sum())
    assert expected == 2
    assert int(counter) == 7 + expected
    _, again, _, _ = call(None)
    assert torch.equal(again.nan_to_num(-1.0), bound.nan_to_num(-1.0))  # NaN != NaN


@pytest.mark.parametrize("data_dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("clip_fn,gamma", [("clip", 0.01), ("normalize", 0.3)])
def test_per_layer_instantiated_factors_are_the_factors_of_their_bound(data_dtype, clip_fn, gamma):
    """A per_layer layer's instantiated examples get their bound and factors from one kernel
    (examples_factors, through exact.factors and a PendingBound): bit for bit clip_rows' factors of
    examples_bound's bound, the same count, and that very bound left on the PendingBound. The rows
    hold NaN, Inf, zeros, tiny values, and (fp64) a bound past fp32's largest value."""
    from bpclip_fast.examples import DenseExamples

    gen = torch.Generator().manual_seed(4)
    B = 40
    gw = torch.randn(B, 5, 3, generator=gen, dtype=torch.float64) * torch.exp(torch.randn(B, 1, 1, generator=gen) * 8)
    gb = torch.randn(B, 5, generator=gen, dtype=torch.float64)
    gw[0, 0, 0], gw[1, 2, 1], gw[2], gb[2] = math.nan, math.inf, 0.0, 0.0
    gw[3], gb[3] = 1e-40, 0.0
    gb[5, 1] = -math.inf
    if data_dtype == torch.float64:
        gw[4, 0, 0] = 1e39  # a finite bound that rounds up to fp32's +Inf: counted, factor 0
    examples = DenseExamples(gw, gb, data_dtype)
    for mask in ((True, True), (True, False), (False, True)):
        pending = exact.PendingBound(examples, mask)
        count = torch.zeros(1, dtype=torch.int64)
        got = exact.factors(pending, 0.37, clip_fn, gamma, count, data_dtype)
        bound = examples.bound(mask)
        expect, expect_count = _reference_factors(bound, 0.37, clip_fn, gamma, data_dtype)
        bits = torch.int64 if got.dtype == torch.float64 else torch.int32
        assert got.dtype == expect.dtype
        assert torch.equal(got.view(bits), expect.view(bits))
        assert torch.equal(pending.value.view(torch.int64), bound.view(torch.int64))
        assert int(count) == expect_count >= 1
