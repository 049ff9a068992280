"""The engine's mean-loss scale ``d/B̄`` inside the layer ops (issue 25): every release op takes it and
applies it in its noise launch, after the noise, as a later ``mul_(scale)`` of the noised sum would
(post-processing), so a Poisson step whose batch size differs from ``B̄`` launches no ``mul_`` per
parameter. The definition checked bit for bit: the op's clipped sums without a draw (std 0, scale 1),
the draw added in place (``philox_noise_``/``philox_noise2_``, accumulate), then ``mul_(scale)``; for
the exact modes' release ops (noised sums in fp32/fp64 for every data dtype) and the backpropagation
ops (fp32/fp64; fp16/bf16 parameters now round once, after the scale). (At scale 1 with a draw,
Linear writes the draw first and lets the GEMM accumulate onto it, which rounds differently: the
ops' other tests cover that path.)"""

import pytest
import torch

from bpclip_fast import _ops

pytestmark = pytest.mark.skipif(not _ops.extension_loaded(), reason="the bpclip_fast extension is not built")
OPS = torch.ops.bpclip_fast if _ops.extension_loaded() else None
SCALES = [1 / 3, 0.75, 2.5]


def _bits(t):
    return t.contiguous().view(-1).view(torch.int8)


def _same(a, b):
    return all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def _data(dtype, shape_x, shape_g, out, inp, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape_x, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(shape_g, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(out, *inp, generator=gen, dtype=torch.float64).to(dtype)
    factor = torch.rand(shape_x[0], generator=gen, dtype=torch.float64)
    factor = factor.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return x, g, w, factor


def _noised_then_scaled(gw, gb, mask, key, std, scale):
    """The definition: sums ``gw``/``gb`` (``mask``: which train), the draw of ``key`` added in place
    as the ops add it (the weight at offset, the bias at offset + 1; one launch for both), times
    ``scale``."""
    seed, offset = key
    if std > 0:
        if mask[0] and mask[1]:
            _ops.philox_noise2_(gw, gb, seed, offset, std, True, True)
        elif mask[0]:
            _ops.philox_noise_(gw, seed, offset, std, accumulate=True)
        else:
            _ops.philox_noise_(gb, seed, offset + 1, std, accumulate=True)
    return [t.mul_(scale) if m else t for t, m in zip((gw, gb), mask)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("std", [0.0, 0.6])
@pytest.mark.parametrize("mask", [[True, True], [True, False], [False, True]])
@pytest.mark.parametrize("scale", SCALES)
def test_exact_release_ops_scale_after_the_noise(dtype, std, mask, scale):
    x, g, w, factor = _data(dtype, (3, 5, 7), (3, 5, 4), 4, (7,))
    got = OPS.linear_clipped_grads(g, x, factor, w, mask, [11, 6], std, None, None, scale)
    sums = OPS.linear_clipped_grads(g, x, factor, w, mask, [11, 6], 0.0, None, None)
    assert _same(got, _noised_then_scaled(*sums, mask, (11, 6), std, scale))
    xc, gc, wc, fc = _data(dtype, (3, 2, 6, 6), (3, 4, 6, 6), 4, (2, 3, 3), seed=1)
    args = (gc, xc, fc, wc, [1, 1], [1, 1], [1, 1], 1, mask)
    got = OPS.conv2d_clipped_grads(*args, [5, 2], std, None, None, scale)
    sums = OPS.conv2d_clipped_grads(*args, [5, 2], 0.0, None, None)
    assert _same(got, _noised_then_scaled(*sums, mask, (5, 2), std, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("std", [0.0, 0.6])
@pytest.mark.parametrize("scale", SCALES)
def test_kept_release_scales_after_the_noise(dtype, std, scale):
    # Kept per-example gradients (examples_release inside the op): the scale goes in as its own.
    x, g, w, factor = _data(dtype, (3, 9, 4), (3, 9, 3), 3, (4,))
    _, _, kw, kb = OPS.linear_grad_norms(g, x, [True, True], "instantiate", 1 << 20, True, None, 1 << 20)
    assert kw.numel() > 0
    got = OPS.linear_clipped_grads(g, x, factor, w, [True, True], [3, 8], std, kw, kb, scale)
    ref = [t.mul_(scale) for t in OPS.linear_clipped_grads(g, x, factor, w, [True, True], [3, 8], std, kw, kb)]
    assert _same(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("std", [0.0, 0.6])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("scale", SCALES)
def test_backprop_ops_scale_after_the_noise(dtype, std, bias, scale):
    x, g, w, _ = _data(dtype, (3, 5, 7), (3, 5, 4), 4, (7,))
    nf = torch.zeros(1, dtype=torch.int64)
    b = torch.zeros(4, dtype=dtype) if bias else None
    _, xf, xn = OPS.linear_forward(x, w, b, nf, 1.0, "clip", 0.01)
    args = (g, x, xf, xn, w, nf, [1.0, 0.5], "clip", 0.01, [True, bias])
    got = OPS.linear_backward(*args, [4, 10], std, scale)
    ref = OPS.linear_backward(*args, [4, 10], 0.0)
    assert torch.equal(_bits(got[0]), _bits(ref[0]))  # the input gradient is not scaled
    assert _same(got[1:], _noised_then_scaled(*ref[1:], [True, bias], (4, 10), std, scale))
    xc, gc, wc, _ = _data(dtype, (2, 2, 6, 6), (2, 3, 6, 6), 3, (2, 3, 3), seed=2)
    _, xf, xn = OPS.conv2d_forward(xc, wc, torch.zeros(3, dtype=dtype) if bias else None, nf, [1, 1], [1, 1],
                                    [1, 1], 1, 1.0, "clip", 0.01)
    args = (gc, xc, xf, xn, wc, nf, [1, 1], [1, 1], [1, 1], 1, "l2", [1.0, 0.5], "clip", 0.01, [True, bias])
    got = OPS.conv2d_backward(*args, [4, 10], std, scale)
    ref = OPS.conv2d_backward(*args, [4, 10], 0.0)
    assert torch.equal(_bits(got[0]), _bits(ref[0]))
    assert _same(got[1:], _noised_then_scaled(*ref[1:], [True, bias], (4, 10), std, scale))


@pytest.mark.parametrize("bad", [0.0, -0.5, float("inf"), float("nan")])
def test_release_ops_refuse_a_bad_scale(bad):
    x, g, w, factor = _data(torch.float32, (2, 3), (2, 4), 4, (3,))
    with pytest.raises(RuntimeError, match="scale must be finite and > 0"):
        OPS.linear_clipped_grads(g, x, factor, w, [True, True], [1, 2], 0.5, None, None, bad)
    nf = torch.zeros(1, dtype=torch.int64)
    _, xf, xn = OPS.linear_forward(x, w, None, nf, 1.0, "clip", 0.01)
    with pytest.raises(RuntimeError, match="scale must be finite and > 0"):
        OPS.linear_backward(g, x, xf, xn, w, nf, [1.0, 0.5], "clip", 0.01, [True, False], [4, 10], 0.5, bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("scale", SCALES)
def test_the_scaled_release_is_the_float64_truth_times_the_scale_once(dtype, scale):
    # Against float64 truth, not another fp32 computation: without a draw, Linear's release is
    # scale · Σ_i c_i Σ_t g_it x_itᵀ. Per entry the op rounds c_i g_it toward zero (relative r), sums
    # K = B·T products in the accumulation dtype (γ_K(u) of the absolute sum) and multiplies by the
    # scale (one more u): |got - truth| ≤ (K + 3)·u·scale·Σ|c_i g_it x_itᵀ|, u the accumulation dtype's
    # unit roundoff (fp16 data accumulates in fp32). A scale applied twice or not at all is off by a
    # factor of 1/3 to 2.5 there.
    x, g, w, factor = _data(dtype, (3, 5, 7), (3, 5, 4), 4, (7,), seed=3)
    gw, gb = OPS.linear_clipped_grads(g, x, factor, w, [True, True], [0, 0], 0.0, None, None, scale)
    c = factor.double()[:, None, None]
    gs, xs = c * g.double(), x.double()
    truth_w = scale * torch.einsum("bto,bti->oi", gs, xs)
    truth_b = scale * gs.sum((0, 1))
    abs_w = scale * torch.einsum("bto,bti->oi", gs.abs(), xs.abs())
    abs_b = scale * gs.abs().sum((0, 1))
    u = 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24
    k = g.shape[0] * g.shape[1]
    assert ((gw.double() - truth_w).abs() <= (k + 3) * u * abs_w).all()
    assert ((gb.double() - truth_b).abs() <= (k + 3) * u * abs_b).all()
