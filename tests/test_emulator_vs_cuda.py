"""The emulator against the real device: the same kernels, inputs and launch sequences run by the
SIMT emulator (tests/emulator) and by the CUDA ops must agree. Runs only where a GPU is present
(bench/gpu_check.sh); it is what makes the emulator's verdicts on CPU-only CI trustworthy.

Agreement is to rounding, not bit-exact: nvcc contracts a*b+c into FMA by default and the
emulator (like the CPU kernels) does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import bpclip_fast  # noqa: F401

sys.path.insert(0, str(Path(__file__).parent / "emulator"))
import harness  # noqa: E402

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.fixture(scope="module")
def sim():
    s = harness.Simt(harness.build_library())
    s.schedule("random", 1)
    return s


def _close(a, b, tol):
    torch.testing.assert_close(a.cpu().double(), b.cpu().double(), rtol=tol, atol=tol * 1e-3, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,norm", [((9, 100), "l2"), ((3, 4097), "l2"), ((1, 70000), "l2"),
                                        ((3, 40, 9, 13), "l15"), ((2, 2, 70, 70), "l15")])
def test_clip_rows_device_agrees_with_emulator(sim, shape, norm, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    x.view(shape[0], -1)[0, 0] = float("nan")
    l15 = norm == "l15"
    acc = harness.acc_dtype(dtype)
    out, f, n = torch.full_like(x, float("nan")), torch.empty(shape[0], dtype=acc), torch.empty(shape[0], dtype=acc)
    cnt = torch.zeros(1, dtype=torch.int64)
    sim.clip_rows(x, out, f, n, cnt, l15=l15, bound=30.0, clip_fn="clip", gamma=0.01)
    dcnt = torch.zeros(1, dtype=torch.int64, device="cuda")
    dout, df, dn = torch.ops.bpclip_fast.clip_rows(x.cuda(), dcnt, 30.0, norm, "clip", 0.01)
    _close(dn, n, 1e-12 if dtype == torch.float64 else 2e-6)
    _close(df, f, 1e-12 if dtype == torch.float64 else 8e-6)
    _close(dout, out, TOL[dtype])
    assert int(dcnt) == int(cnt) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clip_rows_backward_device_agrees_with_emulator(sim, dtype):
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(5, 9000, generator=gen).to(dtype), torch.randn(5, 9000, generator=gen).to(dtype)
    xc, f, n = torch.ops.bpclip_fast.clip_rows(x, torch.zeros(1, dtype=torch.int64), 50.0, "l2", "clip", 0.01)
    out = torch.full_like(g, float("nan"))
    sim.clip_rows_backward(g, xc, f, n, out, bound=50.0, clip_fn="clip")
    dout = torch.ops.bpclip_fast.clip_rows_backward(g.cuda(), xc.cuda(), f.cuda(), n.cuda(), 50.0, "clip")
    _close(dout, out, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("accumulate", [False, True])
def test_noise_device_agrees_with_emulator(sim, dtype, accumulate):
    n = 100003
    start = torch.linspace(-2, 2, n).to(dtype)
    buf = start.clone() if accumulate else torch.zeros(n, dtype=dtype)
    sim.philox_noise(buf, n, 77, 12 << 20, 0.8, accumulate)
    dbuf = start.cuda() if accumulate else torch.zeros(n, dtype=dtype, device="cuda")
    torch.ops.bpclip_fast.philox_noise_(dbuf, 77, 12 << 20, 0.8, accumulate)
    if not accumulate:
        _close(dbuf, buf, max(TOL[dtype], 1e-6))
        return
    # buf = RN(start + noise): a noise value that differs by rounding (FMA) moves the sum by rounding
    # of the operands' size, not of the sum's, which cancellation near 0 can make far smaller (seen
    # on an H100: 40 of 100003 sums). So the bound is relative to |start| + |noise|, per element.
    tol = max(TOL[dtype], 1e-6)
    d, e, s = dbuf.cpu().double(), buf.double(), start.double()
    scale = s.abs() + (e - s).abs()
    bad = (d - e).abs() > tol * scale
    assert not bad.any(), (int(bad.sum()), d[bad][:5], e[bad][:5], s[bad][:5])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_rows_device_agrees_with_emulator_bit_for_bit(sim, dtype):
    # RZ(factor * x) has no a*b+c to contract: the device, the emulator and the CPU agree bit for bit.
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(7, 5000, generator=gen) * 10).to(dtype)
    factor = (torch.rand(7, generator=gen, dtype=torch.float64) * 2).to(harness.acc_dtype(dtype))
    factor[3] = 0
    out = torch.full_like(x, float("nan"))
    sim.scale_rows(x, factor, out)
    dout = torch.ops.bpclip_fast.scale_rows(x.cuda(), factor.cuda()).cpu()
    assert torch.equal(harness._bits(dout), harness._bits(out))
    assert torch.equal(harness._bits(dout), harness._bits(torch.ops.bpclip_fast.scale_rows(x, factor)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layer_norm,shape,groups", [(True, (3, 70, 33), 1), (True, (2, 5, 8, 768), 1),
                                                     (False, (3, 12, 9, 9), 4), (False, (2, 64, 70, 70), 8)])
def test_norm_affine_device_agrees_with_emulator(sim, dtype, layer_norm, shape, groups):
    """The device kernels (LayerNorm: per (example, parameter, row chunk); GroupNorm: a warp per
    (example, channel, chunk); their finalize) against the emulated ones and the CPU op, each within
    the summation bound of the exact float64 sums (their orders differ)."""
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(shape, generator=gen).to(dtype)
    x = (torch.randn(shape, generator=gen) + 0.5).to(dtype)
    assert harness.compare_norm_affine(sim, g, x, layer_norm, groups) == []
    mean, rstd = harness.norm_stats(x, layer_norm, groups, 1)
    batch = shape[0]
    dw, db = torch.ops.bpclip_fast.norm_affine_example_grads(g.cuda(), x.cuda(), mean.cuda(), rstd.cuda(), batch,
                                                             groups, layer_norm)
    tw, tb = harness.norm_affine_terms(g, x, mean, rstd, layer_norm, groups, batch)
    acc = harness.acc_dtype(dtype)
    for out, terms in ((dw, tw), (db, tb)):
        exact = terms.sum(-1)
        assert out.dtype == acc
        assert bool(((out.cpu().double() - exact).abs() <= harness.accumulation_bound(terms, acc)).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_noise_device_misaligned_view_agrees_with_emulator(sim, dtype):
    # The packed (16-byte) stores are taken only for aligned buffers: a view one element in must take
    # the element-wise path on the device too (a packed store there faults), with the same values.
    n = 10_007
    host = torch.zeros(n + 1, dtype=dtype)
    sim.philox_noise(host[1:], n, 5, 3, 1.0, False)
    dev = torch.zeros(n + 1, dtype=dtype, device="cuda")
    torch.ops.bpclip_fast.philox_noise_(dev[1:], 5, 3, 1.0, False)
    assert dev[0].item() == 0
    _close(dev[1:], host[1:], max(TOL[dtype], 1e-6))


# ---- the fused ops of issue 25 on the device itself: where they reuse a kernel's element code, the
# device agrees with its own separate ops bit for bit; where they only move bits, with the CPU.

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("acc_w,acc_b", [(False, True), (True, False)])
def test_noise2_device_is_two_noise_calls_bit_for_bit(dtype, acc_w, acc_b):
    gen = torch.Generator().manual_seed(3)
    w0, b0 = torch.randn(300, 37, generator=gen).to(dtype), torch.randn(300, generator=gen).to(dtype)
    w, b = w0.cuda(), b0.cuda()
    torch.ops.bpclip_fast.philox_noise2_(w, b, 5, 40, 0.7, acc_w, acc_b)
    rw, rb = w0.cuda(), b0.cuda()
    torch.ops.bpclip_fast.philox_noise_(rw, 5, 40, 0.7, acc_w)
    torch.ops.bpclip_fast.philox_noise_(rb, 5, 41, 0.7, acc_b)
    assert torch.equal(harness._bits(w.cpu()), harness._bits(rw.cpu()))
    assert torch.equal(harness._bits(b.cpu()), harness._bits(rb.cpu()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_layer_tail_device_is_its_parts(dtype, scale):
    """layer_tail_ on the device: w as the device's philox_noise_ (accumulate, scale) bit for bit; b
    as that noise on the CPU op's column sums (float64 slice sums, no FMA to contract: the same
    bits); the VJP as the device's clip_rows_backward, to rounding."""
    gen = torch.Generator().manual_seed(6)
    acc = harness.acc_dtype(dtype)
    w0, rows = torch.randn(70, 33, generator=gen).to(acc), torch.randn(300, 70, generator=gen).to(acc)
    x, g = torch.randn(9, 200, generator=gen).to(dtype), torch.randn(9, 200, generator=gen).to(dtype)
    cnt = torch.zeros(1, dtype=torch.int64, device="cuda")
    xc, f, n = torch.ops.bpclip_fast.clip_rows(x.cuda(), cnt, 5.0, "l2", "clip", 0.01)
    w, b = w0.cuda(), torch.empty(70, dtype=acc, device="cuda")
    gx = torch.ops.bpclip_fast.layer_tail_(w, b, rows.cuda(), g.cuda(), xc, f, n, 5.0, "clip", 8, -1,
                                           0.9, scale)
    rw = w0.cuda()
    torch.ops.bpclip_fast.philox_noise_(rw, 8, -1, 0.9, True, scale)
    sums = torch.empty(70, dtype=acc)
    torch.ops.bpclip_fast.layer_tail_(torch.zeros(1, dtype=acc), sums, rows, None, None, None, None, 1.0, "clip", 0, 0,
                                      0.0, 1.0)
    rb = sums.cuda()
    torch.ops.bpclip_fast.philox_noise_(rb, 8, 0, 0.9, True, scale)  # offset -1 + 1 wraps to 0
    assert torch.equal(harness._bits(w.cpu()), harness._bits(rw.cpu()))
    assert torch.equal(harness._bits(b.cpu()), harness._bits(rb.cpu()))
    _close(gx, torch.ops.bpclip_fast.clip_rows_backward(g.cuda(), xc, f, n, 5.0, "clip"), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_rows2_and_clip_rows_rescale_device_agree_with_their_parts(dtype):
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(9, 300, generator=gen) * 10).to(dtype).cuda()
    y = (torch.randn(9, 4100, generator=gen) * 10).to(dtype).cuda()
    f = (torch.rand(9, generator=gen, dtype=torch.float64) * 2).to(harness.acc_dtype(dtype)).cuda()
    f[3] = 0
    sx, sy = torch.ops.bpclip_fast.scale_rows2(x, f, y, f, True)
    assert torch.equal(harness._bits(sx.cpu()), harness._bits(torch.ops.bpclip_fast.scale_rows(x, f).cpu()))
    mask = (f > 0).to(f.dtype)
    assert torch.equal(harness._bits(sy.cpu()), harness._bits(torch.ops.bpclip_fast.scale_rows(y, mask).cpu()))
    n1, n2 = (torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(2))
    gc, gf, gn, xr = torch.ops.bpclip_fast.clip_rows_rescale(y, n1, 30.0, "l2", "clip", 0.01, x, f)
    rc, rf, rn = torch.ops.bpclip_fast.clip_rows(y, n2, 30.0, "l2", "clip", 0.01)
    for a, r in ((gc, rc), (gf, rf), (gn, rn), (xr, torch.ops.bpclip_fast.scale_rows(x, f)), (n1, n2)):
        assert torch.equal(harness._bits(a.cpu()), harness._bits(r.cpu()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
def test_conv_patches_device_is_the_cpu_op_bit_for_bit(dtype, layout):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 11, 9, generator=gen).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        x = torch.randn(3, 6, 13, 9, generator=gen).to(dtype)[:, 1:5, 1:12]
    geo = ([3, 2], [2, 1], [1, 2], [1, 2])
    dev = torch.ops.bpclip_fast.conv_patches(x.cuda(), *geo).cpu()
    assert torch.equal(harness._bits(dev), harness._bits(torch.ops.bpclip_fast.conv_patches(x, *geo)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_examples_ops_device_agree_with_the_cpu(dtype):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(10, 3, 50, generator=gen, dtype=dtype)
    b = torch.randn(10, 3, generator=gen, dtype=dtype)
    w[4, 0, 7] = float("inf")
    cpu_n, dev_n = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64, device="cuda")
    bound = torch.ops.bpclip_fast.examples_bound(w, b, cpu_n)
    dbound = torch.ops.bpclip_fast.examples_bound(w.cuda(), b.cuda(), dev_n)
    assert int(dev_n) == int(cpu_n) == 1
    _close(dbound, bound, 1e-12)
    factor = torch.where(bound.isfinite(), 1.0 / bound, torch.zeros_like(bound)).to(dtype)
    args = ([9, 2 << 20], 0.6, 0.25)
    ow, ob = torch.ops.bpclip_fast.examples_release(w, b, factor, *args)
    dw, db = torch.ops.bpclip_fast.examples_release(w.cuda(), b.cuda(), factor.cuda(), *args)
    _close(dw, ow, max(TOL[dtype], 1e-6))
    _close(db, ob, max(TOL[dtype], 1e-6))
