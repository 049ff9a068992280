"""norm_affine_example_grads: the per-example gradients of the LayerNorm / GroupNorm affine weight
and bias (issue 15), against plain-PyTorch float64 sums from the same statistics and against
torch.func's per-example gradients of F.layer_norm / F.group_norm; dtypes, layouts, empty and
single-example batches, and the argument checks. The CUDA kernels against the CPU op: the emulator
(tests/test_emulator.py) and the device cases here."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bpclip_fast import _ops

sys.path.insert(0, str(Path(__file__).parent / "emulator"))
import harness  # noqa: E402  (the float64 terms of the two sums and their summation bound)

OPS = torch.ops.bpclip_fast
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
EPS = 1e-5


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def ln_stats(x, nd):
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, list(x.shape[x.dim() - nd:]), None, None, EPS)
    return mean, rstd


def gn_stats(x, groups):
    n, c = x.shape[:2]
    _, mean, rstd = torch.ops.aten.native_group_norm(x, None, None, n, c, x[0, 0].numel(), groups, EPS)
    return mean, rstd


def check_against_reference(gw, gb, g, x, mean, rstd, layer_norm, groups, batch):
    acc = acc_dtype(x.dtype)
    tw, tb = harness.norm_affine_terms(g.cpu(), x.cpu(), mean.cpu(), rstd.cpu(), layer_norm, groups, batch)
    assert gw.dtype == gb.dtype == acc
    assert gw.shape == gb.shape == tw.shape[:2]
    assert gw.is_contiguous() and gb.is_contiguous()
    for out, t in ((gw, tw), (gb, tb)):
        # The reference's own float64 rounding is part of the allowance.
        tol = harness.accumulation_bound(t, acc) + harness.accumulation_bound(t, torch.float64)
        err = (out.cpu().double() - t.sum(-1)).abs()
        assert (err <= tol).all(), f"max error {err.max():.3g}, allowed {tol.max():.3g}"


def data(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.7
    return g.to(dtype).to(device), x.to(dtype).to(device)


# (shape, normalized dims): 2-D [B, D], 3-D [B, T, D] (T across the CUDA kernel's 64-row chunk),
# a normalized shape of two dims, a 4-D input normalized over its last dim, D = 1.
LN_CASES = [((4, 37), 1), ((3, 5, 16), 1), ((2, 130, 24), 1), ((2, 3, 4, 5), 2), ((2, 3, 2, 6), 1), ((3, 4, 1), 1)]
# (shape, groups): G = 1, G = C, in-between, 3-D input, 1x1 spatial, a long spatial row.
GN_CASES = [((3, 6, 4, 5), 3), ((2, 4, 3, 3), 1), ((2, 5, 2, 3), 5), ((2, 8, 7), 4), ((3, 6, 1, 1), 2),
            ((2, 4, 70, 70), 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,nd", LN_CASES, ids=str)
def test_layer_norm_matches_reference(device, dtype, shape, nd):
    g, x = data(shape, dtype, device, seed=len(shape) + shape[-1])
    mean, rstd = ln_stats(x, nd)
    gw, gb = _ops.norm_affine_example_grads(g, x, mean, rstd, shape[0], layer_norm=True)
    assert gw.device == x.device
    check_against_reference(gw, gb, g, x, mean, rstd, True, 1, shape[0])


def _group_norm_stats_or_skip(x, groups):
    try:
        return gn_stats(x, groups)
    except RuntimeError as e:  # (a CPU build of torch without fp16 group_norm)
        pytest.skip(f"native_group_norm does not run {x.dtype} on {x.device}: {e}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,groups", GN_CASES, ids=str)
def test_group_norm_matches_reference(device, dtype, shape, groups):
    g, x = data(shape, dtype, device, seed=shape[1] + groups)
    mean, rstd = _group_norm_stats_or_skip(x, groups)
    gw, gb = _ops.norm_affine_example_grads(g, x, mean, rstd, shape[0], groups, layer_norm=False)
    check_against_reference(gw, gb, g, x, mean, rstd, False, groups, shape[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_data_takes_stats_in_either_dtype(device, dtype):
    # ATen gives half-typed statistics on CPU and fp32 ones on CUDA (and fp32 with fp32 affine
    # parameters): the op reads both as fp32, so the two give the same bits for the same values.
    g, x = data((3, 7, 20), dtype, device, seed=4)
    mean, rstd = ln_stats(x, 1)
    a = _ops.norm_affine_example_grads(g, x, mean, rstd, 3)
    b = _ops.norm_affine_example_grads(g, x, mean.float(), rstd.float(), 3)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    if device != "cpu":
        return  # CUDA's native_layer_norm refuses fp32 affine parameters on half data (seen on an H200)
    _, m32, r32 = torch.ops.aten.native_layer_norm(x, [20], torch.ones(20, device=device),
                                                   torch.zeros(20, device=device), EPS)
    assert m32.dtype in (dtype, torch.float32)
    gw, gb = _ops.norm_affine_example_grads(g, x, m32, r32, 3)
    check_against_reference(gw, gb, g, x, m32, r32, True, 1, 3)


def _per_example(fn, w, b, g, x):
    """torch.func per-example gradients of sum(fn(x_i, w, b) * g_i) with respect to (w, b)."""
    def loss(w_, b_, xi, gi):
        return (fn(xi.unsqueeze(0), w_, b_) * gi.unsqueeze(0)).sum()
    return torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(w, b, x, g)


@pytest.mark.parametrize("shape,nd", [((4, 6, 10), 1), ((3, 2, 3, 4), 2)], ids=str)
def test_layer_norm_matches_torch_func(device, shape, nd):
    g, x = data(shape, torch.float64, device, seed=7)
    norm_shape = list(shape[len(shape) - nd:])
    w = torch.randn(norm_shape, dtype=torch.float64, device=device)
    b = torch.randn(norm_shape, dtype=torch.float64, device=device)
    ref_w, ref_b = _per_example(lambda xi, w_, b_: F.layer_norm(xi, norm_shape, w_, b_, EPS), w, b, g, x)
    mean, rstd = ln_stats(x, nd)
    gw, gb = _ops.norm_affine_example_grads(g, x, mean, rstd, shape[0])
    torch.testing.assert_close(gw, ref_w.reshape(shape[0], -1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gb, ref_b.reshape(shape[0], -1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape,groups", [((3, 6, 4, 5), 3), ((2, 4, 5), 1), ((2, 4, 3, 3), 4)], ids=str)
def test_group_norm_matches_torch_func(device, shape, groups):
    g, x = data(shape, torch.float64, device, seed=8)
    w = torch.randn(shape[1], dtype=torch.float64, device=device)
    b = torch.randn(shape[1], dtype=torch.float64, device=device)
    ref_w, ref_b = _per_example(lambda xi, w_, b_: F.group_norm(xi, groups, w_, b_, EPS), w, b, g, x)
    mean, rstd = gn_stats(x, groups)
    gw, gb = _ops.norm_affine_example_grads(g, x, mean, rstd, shape[0], groups, layer_norm=False)
    torch.testing.assert_close(gw, ref_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gb, ref_b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(device, dtype):
    # Transposed views for the data and a strided view for the statistics give the same result as
    # their contiguous copies.
    g0, x0 = data((6, 5, 12), dtype, device, seed=9)
    g, x = g0.transpose(0, 1), x0.transpose(0, 1)  # [5, 6, 12], examples along the old dim 1
    mean, rstd = ln_stats(x, 1)
    wide_m = torch.zeros(*mean.shape[:-1], 3, dtype=mean.dtype, device=device)
    wide_r = torch.zeros_like(wide_m)
    wide_m[..., 1:2] = mean
    wide_r[..., 1:2] = rstd
    mean_nc, rstd_nc = wide_m[..., 1:2], wide_r[..., 1:2]
    assert not (g.is_contiguous() or x.is_contiguous() or mean_nc.is_contiguous())
    got = _ops.norm_affine_example_grads(g, x, mean_nc, rstd_nc, 5)
    want = _ops.norm_affine_example_grads(g.contiguous(), x.contiguous(), mean, rstd, 5)
    for u, v in zip(got, want):
        assert torch.equal(u, v)
    check_against_reference(*got, g, x, mean, rstd, True, 1, 5)
    if dtype == torch.float16 and device == "cpu":
        return  # (only the channels-last case below needs group_norm; covered in the other dtypes)
    gc, xc = data((3, 4, 5, 6), dtype, device, seed=10)
    gc, xc = gc.to(memory_format=torch.channels_last), xc.to(memory_format=torch.channels_last)
    mean, rstd = _group_norm_stats_or_skip(xc, 2)
    got = _ops.norm_affine_example_grads(gc, xc, mean, rstd, 3, 2, False)
    want = _ops.norm_affine_example_grads(gc.contiguous(), xc.contiguous(), mean, rstd, 3, 2, False)
    for u, v in zip(got, want):
        assert torch.equal(u, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_and_single_example_batches(device, dtype):
    acc = acc_dtype(dtype)
    g, x = data((0, 4, 6), dtype, device, seed=11)
    mean, rstd = ln_stats(x, 1)
    gw, gb = _ops.norm_affine_example_grads(g, x, mean, rstd, 0)
    assert gw.shape == gb.shape == (0, 6) and gw.dtype == acc
    g, x = data((0, 2, 3, 5), dtype, device, seed=12)
    mean, rstd = ln_stats(x, 2)
    assert _ops.norm_affine_example_grads(g, x, mean, rstd, 0)[0].shape == (0, 15)
    g, x = data((0, 6, 3, 3), dtype, device, seed=13)
    empty = torch.empty(0, 3, dtype=acc, device=device)
    gw, gb = _ops.norm_affine_example_grads(g, x, empty, empty, 0, 3, False)
    assert gw.shape == gb.shape == (0, 6) and gw.dtype == acc
    # One example, and examples with no positions (T = 0: the sums are empty, zeros).
    g, x = data((1, 9, 8), dtype, device, seed=14)
    mean, rstd = ln_stats(x, 1)
    check_against_reference(*_ops.norm_affine_example_grads(g, x, mean, rstd, 1), g, x, mean, rstd, True, 1, 1)
    g, x = data((1, 6, 5), dtype, device, seed=15)
    if not (dtype == torch.float16 and device == "cpu"):
        mean, rstd = _group_norm_stats_or_skip(x, 3)
        out = _ops.norm_affine_example_grads(g, x, mean, rstd, 1, 3, False)
        check_against_reference(*out, g, x, mean, rstd, False, 3, 1)
    g, x = data((2, 3, 0), dtype, device, seed=16)
    stats = torch.ones(2, 1, dtype=acc, device=device)
    gw, gb = _ops.norm_affine_example_grads(g, x, stats, stats, 2, 1, False)
    assert torch.equal(gw, torch.zeros(2, 3, dtype=acc, device=device)) and torch.equal(gb, gw)


def test_bad_arguments(device):
    g, x = data((2, 3, 8), torch.float32, device, seed=17)
    mean, rstd = ln_stats(x, 1)
    op = _ops.norm_affine_example_grads
    prefix = "bpclip_fast.norm_affine_example_grads: "
    with pytest.raises(RuntimeError, match="x must be float32"):
        op(g.int(), x.int(), mean, rstd, 2)
    with pytest.raises(RuntimeError, match=prefix + "grad_out is Half but x is Float"):
        op(g.half(), x, mean, rstd, 2)
    with pytest.raises(RuntimeError, match=prefix + r"grad_out has shape \[2, 3, 4\]"):
        op(g[..., :4], x, mean, rstd, 2)
    with pytest.raises(RuntimeError, match=prefix + "mean must be Float for Float data, got Double"):
        op(g, x, mean.double(), rstd.double(), 2)
    with pytest.raises(RuntimeError, match=prefix + "mean must be Half or Float for Half data, got Double"):
        op(g.half(), x.half(), mean.double(), rstd.double(), 2)
    with pytest.raises(RuntimeError, match=prefix + "rstd is Half but mean is Float"):
        op(g.half(), x.half(), mean, rstd.half(), 2)
    with pytest.raises(RuntimeError, match=prefix + "rstd has 5 entries but mean has 6"):
        op(g, x, mean, rstd.reshape(-1)[:5], 2)
    with pytest.raises(RuntimeError, match=prefix + "batch must be >= 0"):
        op(g, x, mean, rstd, -1)
    with pytest.raises(RuntimeError, match=prefix + "mean has 6 rows, not a multiple of batch = 4"):
        op(g, x, mean, rstd, 4)
    with pytest.raises(RuntimeError, match=prefix + "x has 48 elements, not a multiple of mean's 5 rows"):
        op(g, x, mean.reshape(-1)[:5], rstd.reshape(-1)[:5], 1)
    with pytest.raises(RuntimeError, match=prefix + "mean is empty but x has 48 elements"):
        op(g, x, mean[:0], rstd[:0], 0)
    e = torch.empty(0, 4, 8, device=device)
    with pytest.raises(RuntimeError, match=prefix + "with an empty mean, its shape must be native_layer_norm's"):
        op(e, e, mean.reshape(-1)[:0], rstd.reshape(-1)[:0], 0)
    gn, xn = data((2, 6, 3, 3), torch.float32, device, seed=18)
    mg, rg = gn_stats(xn, 3)
    with pytest.raises(RuntimeError, match=prefix + "groups must be >= 1 and divide C = 6, got 4"):
        op(gn, xn, mg, rg, 2, 4, False)
    with pytest.raises(RuntimeError, match=prefix + "groups must be >= 1 and divide C = 6, got 0"):
        op(gn, xn, mg, rg, 2, 0, False)
    with pytest.raises(RuntimeError, match=prefix + "mean needs batch \\* groups = 4 entries, got 6"):
        op(gn, xn, mg, rg, 2, 2, False)
    with pytest.raises(RuntimeError, match=prefix + "x has 2 examples but batch = 3"):
        op(gn, xn, mg, rg, 3, 3, False)
    with pytest.raises(RuntimeError, match=prefix + "group norm needs x of shape"):
        op(gn[:, 0, 0, 0], xn[:, 0, 0, 0], mg, rg, 2, 3, False)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="mean is on cpu"):
            op(g, x, mean.cpu(), rstd, 2)
        with pytest.raises(RuntimeError, match="grad_out is on cpu"):
            op(g.cpu(), x, mean, rstd, 2)


def test_fake_kernel_matches(device):
    # The shapes torch.compile / opcheck see, including the empty-batch row-size rule.
    from torch._subclasses.fake_tensor import FakeTensorMode
    cases = [((3, 5, 16), 1, True, 1), ((2, 3, 4, 5), 2, True, 1), ((0, 2, 3, 5), 2, True, 1),
             ((3, 6, 4, 5), 0, False, 3), ((2, 3, 0), 0, False, 1)]
    for shape, nd, ln, groups in cases:
        g, x = data(shape, torch.float32, device, seed=19)
        if ln:
            mean, rstd = ln_stats(x, nd)
        else:
            mean = rstd = torch.ones(shape[0], groups, device=device)
        real = _ops.norm_affine_example_grads(g, x, mean, rstd, shape[0], groups, ln)
        with FakeTensorMode() as mode:
            fake = _ops.norm_affine_example_grads(*(mode.from_tensor(t) for t in (g, x, mean, rstd)), shape[0],
                                                  groups, ln)
        for r, f in zip(real, fake):
            assert r.shape == f.shape and r.dtype == f.dtype and r.stride() == f.stride()
