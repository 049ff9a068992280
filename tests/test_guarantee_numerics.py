"""The numerical side of the privacy guarantee (DESIGN.md §5: "the noise is Gaussian and the bound
holds after rounding"; "nothing else data-dependent is released"):

* a finite row never overflows into the non-finite counter (norms accumulate in fp64), while a row
  with a NaN/Inf entry is still dropped and counted, in clip_rows and in the layers' backward;
* the clipped values *as stored* obey the bound exactly, for every dtype and clip function, on
  random rows and on rows built so that rounding to nearest would exceed it (the proof is in
  csrc/include/bpclip_fast/clip.h); so do the clipped upstream gradient and one example's weight
  gradient computed exactly from the stored values;
* scale_rows (the backward's rebuild of the clipped input) reproduces clip_rows bit for bit;
* the Gaussian tail reaches sqrt(2 ln 2^65) = 9.4926 (csrc/include/bpclip_fast/philox.h), in the
  host and the emulated device build, and the stream keeps its documented layout and law.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from bpclip_fast import _ops
from bpclip_fast import nn as bnn

sys.path.insert(0, str(Path(__file__).parent / "emulator"))
import harness  # noqa: E402
from philox_ref import philox4x32_10  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPS = torch.ops.bpclip_fast
LOW = [torch.float32, torch.float16, torch.bfloat16]
CLIP_FNS = ["clip", "global", "normalize"]
PRECISION = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}  # significand bits
INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def counter(device="cpu"):
    return torch.zeros(1, dtype=torch.int64, device=device)


def bits(t):
    return t.contiguous().view(INT_OF[t.element_size()])


def fp64_norms(t, norm):
    t = t.double()
    if norm == "l15":
        return t.abs().sum((2, 3)).square().sum(1).sqrt()
    return t.reshape(t.shape[0], -1).square().sum(1).sqrt()


def exact_sq_norm(row, norm):
    """The squared norm of one stored row, exactly (Fractions of its binary values)."""
    if norm == "l15":
        return sum((sum((Fraction(v) for v in ch.abs().reshape(-1).double().tolist()), Fraction(0))) ** 2
                   for ch in row)
    return sum((Fraction(v) ** 2 for v in row.reshape(-1).double().tolist()), Fraction(0))


def assert_within_bound(out, bound, norm, what):
    """Every stored row's norm <= bound, exactly: fp64 where it is clear by far more than its rounding
    error, exact rational arithmetic on the rows near the bound. Returns the worst ratio."""
    n = fp64_norms(out, norm)
    close = n > bound * (1 - 1e-9)
    for i in torch.nonzero(close).reshape(-1).tolist():
        assert exact_sq_norm(out[i], norm) <= Fraction(bound) ** 2, \
            f"{what}: row {i} has norm {n[i].item()!r} > bound {bound!r} (ratio {n[i].item() / bound - 1:.3g} over)"
    return (n.max() / bound).item() if n.numel() else 0.0


# ---- 1. finite rows are never "non-finite" ------------------------------------------------------

def _huge_rows(dtype, norm, gen):
    """Rows whose squares overflow fp32 (fp32 1e20, bf16 3e38) or whose fp32 sum loses precision
    (fp16 6e4 over a long row), then a NaN row and an Inf row; [B, G, H, W] for l15."""
    if dtype == torch.float32:
        n, big = 1000, 1e20
    elif dtype == torch.float16:
        n, big = 1 << 16, 6e4
    else:
        n, big = 16, 3e38
    x = torch.randn(4, n, generator=gen, dtype=torch.float64)
    x[0] = big * (0.5 + 0.5 * torch.rand(n, generator=gen, dtype=torch.float64)) * torch.where(x[0] < 0, -1, 1)
    if dtype == torch.bfloat16:
        x[0] *= 1e-2  # one entry near 3e38, the rest 1.5e36..3e36: the row's norm still fits an fp32
        x[0, 3] = -3.0e38
    x[2, 5] = float("nan")
    x[3, -1] = float("inf")
    x = x.to(dtype)
    return x.reshape(4, 4, n // 4, 1) if norm == "l15" else x


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_huge_finite_rows_get_exact_norms_and_are_clipped_not_dropped(device):
    gen = torch.Generator().manual_seed(1)
    for dtype in LOW:
        for norm in ("l2", "l15"):
            for clip_fn in CLIP_FNS:
                x = _huge_rows(dtype, norm, gen)
                exact = fp64_norms(x[:2], norm)
                bound = float(exact[0]) * 0.5 if clip_fn != "global" else float(exact[0]) * 2
                c = counter(device)
                out, f, n = OPS.clip_rows(x.to(device), c, bound, norm, clip_fn, 1e-3)
                out, f, n = out.cpu(), f.cpu(), n.cpu()
                what = f"{dtype} {norm} {clip_fn}"
                # The NaN and the Inf rows, and only they, are dropped and counted.
                assert c.item() == 2, what
                assert f[2].item() == 0 and f[3].item() == 0 and (out[2:] == 0).all(), what
                assert (bits(out[2:]) == 0).all(), f"{what}: dropped rows hold +0"
                # The huge row: its stored norm is the exact norm rounded once to fp32.
                assert math.isfinite(n[0].item()), what
                rel = abs(n[0].double().item() - exact[0].item()) / exact[0].item()
                assert rel <= 2.0 ** -24 + 1e-12, f"{what}: norm off by {rel:.3g} (one fp32 rounding is 6e-8)"
                assert f[0].item() > 0 and torch.isfinite(out[:2]).all(), what
                expect_f = {"clip": bound / exact[0].item(), "global": 1.0,
                            "normalize": bound / (exact[0].item() + 1e-3)}[clip_fn]
                assert f[0].item() == pytest.approx(expect_f, rel=1e-6), what
                assert_within_bound(out[:2], bound, norm, what)


def test_fp64_rows_beyond_1e154_are_counted_as_the_documented_limit():
    """fp64 data (gradcheck only) accumulates in plain fp64: a row whose sum of squares overflows
    (entries >= ~1.34e154) is treated as non-finite; entries of 1e150 are clipped normally."""
    x = torch.tensor([[1e150, -2e150, 3e150], [1e155, 1.0, 1.0]], dtype=torch.float64)
    c = counter()
    out, f, n = OPS.clip_rows(x, c, 1.0, "l2", "clip", 0.01)
    assert n[0].item() == pytest.approx(math.sqrt(14) * 1e150, rel=1e-15) and f[0].item() > 0
    assert c.item() == 1 and f[1].item() == 0 and (out[1] == 0).all()


def _layer_step(layer, x, g):
    layer.zero_grad(set_to_none=True)
    layer._bp_nonfinite.zero_()
    x = x.clone().requires_grad_()
    layer(x).backward(g)
    return x.grad


def test_huge_upstream_gradients_through_linear_and_conv2d_backward():
    gen = torch.Generator().manual_seed(2)
    # Linear: rows of the upstream gradient: 1e20 entries (finite), normal, NaN.
    lin = bnn.Linear(6, 5, input_clip=1.0, grad_clip=0.5)
    x = torch.randn(3, 6, generator=gen)
    g = torch.randn(3, 5, generator=gen)
    g[0] *= 1e20
    g[2, 1] = float("nan")
    gx = _layer_step(lin, x, g)
    assert lin._bp_nonfinite.tolist() == [0, 1], "only the NaN row is counted"
    gc, gf, _ = OPS.clip_rows(g, counter(), 0.5, "l2", "clip", 0.01)
    assert gf[0].item() > 0 and gf[2].item() == 0
    assert torch.isfinite(lin.weight.grad).all() and torch.isfinite(gx).all()
    assert torch.equal(lin.bias.grad, gc.sum(0))
    # Conv2d, both upstream norms: one 1e20 example, one NaN example.
    for norm in ("l15", "l2"):
        conv = bnn.Conv2d(2, 3, 3, padding=1, input_clip=1.0, grad_clip=0.5, norm=norm)
        x = torch.randn(3, 2, 5, 5, generator=gen)
        g = torch.randn(3, 3, 5, 5, generator=gen)
        g[1] *= 1e20
        g[2, 0, 2, 2] = float("inf")
        gx = _layer_step(conv, x, g)
        assert conv._bp_nonfinite.tolist() == [0, 1], norm
        assert torch.isfinite(conv.weight.grad).all() and torch.isfinite(conv.bias.grad).all(), norm
        assert torch.isfinite(gx).all(), norm


# ---- 2. the bound after rounding ------------------------------------------------------------------

def _random_batch(dtype, norm, clip_fn, bound, gen, rows, n):
    """Rows of random direction and scale: norms between 1.02 C and 4 C (clip, normalize), or within
    1e-7 of C on both sides (global, where the kept/dropped decision is made)."""
    if norm == "l15":
        shape = (rows, n, 3, 2)
    else:
        shape = (rows, n)
    y = torch.randn(shape, generator=gen, dtype=torch.float64)
    y = y * torch.rand(shape, generator=gen, dtype=torch.float64) ** 3  # uneven magnitudes
    cur = fp64_norms(y, norm).reshape((-1,) + (1,) * (len(shape) - 1))
    if clip_fn == "global":
        target = bound * (1 + 1e-7 * (2 * torch.rand(rows, generator=gen, dtype=torch.float64) - 1))
    else:
        target = bound * (1.02 + 3 * torch.rand(rows, generator=gen, dtype=torch.float64))
    return (y / cur * target.reshape(cur.shape)).to(dtype)


def test_stored_rows_within_bound_random_search():
    """Many random rows per dtype, clip function and norm; the worst stored norm is <= C exactly.
    (Before the rounding toward zero, bf16 reached 1.0033 C and fp16 1.0004 C on searches like this.)"""
    gen = torch.Generator().manual_seed(3)
    worst = {}
    for dtype in LOW:
        for norm in ("l2", "l15"):
            for clip_fn in CLIP_FNS:
                for n in (1, 2, 3, 5, 16, 61):
                    bound = float(torch.rand(1, generator=gen)) * 3 + 0.1
                    gamma = bound * 1e-7
                    x = _random_batch(dtype, norm, clip_fn, bound, gen, 400, n)
                    out, f, _ = OPS.clip_rows(x, counter(), bound, norm, clip_fn, gamma)
                    key = (str(dtype), norm, clip_fn)
                    worst[key] = max(worst.get(key, 0.0),
                                     assert_within_bound(out, bound, norm, f"{key} n={n}"))
    print("worst stored norm / C:", {k: f"{v:.9f}" for k, v in worst.items()})


def _adversarial(dtype, norm, clip_fn, gen, count=64):
    """Rows of equal entries v, with C chosen so that the exact s*v lies just above a rounding
    midpoint of the dtype (round to nearest goes up by up to half an ulp: 2^-8 relative for bf16).
    For global, C sits just below the exact norm (kept by a norm rounded down or a bound rounded
    up). Returns [(x, bound, gamma)]."""
    p = PRECISION[dtype]
    cases = []
    for _ in range(count):
        a = 1.0 + math.floor(float(torch.rand(1, generator=gen)) * 2 ** (p - 1)) * 2.0 ** (1 - p)
        mid = a + 2.0 ** -p  # between a and the next value of the dtype
        delta = 2.0 ** -float(torch.randint(p + 2, 52, (1,), generator=gen))
        t = mid * (1 + delta)  # the exact clipped entry we aim at
        v = 4.0
        if norm == "l15":
            x = torch.full((1, 4, 2, 2), v, dtype=torch.float64)  # l15 = sqrt(4 (4v)^2) = 8v
            n = 8 * v
        else:
            x = torch.full((1, 4), v, dtype=torch.float64)  # l2 = 2v
            n = 2 * v
        gamma = 2.0 ** -40
        if clip_fn == "clip":
            bound = n * t / v
        elif clip_fn == "normalize":
            bound = (n + gamma) * t / v
        else:
            bound = n * (1 - delta)
        cases.append((x.to(dtype), bound, gamma))
    return cases


def test_stored_rows_within_bound_adversarial():
    gen = torch.Generator().manual_seed(4)
    for dtype in LOW:
        for norm in ("l2", "l15"):
            for clip_fn in CLIP_FNS:
                worst = 0.0
                for x, bound, gamma in _adversarial(dtype, norm, clip_fn, gen):
                    out, _, _ = OPS.clip_rows(x, counter(), bound, norm, clip_fn, gamma)
                    worst = max(worst, assert_within_bound(out, bound, norm, f"{dtype} {norm} {clip_fn} C={bound!r}"))
                assert worst > 0 or clip_fn == "global"


def test_layer_backward_clips_the_upstream_gradient_with_clip_rows_bit_for_bit():
    """The clipped upstream gradient g~ the layers' backward uses is clip_rows' output, bit for bit,
    so the bound tests above cover it. Made visible without per-example storage: an identity weight
    and an input under its bound (factor 1) give grad_x = g~ exactly (clip, global); for normalize,
    one example and a bias give grad_b = g~ (Conv2d: a 1x1 output). Adversarial gradients: g~ obeys
    its bound exactly, l2 and l15."""
    gen = torch.Generator().manual_seed(5)
    for dtype in LOW:
        for clip_fn in CLIP_FNS:
            for x_adv, cg, gamma in _adversarial(dtype, "l2", clip_fn, gen, count=6):
                d = x_adv.shape[1]
                lin = bnn.Linear(d, d, bias=clip_fn == "normalize", input_clip=1e3, grad_clip=cg, clip_fn=clip_fn,
                                 gamma=gamma, dtype=dtype)
                with torch.no_grad():
                    lin.weight.copy_(torch.eye(d, dtype=dtype))
                x = torch.full((1, d), 0.5, dtype=dtype)
                gx = _layer_step(lin, x, x_adv)
                g_clip, _, _ = OPS.clip_rows(x_adv, counter(), cg, "l2", clip_fn, gamma)
                seen = lin.bias.grad.reshape(1, d) if clip_fn == "normalize" else gx
                assert torch.equal(bits(seen), bits(g_clip)), f"Linear {dtype} {clip_fn}"
                assert_within_bound(seen, cg, "l2", f"Linear g~ {dtype} {clip_fn}")
            for x_adv, cg, gamma in _adversarial(dtype, "l15", clip_fn, gen, count=6):
                if clip_fn == "normalize":
                    g = x_adv.reshape(1, 16, 1, 1)  # C_out = 16 channels of a 1x1 output (l15 = l2 here)
                    conv = bnn.Conv2d(1, 16, 3, input_clip=1e3, grad_clip=cg, norm="l15", clip_fn=clip_fn,
                                      gamma=gamma, dtype=dtype)
                    x = torch.full((1, 1, 3, 3), 0.5, dtype=dtype)
                    _layer_step(conv, x, g)
                    seen = conv.bias.grad.reshape(g.shape)
                else:
                    g = x_adv  # [1, 4, 2, 2]
                    conv = bnn.Conv2d(4, 4, 1, bias=False, input_clip=1e3, grad_clip=cg, norm="l15",
                                      clip_fn=clip_fn, gamma=gamma, dtype=dtype)
                    with torch.no_grad():
                        conv.weight.copy_(torch.eye(4, dtype=dtype).reshape(4, 4, 1, 1))
                    x = torch.full((1, 4, 2, 2), 0.25, dtype=dtype)
                    seen = _layer_step(conv, x, g)
                g_clip, _, _ = OPS.clip_rows(g, counter(), cg, "l15", clip_fn, gamma)
                assert torch.equal(bits(seen), bits(g_clip)), f"Conv2d {dtype} {clip_fn}"
                assert_within_bound(seen, cg, "l15", f"Conv2d g~ {dtype} {clip_fn}")


def test_one_examples_weight_gradient_within_sensitivity_exactly():
    """One example through Linear (with bias): x~ as the forward stored it (clip_rows; scale_rows in
    the backward) and g~ = grad_b (B = 1). [grad_W, grad_b] = [g~ x~^T, g~] computed exactly from the
    stored values has Frobenius norm <= Delta = layer.sensitivity_for(shape), on adversarial rows."""
    gen = torch.Generator().manual_seed(6)
    for dtype in LOW:
        for clip_fn in CLIP_FNS:
            xs = _adversarial(dtype, "l2", clip_fn, gen, count=8)
            gs = _adversarial(dtype, "l2", clip_fn, gen, count=8)
            for (x, cx, gamma), (g, cg, _) in zip(xs, gs):
                lin = bnn.Linear(4, 4, input_clip=cx, grad_clip=cg, clip_fn=clip_fn, gamma=gamma, dtype=dtype)
                _layer_step(lin, x, g)
                x_t, _, _ = OPS.clip_rows(x, counter(), cx, "l2", clip_fn, gamma)
                g_t = lin.bias.grad
                g2 = exact_sq_norm(g_t, "l2")
                contribution_sq = g2 * exact_sq_norm(x_t[0], "l2") + g2  # ||g x^T||_F^2 + ||g||^2
                delta = lin.sensitivity_for(tuple(x.shape))
                assert contribution_sq <= Fraction(delta) ** 2, \
                    f"{dtype} {clip_fn}: contribution {math.sqrt(contribution_sq)!r} > Delta {delta!r}"


# ---- 3. scale_rows: the backward's x~, bit for bit --------------------------------------------------

def rz_reference(x, factor):
    """RZ(factor * x) to x's dtype, from torch's round-to-nearest: the fp64 product is exact for
    fp32/fp16/bf16, and stepping one ulp toward zero where rounding went away from zero gives RZ."""
    return harness.rz_scale_reference(x, factor)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_scale_rows_reproduces_clip_rows_and_rounds_toward_zero(device):
    gen = torch.Generator().manual_seed(7)
    for dtype in LOW + [torch.float64]:
        for norm, shape in (("l2", (9, 37)), ("l2", (3, 5, 7)), ("l15", (5, 3, 4, 6))):
            for clip_fn in CLIP_FNS:
                x = (torch.randn(shape, generator=gen) * 4).to(dtype)
                x.view(shape[0], -1)[1, 3] = float("nan")
                out, f, _ = OPS.clip_rows(x.to(device), counter(device), 2.0, norm, clip_fn, 0.01)
                again = OPS.scale_rows(x.to(device), f)
                assert torch.equal(bits(again.cpu()), bits(out.cpu())), (dtype, norm, clip_fn)
                rebuilt = OPS.scale_rows(x.to(device).transpose(0, -1).contiguous().transpose(0, -1), f)
                assert torch.equal(bits(rebuilt.cpu()), bits(out.cpu())), (dtype, norm, clip_fn)
                if dtype != torch.float64:
                    assert torch.equal(bits(out.cpu()), bits(rz_reference(x, f.cpu()))), (dtype, norm, clip_fn)
    # Edge values: subnormal results, negative zeros, saturation at the largest finite value
    # (normalize can scale up), and factor 0 writing +0 whatever x holds.
    for dtype in LOW:
        info = torch.finfo(dtype)
        vals = torch.tensor([info.tiny, -info.tiny, info.tiny * 0.75, info.max, -info.max, 1.0, -1.0, 3.0,
                             info.max / 3, -0.0, 1e-30, float("inf")]).to(dtype)
        x = vals.repeat(6, 1)
        factor = torch.tensor([1.0, 0.3, 1 / 3, 1.5, 1e-3, 0.0], dtype=torch.float32)
        x[:5, -1] = 2.0  # the Inf stays in the factor-0 row only
        out = OPS.scale_rows(x.to(device), factor.to(device)).cpu()
        assert torch.equal(bits(out), bits(rz_reference(x, factor))), dtype
        assert torch.isfinite(out).all() and (bits(out[5]) == 0).all()
        assert (out[:5].double().abs() <= (x[:5].double() * factor[:5].double()[:, None]).abs()).all()


def test_scale_rows_fp64_is_the_exact_product_rounded_toward_zero():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, 200, generator=gen, dtype=torch.float64) * torch.logspace(-300, 300, 200, dtype=torch.float64)
    x[3, :20] = torch.tensor([2.0 ** -1074, 3 * 2.0 ** -1074, 2.0 ** -1022, -(2.0 ** -1060), 1.0 - 2 ** -53] * 4,
                             dtype=torch.float64)
    factor = torch.tensor([1 / 3, 0.7, 1 - 2 ** -53, 0.75], dtype=torch.float64)
    out = OPS.scale_rows(x, factor)
    for b in range(4):
        for v, o in zip(x[b].tolist(), out[b].tolist()):
            exact = Fraction(factor[b].item()) * Fraction(v)
            assert abs(Fraction(o)) <= abs(exact), (v, o)
            # o is the largest double <= |exact| in magnitude: the next one up exceeds it
            nxt = math.nextafter(abs(o), math.inf)
            assert Fraction(nxt) > abs(exact), (v, o)
            assert o == 0 or (o < 0) == (exact < 0)


# ---- 4. the Gaussian tail --------------------------------------------------------------------------

TAIL = math.sqrt(130 * math.log(2))  # sqrt(2 ln 2^65) = 9.4926


def test_noise_tail_extreme_value_in_the_host_build(tmp_path):
    """philox.h compiled for the host (the CPU backend's code): radius words 0 give sqrt(130 ln 2)."""
    src = tmp_path / "tail.cpp"
    src.write_text(
        '#include <cstdio>\n#include "bpclip_fast/philox.h"\n'
        "int main() {\n"
        "  float a, b, c, d;\n"
        "  bpclip::box_muller(0u, 0u, 0u, &a, &b);\n"
        "  bpclip::box_muller(0u, 0u, 0x40000000u, &c, &d);\n"
        '  std::printf("%a %a %a %a %a\\n", a, b, c, d, bpclip::radius_uniform(0u, 0u));\n'
        "}\n")
    exe = tmp_path / "tail"
    cxx = os.environ.get("CXX", "c++")
    run = subprocess.run([cxx, "-std=c++20", "-O2", "-ffp-contract=off", f"-I{ROOT / 'csrc' / 'include'}",
                          str(src), "-o", str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b, c, d, u = (float.fromhex(v) for v in subprocess.run([str(exe)], capture_output=True, text=True,
                                                      check=True).stdout.split())
    assert u == 2.0 ** -65
    # angle word 0 is the first cell's midpoint, 2^-24 of a turn: never exactly on an axis (no zero draw)
    assert a == pytest.approx(TAIL, rel=1e-6) and b == pytest.approx(TAIL * math.sin(2 * math.pi * 2.0 ** -24), rel=1e-6)
    assert 0 < abs(c) < 1e-5 and d == pytest.approx(TAIL, rel=1e-6)
    assert a > 9.0


def test_noise_tail_extreme_value_in_the_emulated_device_build():
    sim = harness.Simt(harness.build_library())
    sim.schedule("in_order", 0)
    z = sim.box_muller(torch.tensor([[0, 0, 0], [0, 0, 0x40000000], [0, 1, 0x20000000]], dtype=torch.int64))
    assert z[0, 0].item() == pytest.approx(TAIL, rel=1e-6)
    assert z[0, 1].item() == pytest.approx(TAIL * math.sin(2 * math.pi * 2.0 ** -24), rel=1e-6)  # never 0
    assert 0 < abs(z[1, 0].item()) < 1e-5 and z[1, 1].item() == pytest.approx(TAIL, rel=1e-6)
    r = math.sqrt(-2 * math.log(1.5 * 2.0 ** -64))
    assert z[2].tolist() == pytest.approx([r / math.sqrt(2), r / math.sqrt(2)], rel=1e-6)


def _radius_uniform_f32(hi, lo):
    """philox.h's float evaluation of (hi 2^32 + lo + 1/2) 2^-64 (near 1 it rounds to 1.0, which
    box_muller clamps to the largest float below 1)."""
    import numpy as np
    f = np.float32
    a = f(hi >> 1) * f(2.0 ** -31) + f(hi & 1) * f(2.0 ** -32)
    b = f(lo >> 1) * f(2.0 ** -63) + f(lo & 1) * f(2.0 ** -64)
    u1 = float(a + (b + f(2.0 ** -65)))
    assert abs(u1 - (hi * 2.0 ** 32 + lo + 0.5) * 2.0 ** -64) <= 2.0 ** -22 * u1
    return u1


def test_noise_stream_layout_law_and_backends():
    """Group g of 8 elements is Box-Muller on the blocks g, g + 2^62, g + 2^63 with a 64-bit radius
    word; the CPU stream (default Philox version) equals the emulated CUDA kernel bit for bit; the
    tail frequencies of 2^24 draws match the standard normal's."""
    seed, offset = 0x5DEECE66D, (9 << 20) | (4 << 1) | 1
    mask = 0xFFFFFFFF
    n = 8 * 21 - 3
    buf = torch.zeros(n)
    _ops.philox_noise_(buf, seed, offset, 1.0, False)
    expect = []
    for g in range(21):
        key = [seed & mask, seed >> 32]
        b0, b1, b2 = (philox4x32_10([blk & mask, blk >> 32, offset & mask, offset >> 32], key)
                      for blk in (g, g + 2 ** 62, g + 2 ** 63))
        for hi, lo, ang in ((b0[0], b0[1], b2[0]), (b0[2], b0[3], b2[1]), (b1[0], b1[1], b2[2]),
                            (b1[2], b1[3], b2[3])):
            u1 = min(_radius_uniform_f32(hi, lo), 1.0 - 2.0 ** -24)  # philox.h: never 1 (r = 0)
            r = math.sqrt(-2 * math.log(u1))
            u2 = ((ang >> 9) * 2 + 1) * 2.0 ** -24  # a cell's midpoint
            expect += [r * math.cos(2 * math.pi * u2), r * math.sin(2 * math.pi * u2)]
    torch.testing.assert_close(buf.double(), torch.tensor(expect[:n], dtype=torch.float64), rtol=3e-6, atol=3e-6)

    sim = harness.Simt(harness.build_library())
    sim.schedule("random", 3)
    for dtype in LOW + [torch.float64]:
        assert harness.compare_noise(sim, 4 * 8 * 16 + 13, dtype, seed, offset, 0.7, False) == [], dtype

    big = torch.empty(1 << 24)
    _ops.philox_noise_(big, 2026, 5, 1.0, False)
    z = big.double().abs()
    assert z.max().item() <= TAIL
    from statistics import NormalDist
    for t in (3.0, 4.0, 4.5, 5.0):
        p = 2 * NormalDist().cdf(-t)
        expected = p * z.numel()
        got = int((z > t).sum())
        assert abs(got - expected) < 5 * math.sqrt(expected) + 2, (t, got, expected)
