"""Issue 24: the per-example bound of the exact modes (``‖c_i G_i‖ ≤ C`` after rounding) for memory
layouts other than contiguous NCHW, and for fp16/bf16/fp32 values that the clip factor puts in the
subnormal range (csrc/exact.cpp, file comment; docs/design.md §1b "Rounding").

Each test removes example 0 and compares the change of the release (noise off: ``convert_model``
arms no noise) with ``C`` (flat: over all layers; per_layer: ``C_l`` per layer), in float64 where the
model is float64. Low-precision models release ``RN(Σ_i c_i G_i + noise)`` with one rounding to the
parameter dtype *after* the noise (post-processing of the noised fp32 sum); with the noise off that
last rounding is visible, so those tests check the fp32 value the ops return before it, exactly
(fractions), and that the stored gradient is that value rounded once.
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bpclip_fast import exact
from bpclip_fast import nn as bnn
from bpclip_fast.models import resnet20_gn

OPS = torch.ops.bpclip_fast

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def grads(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    return {k: p.grad.detach().double().clone() for k, p in model.named_parameters() if p.grad is not None}


def layer_keys(model):
    """``{layer name: [its parameter names]}``: the per_layer clipping units."""
    out = {}
    for k, _ in model.named_parameters():
        out.setdefault(k.rsplit(".", 1)[0], []).append(k)
    return out


def removal_ratios(model, x, y, mode, c):
    """The change of the release when example 0 is removed, over ``C`` (flat) or the largest over
    the layers of change / ``C_l`` (per_layer), in float64."""
    full, part = grads(model, x, y), grads(model, x[1:], y[1:])
    diff = {k: full[k] - part.get(k, torch.zeros_like(full[k])) for k in full}
    if mode == "flat":
        return math.sqrt(sum(float(v.pow(2).sum()) for v in diff.values())) / c
    units = layer_keys(model)
    cl = c / math.sqrt(len(units))
    return max(math.sqrt(sum(float(diff[k].pow(2).sum()) for k in keys)) / cl for keys in units.values())


# --------------------------------------------------------------------------- 1. memory layouts

class PermutedInput(nn.Module):
    """An NHWC batch permuted to NCHW in the forward with no ``.contiguous()``: a channels_last view."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x.permute(0, 3, 1, 2))


def padded_net(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2, padding=2, dilation=2),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 5)).to(dtype)


def spike_batch(n=4, shape=(3, 8, 8), seed=1):
    """Example 0 is one large pixel (the layout bug read it as padding: bound near 0, factor 1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *shape), generator=gen, dtype=torch.float64)
    x[0] = 0
    x[0, 2, 5, 0] = 1e4
    return x, torch.randint(0, 5, (n,), generator=gen)





def laid_out(model, x, layout):
    """``(model, input)`` with the input (and, for channels_last, the weights) in ``layout``; the
    values are the same as ``x``'s."""
    if layout == "channels_last":
        return model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    if layout == "permuted":
        return PermutedInput(model), x.permute(0, 2, 3, 1).contiguous()
    if layout == "sliced":  # every other column of a twice-wide tensor: a strided slice
        wide = torch.zeros(*x.shape[:3], 2 * x.shape[3], dtype=x.dtype)
        wide[..., ::2] = x
        return model, wide[..., ::2]
    raise AssertionError(layout)


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("layout", ["channels_last", "permuted", "sliced"])
def test_padded_conv_layouts_keep_each_examples_contribution_within_c(mode, layout):
    c = 0.5
    x, y = spike_batch()
    model = copy.deepcopy(padded_net())
    bnn.convert_model(model, clipping=mode, max_grad_norm=c)
    model, xl = laid_out(model, x, layout)
    if layout != "permuted":
        assert not xl.is_contiguous()
    ratio = removal_ratios(model, xl, y, mode, c)
    assert ratio <= 1 + 1e-12, ratio


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_expanded_input_keeps_each_examples_contribution_within_c(mode):
    """One image broadcast over the batch (stride 0 in the batch dimension), the others different
    through a later layer's input: each example's bound comes from its own (shared) pixels."""
    c = 0.5
    x, y = spike_batch(n=3)
    xe = x[:1].expand(3, -1, -1, -1)
    model = padded_net()
    bnn.convert_model(model, clipping=mode, max_grad_norm=c)
    assert removal_ratios(model, xe, y, mode, c) <= 1 + 1e-12


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "permuted"])
def test_layout_gives_the_release_of_the_contiguous_model(mode, layout):
    """The same values in another layout release the same gradients (to float64 rounding)."""
    c = 0.5
    x, y = spike_batch()
    base = padded_net()
    bnn.convert_model(base, clipping=mode, max_grad_norm=c)
    ref = grads(base, x, y)
    model = copy.deepcopy(base)
    if layout != "contiguous":
        model, x = laid_out(model, x, layout)
    got = grads(model, x, y)
    for k, v in ref.items():
        key = k if layout != "permuted" else f"net.{k}"
        torch.testing.assert_close(got[key], v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_resnet20_gn_channels_last_within_c(mode):
    """The finding's model: ResNet-20 with GroupNorm, channels_last, random data (8x8 input)."""
    torch.manual_seed(2)
    c = 1.0
    model = resnet20_gn(in_channels=3).double()
    bnn.convert_model(model, clipping=mode, max_grad_norm=c)
    model = model.to(memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 3, 8, 8, generator=gen, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (3,), generator=gen)
    assert removal_ratios(model, x, y, mode, c) <= 1 + 1e-12


@pytest.mark.parametrize("layout", ["channels_last", "permuted"])
def test_conv_norms_op_is_layout_independent(layout):
    """conv2d_grad_norms on the same values in another layout (input and upstream gradient) gives
    the same squared norms and bounds."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 7, 6, generator=gen, dtype=torch.float64)
    g = torch.randn(3, 6, 4, 3, generator=gen, dtype=torch.float64)
    args = ([3, 3], [2, 2], [1, 1], [1, 1], 2, [True, True], "instantiate", 1 << 20, False)
    ref = OPS.conv2d_grad_norms(g, x, *args)
    if layout == "channels_last":
        xl, gl = (t.contiguous(memory_format=torch.channels_last) for t in (x, g))
    else:
        xl, gl = (t.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) for t in (x, g))
    for method in ("ghost", "instantiate"):
        a = list(args)
        a[6] = method
        want = OPS.conv2d_grad_norms(g, x, *a)
        got = OPS.conv2d_grad_norms(gl, xl, *a)
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=0)
    assert ref[0].shape == (3,)


# --------------------------------------------------------------------------- 2. subnormals

def cancelling(T, d, p, s, v, dtype):
    """One example whose positions cancel: g = v, -2v and x = u, u/2 alternately (so G_W is 0 or
    nearly), with large inputs: the bound is the margins only and the factor is tiny."""
    u = torch.full((d,), s, dtype=torch.float64)
    x = torch.stack([u if t % 2 == 0 else u / 2 for t in range(T)]).unsqueeze(0).to(dtype)
    g = torch.tensor([v if t % 2 == 0 else -2 * v for t in range(T)], dtype=torch.float64)
    return x, g.reshape(1, T, 1).expand(1, T, p).to(dtype).contiguous()


def exact_frobenius_sq(t):
    return sum((Fraction(v) ** 2 for v in t.double().reshape(-1).tolist()), Fraction(0))


# (dtype, T, s, v, C): fp16's subnormals at T = 32 and 128 (the finding; C found by a search);
# C = bound·2^-k (k given as a negative int): fp32 storage of c·g deep in fp32's subnormals with a
# factor below the floor 2^-60 (k = 146), and with a kept factor 2^-59 but g so small (2^-80) that
# c·g is subnormal anyway; bf16 likewise.
SUBNORMAL_CASES = [
    (torch.float16, 32, 5611.52, 0.7, 1.0273863153997809e-4),
    (torch.float16, 128, 2805.76, 0.7, 4.49121929705143e-4),
    (torch.float32, 32, 2.0 ** 60 * 1.37, 0.7, -146),
    (torch.float32, 32, 2.0 ** 60 * 1.37, 0.7 * 2.0 ** -80, -59),
    (torch.bfloat16, 32, 2.0 ** 60 * 1.37, 0.7, -146),
    (torch.bfloat16, 32, 2.0 ** 60 * 1.37, 0.7 * 2.0 ** -80, -59),
]


def threshold(c, bound):
    return c if c > 0 else float(bound) * 2.0 ** c * 1.3


def case_id(v):
    return str(v).replace("torch.", "")


@pytest.mark.parametrize("dtype,T,s,v,c", SUBNORMAL_CASES, ids=case_id)
def test_cancelling_example_release_is_within_c_exactly(dtype, T, s, v, c):
    """The clipped gradient the op returns (before the one rounding to the parameter dtype), one
    example alone, noise off: its exact norm (fractions) is at most C."""
    d, p = 2 * T, 4
    x, g = cancelling(T, d, p, s, v, dtype)
    _, bound, _, _ = OPS.linear_grad_norms(g, x, [True, False], "instantiate", 1 << 24, False)
    c = threshold(c, bound)
    factor = exact.factors(bound, c, "clip", 0.01, torch.zeros(1, dtype=torch.long), dtype)
    w = torch.zeros(p, d, dtype=dtype)
    gw, _ = OPS.linear_clipped_grads(g, x, factor, w, [True, False], [0, 0], 0.0, None, None)
    assert exact_frobenius_sq(gw) <= Fraction(c) ** 2, float(gw.double().norm()) / c


@pytest.mark.parametrize("dtype,T,s,v,c", SUBNORMAL_CASES, ids=case_id)
def test_cancelling_example_through_the_layer(dtype, T, s, v, c):
    """The same example through a clipped Linear: the stored gradient is the op's clipped sum
    rounded once (to nearest) to the parameter dtype, so within C up to that one rounding."""
    d, p = 2 * T, 4
    x, g = cancelling(T, d, p, s, v, dtype)
    _, bound, _, _ = OPS.linear_grad_norms(g, x, [True, False], "instantiate", 1 << 24, False)
    c = threshold(c, bound)
    model = nn.Sequential(nn.Linear(d, p, bias=False, dtype=dtype))
    bnn.convert_model(model, clipping="per_layer", max_grad_norm=c)
    model[0].norm_method = "instantiate"
    model(x).backward(g)
    stored = model[0].weight.grad
    assert stored.dtype == dtype
    # one rounding to nearest of a value within C: |stored| <= |v|(1 + u) + q/2 entrywise
    unit = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[dtype]
    tiny = {torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134, torch.float32: 2.0 ** -150}[dtype]
    slack = stored.double().abs() * unit + tiny
    assert float((stored.double().abs() - slack).clamp(min=0).norm()) <= c, float(stored.double().norm()) / c


def test_factor_below_the_floor_is_zero():
    """An example whose factor would fall below 2^-60 (a bound above 2^60·C) is given factor 0 (the
    absolute rounding margin is covered only for factors ≥ 2^-60), and is not counted non-finite."""
    counter = torch.zeros(1, dtype=torch.long)
    bound = torch.tensor([0.5, 2.0 ** 59, 2.0 ** 61, 2.0 ** 70], dtype=torch.float64)
    f = exact.factors(bound, 1.0, "clip", 0.01, counter, torch.float32)
    assert f[0] == 1 and f[1] > 0 and f[2] == 0 and f[3] == 0
    assert int(counter) == 0
    f = exact.factors(bound, 1.0, "normalize", 0.01, counter, torch.float64)
    assert f[1] > 0 and f[3] == 0


def test_low_precision_sums_are_not_rounded_before_the_noise():
    """fp16 Conv2d under per_layer: the release is RN(fp32 sum + noise). With many examples whose
    fp32 sum is not an fp16 number, the stored gradient equals the fp32 release rounded once, not the
    fp16-rounded sum plus the noise rounded again."""
    torch.manual_seed(4)
    conv = nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float16)
    x = torch.randn(6, 2, 5, 5).half()
    g = torch.randn(6, 3, 5, 5).half()
    factor = torch.rand(6)
    w = conv.weight.detach()
    gw, gb = OPS.conv2d_clipped_grads(g, x, factor, w, [1, 1], [1, 1], [1, 1], 1, [True, True], [7, 3], 0.25,
                                      None, None)
    assert gw.dtype == torch.float32 and gb.dtype == torch.float32
    gs = OPS.scale_rows(g.float(), factor)
    ref_w = torch.nn.grad.conv2d_weight(x.double(), w.shape, gs.double(), padding=1)
    noise = torch.zeros(w.shape)
    OPS.philox_noise_(noise, 7, 3, 0.25, False)
    # fp32 summation of n = B·H·W products (exact in fp32) and the noise: |error| <= γ_{n+1}(2^-24)·Σ|terms|
    n = x.shape[0] * x.shape[2] * x.shape[3]
    gamma = (n + 1) * 2.0 ** -24 / (1 - (n + 1) * 2.0 ** -24)
    abs_sum = torch.nn.grad.conv2d_weight(x.double().abs(), w.shape, gs.double().abs(), padding=1)
    assert ((gw.double() - ref_w - noise.double()).abs() <= gamma * (abs_sum + noise.double().abs())).all()
    # an fp16 rounding of the sum before the noise (the old release) is outside that margin somewhere
    assert ((ref_w.half().double() + noise.double() - ref_w - noise.double()).abs()
            > gamma * (abs_sum + noise.double().abs())).any()


def one_rounding_margin(out, ref, abs_sum, n, dtype):
    """Whether ``out`` (in ``dtype``) is ``ref`` (float64: the clipped sum plus the noise) summed in
    fp32 (|error| <= γ_{n+1}(2^-24)·abs_sum) and then rounded to nearest once (half an ulp of dtype)."""
    gamma = (n + 1) * 2.0 ** -24 / (1 - (n + 1) * 2.0 ** -24)
    unit = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    tiny = {torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}[dtype]
    fp32 = gamma * abs_sum
    return (out.double() - ref).abs() <= (ref.abs() + fp32) * unit / (1 - unit) + fp32 + tiny


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backprop_layers_round_the_noised_sum_once(dtype):
    """Backpropagation clipping's fp16/bf16 Linear: ∇W and ∇b are the fp32 sum of the clipped
    examples plus the noise, rounded once; a sum rounded to the dtype before the noise is not."""
    gen = torch.Generator().manual_seed(6)
    b, fin, fout, std = 64, 16, 16, 0.01
    x = torch.randn(b, fin, generator=gen).to(dtype)
    w = torch.randn(fout, fin, generator=gen).to(dtype)
    g = torch.randn(b, fout, generator=gen).to(dtype)
    counter = torch.zeros(1, dtype=torch.long)
    _, xf, xn = OPS.linear_forward(x, w, None, counter, 1.5, "clip", 0.01)
    _, gw, gb = OPS.linear_backward(g, x, xf, xn, w, counter, [1.5, 0.7], "clip", 0.01, [False, True], [9, 4], std)
    xc = OPS.scale_rows(x, xf).double()
    gc = OPS.clip_rows(g, torch.zeros(1, dtype=torch.long), 0.7, "l2", "clip", 0.01)[0].double()
    noise_w, noise_b = torch.zeros(fout, fin), torch.zeros(fout)
    OPS.philox_noise_(noise_w, 9, 4, std, False)
    OPS.philox_noise_(noise_b, 9, 5, std, False)
    ref_w, ref_b = gc.t() @ xc + noise_w.double(), gc.sum(0) + noise_b.double()
    abs_w, abs_b = gc.abs().t() @ xc.abs() + noise_w.double().abs(), gc.abs().sum(0) + noise_b.double().abs()
    assert one_rounding_margin(gw, ref_w, abs_w, b, dtype).all()
    assert one_rounding_margin(gb, ref_b, abs_b, b, dtype).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backprop_conv_rounds_the_noised_sum_once(dtype):
    """The same for Conv2d (its input gradient stays in the data dtype)."""
    gen = torch.Generator().manual_seed(7)
    b, std = 16, 0.01
    x = torch.randn(b, 4, 5, 5, generator=gen).to(dtype)
    w = torch.randn(8, 4, 3, 3, generator=gen).to(dtype)
    g = torch.randn(b, 8, 5, 5, generator=gen).to(dtype)
    counter = torch.zeros(1, dtype=torch.long)
    _, xf, xn = OPS.conv2d_forward(x, w, None, counter, [1, 1], [1, 1], [1, 1], 1, 4.0, "clip", 0.01)
    gx, gw, gb = OPS.conv2d_backward(g, x, xf, xn, w, counter, [1, 1], [1, 1], [1, 1], 1, "l15", [4.0, 2.0], "clip",
                                     0.01, [True, True], [9, 4], std)
    assert gw.dtype == dtype and gb.dtype == dtype and gx.dtype == dtype
    xc = OPS.scale_rows(x, xf).double()
    gc = OPS.clip_rows(g, torch.zeros(1, dtype=torch.long), 2.0, "l15", "clip", 0.01)[0].double()
    noise_w, noise_b = torch.zeros(w.shape), torch.zeros(8)
    OPS.philox_noise_(noise_w, 9, 4, std, False)
    OPS.philox_noise_(noise_b, 9, 5, std, False)
    ref_w = torch.nn.grad.conv2d_weight(xc, w.shape, gc, padding=1) + noise_w.double()
    abs_w = torch.nn.grad.conv2d_weight(xc.abs(), w.shape, gc.abs(), padding=1) + noise_w.double().abs()
    ref_b, abs_b = gc.sum((0, 2, 3)) + noise_b.double(), gc.abs().sum((0, 2, 3)) + noise_b.double().abs()
    assert one_rounding_margin(gw, ref_w, abs_w, b * 25, dtype).all()
    assert one_rounding_margin(gb, ref_b, abs_b, b * 25, dtype).all()
    # the input gradient is still the data dtype's convolution of the clipped upstream gradient
    ref_x = torch.nn.grad.conv2d_input(x.shape, w.double(), gc, padding=1)
    assert gx.shape == x.shape and torch.isfinite(gx).all() and ref_x.abs().max() > 0
