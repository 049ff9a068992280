"""conv2d_grad_norms at T > 1 against float64 truth, and the patches op it reads (issue 25).

The per-example gradient of a Conv2d is G = [G_W, G_b], G_W = sum_t g_t U_t^T per channel group
(U_t the zero-padded patch at output position t), G_b = sum_t g_t. The truth here is computed in
float64 from F.unfold of the input upcast (copies, no arithmetic) and an einsum: for fp32/fp16/bf16
data every product is exact in float64 and the sums of at most T·d terms err by < 1e-12
relatively, far inside the fp32 bound's own slack (>= 2^-23 P); fp64 data is checked exactly
(fractions). The bound must (a) cover the truth and (b) exceed it by no more than twice the error
terms of csrc/exact.cpp's file comment evaluated on the true position norms (so a bound made
loose by a lost or inflated position norm, e.g. fp32 squares that overflow or underflow, fails).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

import bpclip_fast  # noqa: F401  (loads the extension)

OPS = torch.ops.bpclip_fast


def gamma(k, u):
    return k * u / (1 - k * u)


def layout(t, kind):
    """The same values as ``t`` in another memory layout (the op must read the same pixels)."""
    if kind == "contiguous":
        return t.contiguous()
    if kind == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    if kind == "permuted":  # channels outermost in memory
        return t.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    if kind == "sliced":  # a strided window of a larger buffer, with a storage offset
        n, c, h, w = t.shape
        big = torch.full((n, c + 1, h + 2, 2 * w), float("nan"), dtype=t.dtype)
        big[:, 1:, 1:-1, ::2] = t
        return big[:, 1:, 1:-1, ::2]
    if kind == "expanded":  # one example's values repeated by a zero batch stride
        return t[:1].expand(t.shape)
    raise ValueError(kind)


def truth(g, x, k, stride, padding, dilation, groups):
    """float64 per-example ||G||, and the position sums the error terms are made of."""
    B = x.shape[0]
    U = F.unfold(x.double(), k, dilation=dilation, padding=padding, stride=stride)  # [B, C kh kw, T]
    T = U.shape[-1]
    U = U.reshape(B, groups, -1, T)
    gg = g.double().reshape(B, groups, -1, T)
    gw = torch.einsum("bgpt,bgdt->bgpd", gg, U)
    gb = gg.sum(-1)
    norm = (gw.square().sum((1, 2, 3)) + gb.square().sum((1, 2))).sqrt()
    a, b = U.square().sum(2).sqrt(), gg.square().sum(2).sqrt()  # [B, G, T]
    return norm, a, b, U, gg


def allowed_excess(a, b, T, d, p, ghost, acc):
    """Twice the bound's error terms (csrc/exact.cpp's file comment) on the true position norms
    a, b [B, G, T], per example: what the bound may exceed ||G|| by."""
    fp64 = acc == torch.float64
    u = 2.0 ** -53 if fp64 else 2.0 ** -24
    v = 2.0 ** -53
    tau = 2.0 ** -1022 if fp64 else 2.0 ** -126
    r = 2.0 ** -52 if fp64 else 2.0 ** -23
    q = 2.0 ** -1074 if fp64 else 2.0 ** -149
    M, A1, B1 = (a * b).sum(-1), a.sum(-1), b.sum(-1)  # [B, G]
    P = ((a * a + 1).sqrt() * b).sum((1, 2))
    X = (a * a + 1).sqrt().sum((1, 2))
    gT = gamma(T, u)
    if ghost:
        gd, gp = gamma(d, u), gamma(p, u)

        def kap(k, gk):
            return tau * math.sqrt(k) + (1 + gk) * 0.5 * math.sqrt(2 * k * tau * (k + 1) * (1 + gk))

        kx, kg = kap(d, gd), kap(p, gp)
        E = (gd + gp + gd * gp) * M * M + 2 * M * (kx * (1 + gp) * B1 + kg * (1 + gd) * A1) + \
            2 * kx * kg * (T * M + A1 * B1)
        w = v + gamma(T * T, v) * (1 + v)
        err = ((1 + w) * E + w * M * M).sum(1).sqrt()
        kappa = gamma(T, v) + r
    else:
        rdp = math.sqrt(d * p)
        extra = (tau * (A1 + B1) * rdp * M).sqrt() + (1 + gT) * (2 * T * tau * (T + 1) * (1 + gT) * rdp * M).sqrt()
        err = (gT * M + extra).sum(1)
        kappa = 2 * gT + gamma(T, v) + r
    absolute = 2.0 ** 61 * q * math.sqrt(p) * X
    return 2 * (err + kappa * P + absolute)


def exact_norm_sq(U, gg):
    """||G||^2 exactly (fractions) from float64 patches and upstream gradients [B, G, *, T]."""
    out = []
    for i in range(U.shape[0]):
        s = Fraction(0)
        for grp in range(U.shape[1]):
            u = [[Fraction(v) for v in row] for row in U[i, grp].tolist()]
            for grow in gg[i, grp].tolist():
                gf = [Fraction(v) for v in grow]
                s += sum(gf, Fraction(0)) ** 2
                for urow in u:
                    s += sum((x * y for x, y in zip(gf, urow)), Fraction(0)) ** 2
        out.append(s)
    return out


# (C_in, C_out, H, W, kernel, stride, padding, dilation, groups): T > 1 in every case.
SHAPES = {
    "groups": (4, 6, 6, 5, (3, 3), (1, 1), (1, 1), (1, 1), 2),
    "depthwise": (4, 4, 5, 5, (3, 3), (1, 1), (1, 1), (1, 1), 4),
    "dilation": (2, 3, 7, 7, (3, 3), (1, 1), (2, 2), (2, 2), 1),
    "stride": (3, 2, 7, 6, (3, 3), (2, 1), (1, 0), (1, 1), 1),
    "asymmetric": (2, 3, 5, 6, (2, 3), (1, 2), (0, 2), (1, 1), 1),
}


def case(name, dtype, seed, xscale=1.0, gscale=1.0, B=3):
    cin, cout, h, w, k, s, pad, dil, groups = SHAPES[name]
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, cin, h, w, generator=gen, dtype=torch.float64) * xscale).to(dtype)
    ho = (h + 2 * pad[0] - dil[0] * (k[0] - 1) - 1) // s[0] + 1
    wo = (w + 2 * pad[1] - dil[1] * (k[1] - 1) - 1) // s[1] + 1
    g = (torch.randn(B, cout, ho, wo, generator=gen, dtype=torch.float64) * gscale).to(dtype)
    return g, x, (list(k), list(s), list(pad), list(dil), groups)


def check(g, x, geo, method, gl=None, xl=None):
    k, s, pad, dil, groups = geo
    gl = g if gl is None else gl
    xl = x if xl is None else xl
    sq, bound, _, _ = OPS.conv2d_grad_norms(gl, xl, k, s, pad, dil, groups, [True, True], method, 1 << 20, False)
    norm, a, b, U, gg = truth(g, x, k, s, pad, dil, groups)
    T = U.shape[-1]
    d, p = U.shape[2], gg.shape[2]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    assert T > 1
    assert torch.isfinite(bound).all(), f"bound {bound.tolist()} for finite data"
    if x.dtype == torch.float64:
        for i, e in enumerate(exact_norm_sq(U, gg)):
            assert Fraction(float(bound[i])) ** 2 >= e, f"example {i}: bound {float(bound[i])!r} below the norm"
    else:
        assert (bound >= norm * (1 + 1e-12)).all(), f"bound {bound.tolist()} below the norm {norm.tolist()}"
    allowed = allowed_excess(a, b, T, d, p, method == "ghost", acc)
    assert (bound <= norm + allowed).all(), \
        f"bound {bound.tolist()} exceeds the norm {norm.tolist()} by more than {allowed.tolist()}"
    assert ((sq.clamp(min=0).sqrt() - norm).abs() <= allowed).all(), f"sq {sq.tolist()} vs {norm.square().tolist()}"


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("method", ["ghost", "instantiate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_conv_norms_match_float64_truth(name, method, dtype):
    g, x, geo = case(name, dtype, seed=len(name))
    check(g, x, geo, method)


@pytest.mark.parametrize("kind", ["channels_last", "permuted", "sliced", "expanded"])
@pytest.mark.parametrize("name", ["groups", "dilation", "stride"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_norms_read_the_same_pixels_in_every_layout(kind, name, dtype):
    """The input and the upstream gradient in other layouts: the truth is the values' own."""
    g, x, geo = case(name, dtype, seed=7)
    xl, gl = layout(x, kind), layout(g, kind)
    x, g = xl.contiguous(), gl.contiguous()  # "expanded" repeats example 0: the truth sees that too
    for method in ("ghost", "instantiate"):
        check(g, x, geo, method, gl=gl, xl=xl)


# Magnitudes whose fp32 squares leave fp32's range (the position norms used to be fp32 sums of
# squares: 1e20^2 overflowed to Inf, a bound of Inf for a finite example of norm ~1; 1e-24^2
# underflowed and the 3 d tau that then covers it made the bound ~1e5 times the norm). The
# instantiated gradient's products g x stay in range, so the bound can be tight.
@pytest.mark.parametrize("xscale,gscale", [(1e20, 1e-20), (1e-20, 1e20), (1e-24, 1e15), (1e15, 1e-24)])
@pytest.mark.parametrize("name", ["groups", "stride"])
def test_fp32_squares_out_of_range_keep_a_tight_finite_bound(xscale, gscale, name):
    g, x, geo = case(name, torch.float32, seed=3, xscale=xscale, gscale=gscale)
    check(g, x, geo, "instantiate")


@pytest.mark.parametrize("name", ["groups", "dilation"])
def test_fp64_squares_that_underflow_still_bound(name):
    """fp64 data whose squares underflow double (x ~ 1e-165): valid (exact check), if loose."""
    g, x, (k, s, pad, dil, groups) = case(name, torch.float64, seed=4, xscale=1e-165, gscale=1e150)
    for method in ("ghost", "instantiate"):
        _, bound, _, _ = OPS.conv2d_grad_norms(g, x, k, s, pad, dil, groups, [True, True], method, 1 << 20, False)
        _, _, _, U, gg = truth(g, x, k, s, pad, dil, groups)
        for i, e in enumerate(exact_norm_sq(U, gg)):
            assert e > 0 and Fraction(float(bound[i])) ** 2 >= e


# ---- the patches op ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("kind", ["contiguous", "channels_last", "permuted", "sliced", "expanded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_conv_patches_equal_unfold(name, kind, dtype):
    """conv_patches(x) is F.unfold of the values upcast to the accumulation dtype, bit for bit
    (copies and zeros only), [B, C kh kw, T], whatever x's strides."""
    _, x, (k, s, pad, dil, _) = case(name, dtype, seed=11)
    xl = layout(x, kind)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    got = OPS.conv_patches(xl, k, s, pad, dil)
    want = F.unfold(xl.contiguous().to(acc), k, dilation=dil, padding=pad, stride=s)
    assert got.dtype == acc and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)
    # Signed zeros and non-finite values are copied as they are; padding is +0.
    y = xl.clone()
    y[0, 0, 0, 0], y[-1, -1, -1, -1] = float("nan"), float("-inf")
    y[0, -1, 1, 1] = -0.0
    got = OPS.conv_patches(y, k, s, pad, dil)
    want = F.unfold(y.to(acc), k, dilation=dil, padding=pad, stride=s)
    assert torch.equal(got.view(torch.int64 if acc == torch.float64 else torch.int32),
                       want.view(torch.int64 if acc == torch.float64 else torch.int32))


def test_conv_patches_empty_batch_and_bad_arguments():
    x = torch.randn(0, 2, 5, 5)
    assert OPS.conv_patches(x, [3, 3], [1, 1], [1, 1], [1, 1]).shape == (0, 18, 25)
    with pytest.raises(RuntimeError, match="kernel_size"):
        OPS.conv_patches(torch.randn(1, 2, 5, 5), [0, 3], [1, 1], [0, 0], [1, 1])
    with pytest.raises(RuntimeError, match="larger than the padded input"):
        OPS.conv_patches(torch.randn(1, 2, 2, 2), [3, 3], [1, 1], [0, 0], [1, 1])
    with pytest.raises(RuntimeError, match=r"\[B, C, H, W\]"):
        OPS.conv_patches(torch.randn(2, 5, 5), [3, 3], [1, 1], [0, 0], [1, 1])
