"""The release of kept per-example gradients (csrc/exact.cpp keep_instantiated, csrc/exact_release.cpp kept_release): a
Linear or Conv2d with T > 1 positions whose norms are taken by instantiation keeps each example's
[G_W, G_b] in the accumulation dtype and releases sum_i RZ(c_i G_i) from them (examples_release).

* Against float64 truth (no noise), for Linear and Conv2d (groups 1 and 2), with and without a bias,
  fp32/fp64/fp16/bf16 data, a non-finite example and a finite one at factor 0: within the GEMM's
  rounding over the positions, the rounding toward zero of c_i G_i and the sum over the batch.
* Each example alone is within C exactly (Fractions), with factors from the op's own bound.
* The noise: bit for bit philox_noise_(accumulate) on the noiseless release, the weight at offset
  and the bias at offset + 1.
* The sums: bit for bit examples_release on the kept values (its fixed order, examples.h).
* B = 0 (nothing kept: zeros and the noise) and B = 1.
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch

from bpclip_fast import _ops, exact

OPS = torch.ops.bpclip_fast
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DT_IDS = ["f32", "f64", "f16", "bf16"]
WS = 1 << 20


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _unit(dtype):
    """Unit roundoff of the accumulation dtype's round-to-nearest arithmetic (the norms' GEMMs, the
    CPU's default float32 matmul precision 'highest')."""
    return 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24


def _gamma(k, u):
    return k * u / (1 - k * u)


class Case:
    """One layer: shapes, its data x and upstream gradient g in `dtype`, and the ops' calls."""

    def __init__(self, kind, dtype, B, bias, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.kind, self.dtype, self.B, self.bias = kind, dtype, B, bias
        if kind == "linear":  # T = 8 positions, d = 3, p = 4: kept for every dtype (4 p d <= elt T p)
            self.T, self.geometry = 8, None
            x = torch.randn(B, 8, 3, generator=gen, dtype=torch.float64)
            g = torch.randn(B, 8, 4, generator=gen, dtype=torch.float64)
            self.weight = torch.randn(4, 3, generator=gen, dtype=torch.float64).to(dtype)
        else:  # conv2d, groups 1 or 2: 3x3 kernel on 8x8, T = 36, d = 9 per group, p = 2 per group
            G = 1 if kind == "conv" else 2
            self.T, self.geometry = 36, ([1, 1], [0, 0], [1, 1], G)
            x = torch.randn(B, G, 8, 8, generator=gen, dtype=torch.float64)
            g = torch.randn(B, 2 * G, 6, 6, generator=gen, dtype=torch.float64)
            self.weight = torch.randn(2 * G, 1, 3, 3, generator=gen, dtype=torch.float64).to(dtype)
        self.x, self.g = x.to(dtype), g.to(dtype)

    def norms(self):
        mask = [True, self.bias]
        if self.geometry is None:
            return OPS.linear_grad_norms(self.g, self.x, mask, "instantiate", WS, True, None)
        stride, padding, dilation, groups = self.geometry
        return OPS.conv2d_grad_norms(self.g, self.x, [3, 3], stride, padding, dilation, groups, mask, "instantiate",
                                     WS, True, None)

    def release(self, factor, kw, kb, seed=0, offset=0, std=0.0):
        mask = [True, self.bias]
        if self.geometry is None:
            return OPS.linear_clipped_grads(self.g, self.x, factor, self.weight, mask, [seed, offset], std, kw, kb)
        stride, padding, dilation, groups = self.geometry
        return OPS.conv2d_clipped_grads(self.g, self.x, factor, self.weight, stride, padding, dilation, groups, mask,
                                        [seed, offset], std, kw, kb)

    def per_example(self, x, g):
        """float64 ([B, *weight], [B, C_out]) of the given (float64) data."""
        if self.geometry is None:
            return torch.einsum("btp,btd->bpd", g, x), g.sum(1)
        stride, padding, dilation, groups = self.geometry
        w = torch.stack([torch.nn.grad.conv2d_weight(x[i:i + 1], tuple(self.weight.shape), g[i:i + 1], stride,
                                                     padding, dilation, groups) for i in range(x.shape[0])])
        return w, g.sum((2, 3))


def _factor(B, acc, seed=1):
    c = torch.rand(B, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.25
    return c.to(acc)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind", ["linear", "conv", "conv_groups"])
@pytest.mark.parametrize("B", [1, 6])
def test_kept_release_is_the_clipped_sum_in_float64(kind, bias, dtype, B):
    case = Case(kind, dtype, B, bias)
    acc = _acc(dtype)
    factor = _factor(B, acc)
    if B > 1:  # a non-finite example (factor 0, as the factors give it) and a finite one at factor 0
        case.x[1].view(-1)[5] = float("inf")
        factor[1] = 0
        factor[4] = 0
    _, _, kw, kb = case.norms()
    assert kw.numel() > 0 and kw.dtype == acc, "the layer must take the kept path"
    assert (kb.numel() > 0) == bias
    gw, gb = case.release(factor, kw, kb)
    assert gw.dtype == acc and gw.shape == case.weight.shape  # the caller rounds to the parameter dtype
    assert not bias or (gb.dtype == acc and gb.shape == (case.weight.shape[0],))

    keep = factor.double() > 0
    x64, g64 = case.x.double()[keep], case.g.double()[keep]
    c = factor.double()[keep]
    tw, tb = case.per_example(x64, g64)
    aw, ab = case.per_example(x64.abs(), g64.abs())  # entrywise sum_t |g_t| |x_t|, sum_t |g_t|
    u = _unit(dtype)
    r = 2 * u  # the rounding toward zero of c_i G_i
    # G_i by an acc-dtype GEMM (bias: an acc-dtype or double sum) over T positions, RZ(c_i G_i), the
    # sum over the batch in acc: relative to sum_i c_i A_i entrywise.
    e = (1 + _gamma(case.T, u)) * (1 + r) * (1 + _gamma(max(B, 2), u)) - 1
    for got, truth, a in ((gw, tw, aw), (gb, tb, ab) if bias else (None, None, None)):
        if got is None:
            continue
        want = (c.view(-1, *[1] * (truth.dim() - 1)) * truth).sum(0)
        tol = e * (c.view(-1, *[1] * (a.dim() - 1)) * a).sum(0)
        err = (got.double() - want).abs()
        assert torch.isfinite(got).all(), "a factor-0 example reached the sum"
        assert (err <= tol).all(), f"max excess {(err - tol).max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", ["linear", "conv_groups"])
def test_each_kept_example_alone_is_within_c_exactly(kind, dtype):
    case = Case(kind, dtype, 5, True, seed=3)
    acc = _acc(dtype)
    _, bound, kw, kb = case.norms()
    assert kw.numel() > 0
    C = 0.5
    factor = exact.factors(bound, C, "clip", 0.0, torch.zeros(1, dtype=torch.int64), dtype)
    assert factor.dtype == acc and (factor < 1).all(), "the test wants every example clipped"
    for i in range(case.B):
        one = torch.zeros_like(factor)
        one[i] = factor[i]
        gw, gb = case.release(one, kw, kb)
        sq = sum(Fraction(v) ** 2 for t in (gw, gb) for v in t.double().reshape(-1).tolist())
        assert sq <= Fraction(C) ** 2, f"example {i}: norm^2 {float(sq)!r} above C^2"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_kept_release_noise_is_philox_noise_at_offset_and_offset_plus_one(kind, bias, dtype):
    case = Case(kind, dtype, 6, bias, seed=5)
    factor = _factor(6, _acc(dtype), seed=6)
    _, _, kw, kb = case.norms()
    assert kw.numel() > 0
    seed, offset, std = 0x1234_5678_9ABC, 40, 0.83
    gw, gb = case.release(factor, kw, kb, seed, offset, std)
    sw, sb = case.release(factor, kw, kb)
    assert torch.equal(gw, _ops.philox_noise_(sw.clone(), seed, offset, std, accumulate=True))
    if bias:
        assert torch.equal(gb, _ops.philox_noise_(sb.clone(), seed, offset + 1, std, accumulate=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", ["linear", "conv_groups"])
def test_kept_release_sums_in_the_examples_release_order(kind, dtype):
    # 40 examples: five per part of examples.h's fixed order; the sums are its bits, the ones whose
    # bound (|RZ(c g)| <= c |g| of the very values normed) the file comment proves.
    case = Case(kind, dtype, 40, True, seed=7)
    factor = _factor(40, _acc(dtype), seed=8)
    factor[9] = 0
    _, _, kw, kb = case.norms()
    assert kw.numel() > 0
    gw, gb = case.release(factor, kw, kb, 11, 12, 0.5)
    ww, wb = _ops.examples_release(kw, kb, factor, 11, 12, 0.5)
    assert torch.equal(gw.reshape(-1), ww) and torch.equal(gb, wb)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_empty_batch_releases_only_the_noise(kind, dtype):
    case = Case(kind, dtype, 0, True)
    acc = _acc(dtype)
    _, _, kw, kb = case.norms()
    assert kw.numel() == 0  # nothing kept for no examples
    factor = torch.zeros(0, dtype=acc)
    gw, gb = case.release(factor, kw, kb)
    assert torch.equal(gw, torch.zeros(case.weight.shape, dtype=acc)) and torch.equal(gb, torch.zeros(gb.shape, dtype=acc))
    nw, nb = case.release(factor, kw, kb, 3, 4, 1.5)
    assert torch.equal(nw, _ops.philox_noise_(torch.zeros_like(gw), 3, 4, 1.5))
    assert torch.equal(nb, _ops.philox_noise_(torch.zeros_like(gb), 3, 5, 1.5))


def test_a_kept_bias_sum_that_overflows_is_in_the_bound():
    # Upstream-gradient entries +-1.5 * 2^127 alternating in pairs over the 8 positions: each bias
    # entry's double sum is 0, but its fp32 sum, the value kept and released, overflows (+Inf); the
    # input is tiny, so the weight's instantiated gradient is finite. The bound must see the kept
    # +Inf (factor 0): a bound from the double sum is finite (~2^109, the GEMMs' error terms), and a
    # large C gave a factor above the floor that released +Inf.
    case = Case("linear", torch.float32, 3, True, seed=9)
    a = 1.5 * 2.0 ** 127
    case.g[1] = torch.tensor([a, a, -a, -a, a, a, -a, -a]).unsqueeze(1)
    case.x[1] = 2.0 ** -100
    _, bound, kw, kb = case.norms()
    assert kw.numel() > 0 and torch.isfinite(kw[1]).all() and not torch.isfinite(kb[1]).all()
    C = 1e30
    counter = torch.zeros(1, dtype=torch.int64)
    factor = exact.factors(bound, C, "clip", 0.0, counter, torch.float32)
    assert factor[1] == 0 and counter.item() == 1
    gw, gb = case.release(factor, kw, kb)
    assert torch.isfinite(gw).all() and torch.isfinite(gb).all()


# ------------------------------------------------------------------------------ beyond the memory-neutral rule


def _wide_case(kind, dtype, B, bias):
    """Kept gradients larger than grad_out (4 p d > elt T p): Linear T = 2, d = 8, p = 3 (by
    instantiation); Conv2d 3x3 on 4x4 from 4 channels, T = 4, d = 36, p = 2."""
    gen = torch.Generator().manual_seed(3)
    case = Case("linear" if kind == "linear" else "conv", dtype, B, bias)
    if kind == "linear":
        case.T, shapes = 2, ((B, 2, 8), (B, 2, 3), (3, 8))
    else:
        case.T, shapes = 4, ((B, 4, 4, 4), (B, 2, 2, 2), (2, 4, 3, 3))
    x, g, w = (torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes)
    case.x, case.g, case.weight = x, g, w
    return case


def _norms_with(case, extra):
    mask = [True, case.bias]
    if case.geometry is None:
        return OPS.linear_grad_norms(case.g, case.x, mask, "instantiate", WS, True, None, extra)
    stride, padding, dilation, groups = case.geometry
    return OPS.conv2d_grad_norms(case.g, case.x, [3, 3], stride, padding, dilation, groups, mask, "instantiate",
                                 WS, True, None, extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_keep_extra_keeps_beyond_the_memory_neutral_rule_up_to_its_bytes(kind, bias, dtype):
    """keep_extra (exact.KEPT_BYTES' share): a layer whose kept gradients are larger than grad_out is
    kept when they and the bias sums fit in it, byte for byte, and not otherwise; the fake agrees."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B = 3
    case = _wide_case(kind, dtype, B, bias)
    p, T = case.g.shape[-1] if kind == "linear" else case.g.shape[1], case.T
    d = case.weight[0].numel()
    assert _acc(dtype).itemsize * p * d > case.g.element_size() * T * p, "the case must be beyond the memory-neutral rule"
    need = B * p * (d + (1 if bias else 0)) * _acc(dtype).itemsize
    for extra, kept in ((0, False), (need - 1, False), (need, True), (10 * need, True)):
        _, _, kw, kb = _norms_with(case, extra)
        assert (kw.numel() > 0) == kept, (extra, need)
        assert (kb.numel() > 0) == (kept and bias)
        with FakeTensorMode() as mode:
            fake = copy.copy(case)
            fake.x, fake.g = mode.from_tensor(case.x), mode.from_tensor(case.g)
            _, _, fw, fb = _norms_with(fake, extra)
        assert fw.shape == kw.shape and fb.shape == kb.shape, "the fake must mirror keep_instantiated"
    # What the wider rule keeps is released as the kept path is: the clipped sum within its rounding.
    _, bound, kw, kb = _norms_with(case, need)
    factor = _factor(B, _acc(dtype))
    gw, gb = case.release(factor, kw, kb)
    tw, tb = case.per_example(case.x.double(), case.g.double())
    aw, ab = case.per_example(case.x.double().abs(), case.g.double().abs())
    u = _unit(dtype)
    e = (1 + _gamma(case.T, u)) * (1 + 2 * u) * (1 + _gamma(B, u)) - 1
    c = factor.double()
    for got, truth, a in ((gw, tw, aw),) + (((gb, tb, ab),) if bias else ()):
        want = (c.view(-1, *[1] * (truth.dim() - 1)) * truth).sum(0)
        tol = e * (c.view(-1, *[1] * (a.dim() - 1)) * a).sum(0)
        assert ((got.double() - want).abs() <= tol).all()


def _wide_net():
    """Two 3x3 convs 16 -> 16 on 6x6 (T = 36, d = 144, p = 16: instantiated, kept gradients twice
    grad_out's size in float64), then a Linear: only KEPT_BYTES decides what the convs keep."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, padding=1, dtype=torch.float64), torch.nn.Tanh(),
                               torch.nn.Conv2d(16, 16, 3, padding=1, dtype=torch.float64), torch.nn.Flatten(),
                               torch.nn.Linear(16 * 36, 5, dtype=torch.float64))


def record_kept(monkeypatch) -> list:
    """``(layer name, kept?)`` of every norms call from now on (exact._norms wrapped)."""
    seen, norms = [], exact._norms

    def recording(layer, *args, **kwargs):
        bound, kept = norms(layer, *args, **kwargs)
        seen.append((layer.layer_name, kept is not None))
        return bound, kept

    monkeypatch.setattr(exact, "_norms", recording)
    return seen


def clipped_release_truth(net, x, y, mode, C):
    """``{name: float64 gradient}``: the clipped sum of torch.func's per-example gradients of the
    summed cross-entropy (flat: one C over all trainable parameters; per_layer: C/√L per layer)."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in net.named_parameters() if not v.requires_grad}

    def loss(ps, xi, yi):
        out = functional_call(net, {**ps, **frozen}, (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0), reduction="sum")

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    groups = {}
    for k in per:
        groups.setdefault(k.rsplit(".", 1)[0], []).append(k)
    want = {}
    for keys in [list(per)] if mode == "flat" else list(groups.values()):
        c = C if mode == "flat" else C / math.sqrt(len(groups))
        norm = sum(per[k].flatten(1).square().sum(1) for k in keys).sqrt()
        f = torch.clamp(c / norm, max=1.0)
        for k in keys:
            want[k] = (f.view(-1, *[1] * (per[k].dim() - 1)) * per[k]).sum(0)
    return want


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_a_backward_pass_keeps_at_most_kept_bytes_beyond_the_memory_neutral_rule(mode, monkeypatch):
    """With KEPT_BYTES one conv's kept gradients: flat keeps the first conv its backward reaches and
    recomputes the other (the book holds both until the collector), per_layer keeps both (each is
    released at once); the releases equal the clipped sums of torch.func's per-example gradients."""
    from bpclip_fast import nn as bnn

    B, C = 3, 0.9
    x = torch.randn(B, 16, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 3, 1])
    net = _wide_net()
    want = clipped_release_truth(net, x, y, mode, C)
    model = copy.deepcopy(net)
    bnn.convert_model(model, clipping=mode, max_grad_norm=C)
    monkeypatch.setattr(exact, "KEPT_BYTES", B * 16 * (144 + 1) * 8)
    seen = record_kept(monkeypatch)
    torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    assert seen == [("4", False), ("2", True), ("0", mode == "per_layer")]
    for k, w in want.items():
        torch.testing.assert_close(model.get_parameter(k).grad, w, rtol=1e-10, atol=1e-12, msg=k)


def test_fp64_keeps_without_an_allowance_only_what_is_no_larger_than_grad_out():
    """fp64 data keeps fp64 gradients (8 bytes an entry): the memory-neutral rule must count them so.
    Linear T = 4, d = 6, p = 2 in fp64: kept 8·p·d = 96 bytes against grad_out's 8·T·p = 64 (kept
    before 2026-11-27, when the rule counted 4 bytes an entry); d = 4 (64 against 64) is kept."""
    gen = torch.Generator().manual_seed(5)
    for d, kept in ((6, False), (4, True)):
        x = torch.randn(3, 4, d, generator=gen, dtype=torch.float64)
        g = torch.randn(3, 4, 2, generator=gen, dtype=torch.float64)
        _, _, kw, _ = OPS.linear_grad_norms(g, x, [True, True], "instantiate", WS, True, None, 0)
        assert (kw.numel() > 0) == kept, d
        assert kw.numel() == 0 or kw.dtype == torch.float64
