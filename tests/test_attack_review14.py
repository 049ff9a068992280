"""Attack review of ccd88f4 (kept per-example gradients within exact.KEPT_BYTES, each chunk's GEMM and
bias sums written straight into slices of one kept tensor, the CPU norms workspace 24 MB).

What could go wrong there, and what each test pins:

* A chunk's slice at the wrong offset (n = rows x groups vs rows), or the bias slice [n, 1, p] not
  matching the kept layout [B, G p] of a grouped conv: example i's kept row would hold another
  example's gradient (released with example i's factor), or the bound kernel would norm one row and
  the release sum another. Checked row by row against each example's float64 gradient, with the
  examples at scales 2^i so that a shifted row is far outside the tolerance, over workspaces that
  split the batch unevenly, for every dtype, channels_last / non-contiguous inputs, groups 1-3.
* A non-finite example in a later chunk: its bound must be non-finite, the other rows intact.
* The fake (bpclip_fast/_ops.py) and keep_instantiated disagreeing at the byte boundary for a grouped
  conv or fp16 data (the existing test covers groups 1 and fp32/fp64/bf16).
* End to end, flat and per_layer, with the CPU workspace shrunk so that every layer chunks unevenly,
  a grouped conv, a frozen bias, a channels_last input, and the allowance either ample or spent:
  the released gradients equal the clipped sums of torch.func's float64 per-example gradients. Also
  after torch.autograd.grad with respect to the input over the same forward (its entries and their
  kept bytes linger in the book when loss.backward() runs), and for two micro-batches (two flat
  books, different row counts) summed into one backward.

None of these failed on ccd88f4: they are probes of the risky cases, not findings. Each was checked
to fail when the kept rows are shifted by one example, the grouped bias sums are laid out group-minor
instead of group-major, or the fake counts 4 bytes an entry for fp64 data."""

from __future__ import annotations

import copy

import pytest
import torch

from bpclip_fast import exact
from test_exact_kept import clipped_release_truth, record_kept

OPS = torch.ops.bpclip_fast
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DT_IDS = ["f32", "f64", "f16", "bf16"]
HUGE = 1 << 40  # keep_extra that keeps whatever instantiation gives


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _unit(dtype):
    return 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24


def _gamma(k, u):
    return k * u / (1 - k * u)


def _per_example_bytes(kind, dtype, T, d, p, G):
    """csrc/exact.cpp's chunk_rows argument for method 'instantiate' (the test only uses it to pick
    workspaces that split the batch: a change there makes the chunks other sizes, not the test pass)."""
    elt = _acc(dtype).itemsize
    if kind == "linear":
        return elt * (T * (d + p) + 3 * d * p) + 8 * T * (d + p)
    return elt * G * (T * (d + p) + 3 * d * p)


def _data(kind, dtype, B, G, layout, seed=0):
    """(x, g, geometry, T, d, p, G): example i scaled by 2^(i mod 5) (input) and 2^-(i mod 3) (upstream),
    so a kept row that belongs to another example is off by at least a factor 2 somewhere."""
    gen = torch.Generator().manual_seed(seed)
    sx = torch.tensor([2.0 ** (i % 5) for i in range(B)], dtype=torch.float64)
    sg = torch.tensor([2.0 ** -(i % 3) for i in range(B)], dtype=torch.float64)
    if kind == "linear":  # T = 6 positions (as [B, 2, 3, d] for a 4-d input), d = 5, p = 4
        x = torch.randn(B, 2, 3, 5, generator=gen, dtype=torch.float64) * sx.view(-1, 1, 1, 1)
        g = torch.randn(B, 2, 3, 4, generator=gen, dtype=torch.float64) * sg.view(-1, 1, 1, 1)
        x, g = x.to(dtype), g.to(dtype)
        if layout == "strided":  # a permuted view of other storage
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return x, g, None, 6, 5, 4, 1
    cin, cout = 2 * G, 3 * G  # 3x3 on 5x5, padding 1, stride 1: T = 25, d = 2 * 9, p = 3 per group
    x = torch.randn(B, cin, 5, 5, generator=gen, dtype=torch.float64) * sx.view(-1, 1, 1, 1)
    g = torch.randn(B, cout, 5, 5, generator=gen, dtype=torch.float64) * sg.view(-1, 1, 1, 1)
    x, g = x.to(dtype), g.to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        x = torch.cat([x, x], 3)[..., ::2][..., :5]  # a sliced, non-contiguous view
    return x, g, ([1, 1], [1, 1], [1, 1], G), 25, 18, 3, G


def _norms(kind, x, g, geometry, bias, ws, extra):
    mask = [True, bias]
    if geometry is None:
        return OPS.linear_grad_norms(g, x, mask, "instantiate", ws, True, None, extra)
    stride, padding, dilation, groups = geometry
    return OPS.conv2d_grad_norms(g, x, [3, 3], stride, padding, dilation, groups, mask, "instantiate", ws, True,
                                 None, extra)


def _truth(kind, x, g, geometry, G):
    """float64 per-example ([B, G p d] in the weight's layout, [B, G p]) and their entrywise bounds
    sum_t |g||x| (for the GEMM's rounding)."""
    x64, g64 = x.double(), g.double()
    if geometry is None:
        B, d, p = x.shape[0], x.shape[-1], g.shape[-1]
        xs, gs = x64.reshape(B, -1, d), g64.reshape(B, -1, p)
        w = torch.einsum("btp,btd->bpd", gs, xs).reshape(B, -1)
        a = torch.einsum("btp,btd->bpd", gs.abs(), xs.abs()).reshape(B, -1)
        return w, gs.sum(1), a, gs.abs().sum(1)
    stride, padding, dilation, groups = geometry
    shape = (g.shape[1], x.shape[1] // groups, 3, 3)

    def per(xx, gg):
        return torch.stack([torch.nn.grad.conv2d_weight(xx[i:i + 1], shape, gg[i:i + 1], stride, padding, dilation,
                                                        groups).reshape(-1) for i in range(xx.shape[0])])

    return per(x64, g64), g64.sum((2, 3)), per(x64.abs(), g64.abs()), g64.abs().sum((2, 3))


CHUNKS = ["one", "twos", "threes", "whole"]  # rows per chunk: 1, 2 (7 = 2+2+2+1), 3 (3+3+1), all


def _workspace(chunks, kind, dtype, T, d, p, G):
    per = _per_example_bytes(kind, dtype, T, d, p, G)
    return {"one": 1, "twos": 2 * per + 1, "threes": 3 * per + 1, "whole": 1 << 40}[chunks]


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind,G,layout", [("linear", 1, "contiguous"), ("linear", 1, "strided"),
                                           ("conv", 1, "contiguous"), ("conv", 2, "channels_last"),
                                           ("conv", 3, "strided")])
def test_chunked_kept_rows_are_each_examples_own_gradient(kind, G, layout, bias, dtype, chunks):
    B = 7
    x, g, geometry, T, d, p, G = _data(kind, dtype, B, G, layout)
    ws = _workspace(chunks, kind, dtype, T, d, p, G)
    _, bound, kw, kb = _norms(kind, x, g, geometry, bias, ws, HUGE)
    acc = _acc(dtype)
    assert kw.shape == (B, G * p * d) and kw.dtype == acc, "the kept path must be taken"
    assert kb.shape == ((B, G * p) if bias else (0,))
    tw, tb, aw, ab = _truth(kind, x, g, geometry, G)
    e = _gamma(T, _unit(dtype))  # one GEMM / one sum over T positions in the accumulation dtype
    assert ((kw.double() - tw).abs() <= e * aw).all(), \
        f"kept weight rows off: worst row {((kw.double() - tw).abs() - e * aw).amax(1).argmax().item()}"
    if bias:
        assert ((kb.double() - tb).abs() <= e * ab).all(), "kept bias rows off"
    # The bound covers what the release holds of each example at factor 1: its own kept row.
    held = kw.double().square().sum(1) + (kb.double().square().sum(1) if bias else 0)
    assert (bound >= held.sqrt()).all(), "a kept row above its example's bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("kind,G", [("linear", 1), ("conv", 2)])
def test_a_nonfinite_example_in_a_later_chunk_stays_in_its_row(kind, G, dtype):
    B = 7
    x, g, geometry, T, d, p, G = _data(kind, dtype, B, G, "contiguous", seed=4)
    x[5].view(-1)[3] = float("inf")
    ws = _workspace("threes", kind, dtype, T, d, p, G)
    _, bound, kw, kb = _norms(kind, x, g, geometry, True, ws, HUGE)
    assert kw.numel() > 0
    finite = torch.isfinite(bound)
    assert finite.tolist() == [i != 5 for i in range(B)], "only example 5's bound may be non-finite"
    keep = torch.arange(B) != 5
    tw, tb, aw, ab = _truth(kind, x[keep], g[keep], geometry, G)
    e = _gamma(T, _unit(dtype))
    assert ((kw[keep].double() - tw).abs() <= e * aw).all() and ((kb[keep].double() - tb).abs() <= e * ab).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind,G", [("linear", 1), ("conv", 3)])
def test_fake_and_op_agree_at_the_keep_extra_boundary(kind, G, bias, dtype):
    """Beyond the memory-neutral rule (checked), kept iff B G p (d + bias) acc_bytes <= keep_extra, in
    the op and in its fake (torch.compile and opcheck trust the fake's shapes), for every dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B = 5
    if kind == "linear":  # T = 2, d = 8, p = 3: 4 p d = 96 > elt T p (at most 48)
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(B, 2, 8, generator=gen).to(dtype)
        g = torch.randn(B, 2, 3, generator=gen).to(dtype)
        geometry, T, d, p = None, 2, 8, 3
    else:  # 3 groups, 4 -> 2 channels each, 3x3 on 4x4: T = 4, d = 36, p = 2
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(B, 4 * G, 4, 4, generator=gen).to(dtype)
        g = torch.randn(B, 2 * G, 2, 2, generator=gen).to(dtype)
        geometry, T, d, p = ([1, 1], [0, 0], [1, 1], G), 4, 36, 2
    assert 4 * G * p * d > g.element_size() * (g.numel() // B), "the case must be beyond the memory-neutral rule"
    need = B * G * p * (d + (1 if bias else 0)) * _acc(dtype).itemsize
    for extra, kept in ((0, False), (need - 1, False), (need, True)):
        _, _, kw, kb = _norms(kind, x, g, geometry, bias, 1 << 20, extra)
        assert (kw.numel() > 0) == kept and (kb.numel() > 0) == (kept and bias), (extra, need)
        with FakeTensorMode() as mode:
            _, _, fw, fb = _norms(kind, mode.from_tensor(x), mode.from_tensor(g), geometry, bias, 1 << 20, extra)
        assert fw.shape == kw.shape and fw.dtype == kw.dtype and fb.shape == kb.shape, "the fake must agree"


# ------------------------------------------------------------------------------ end to end


def _net():
    """Conv 24 -> 12 (groups 2, its bias frozen), Tanh, conv 12 -> 6 (groups 6), Flatten, Linear: both
    convs instantiate (T = 25); the first's kept gradients (d = 108, p = 6 a group) are larger than
    grad_out in float64, so KEPT_BYTES decides for it, the second's (d = 18, p = 1) are not (kept
    always: 8 bytes an entry, d <= T)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(24, 12, 3, padding=1, groups=2, dtype=torch.float64), torch.nn.Tanh(),
                              torch.nn.Conv2d(12, 6, 3, padding=1, groups=6, dtype=torch.float64), torch.nn.Flatten(),
                              torch.nn.Linear(6 * 25, 3, dtype=torch.float64))
    net[0].bias.requires_grad_(False)
    return net


@pytest.mark.parametrize("input_grad_first", [False, True], ids=["backward", "grad_x_then_backward"])
@pytest.mark.parametrize("allowance", ["ample", "spent"])
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_release_under_uneven_chunks_equals_float64_truth(mode, allowance, input_grad_first, monkeypatch):
    from bpclip_fast import nn as bnn

    B, C = 5, 0.7
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, 24, 5, 5, dtype=torch.float64, generator=gen) * torch.tensor(
        [2.0 ** i for i in range(B)], dtype=torch.float64).view(-1, 1, 1, 1)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.tensor([0, 2, 1, 1, 0])
    net = _net()
    want = clipped_release_truth(net, x, y, mode, C)
    model = copy.deepcopy(net)
    bnn.convert_model(model, clipping=mode, max_grad_norm=C)
    # Per-example bytes (csrc/exact.cpp's chunk_rows, fp64, instantiation): the first conv 8 * 2 *
    # (25 * 114 + 3 * 648) = 76704, the second 8 * 6 * (25 * 19 + 3 * 18) = 25392, the Linear 13248.
    # A workspace of two of the second's: chunks of 1 (first conv), 2 + 2 + 1 (second), 4 + 1 (Linear).
    monkeypatch.setattr(exact, "CPU_WORKSPACE_BYTES", 2 * 25392 + 1)
    monkeypatch.setattr(exact, "KEPT_BYTES", HUGE if allowance == "ample" else 0)
    seen = record_kept(monkeypatch)
    xin = x.clone().requires_grad_(input_grad_first)
    loss = torch.nn.functional.cross_entropy(model(xin), y, reduction="sum")
    if input_grad_first:
        (gx,) = torch.autograd.grad(loss, xin, retain_graph=True)
        assert torch.isfinite(gx).all()
        assert all(p.grad is None for p in model.parameters())
    seen.clear()
    loss.backward()
    kept = dict(seen)
    if allowance == "ample":
        assert kept["0"], "the first conv must take the kept path"
    else:  # spent: only the memory-neutral rule keeps
        assert not kept["0"]
    assert kept["2"], "the second conv is kept by the memory-neutral rule"
    for k, w in want.items():
        torch.testing.assert_close(model.get_parameter(k).grad, w, rtol=1e-10, atol=1e-12, msg=k)
    assert model[0].bias.grad is None


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_two_micro_batches_in_one_backward_release_each_their_own_kept_rows(mode, monkeypatch):
    """Two forwards (flat: two books, each with its own allowance) whose losses are summed into one
    backward: each micro-batch's kept rows are released with its own factors; the gradient is the
    sum of the two micro-batches' clipped sums (float64 truth)."""
    from bpclip_fast import nn as bnn

    C = 0.7
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 24, 5, 5, dtype=torch.float64, generator=gen) * torch.tensor(
        [2.0 ** i for i in range(6)], dtype=torch.float64).view(-1, 1, 1, 1)
    y = torch.tensor([0, 2, 1, 1, 0, 2])
    net = _net()
    parts = [(x[:4], y[:4]), (x[4:], y[4:])]  # 4 and 2 rows: different chunkings, different row counts
    wants = [clipped_release_truth(net, xb, yb, mode, C) for xb, yb in parts]
    model = copy.deepcopy(net)
    bnn.convert_model(model, clipping=mode, max_grad_norm=C)
    monkeypatch.setattr(exact, "CPU_WORKSPACE_BYTES", 2 * 27984 + 1)
    monkeypatch.setattr(exact, "KEPT_BYTES", HUGE)
    loss = sum(torch.nn.functional.cross_entropy(model(xb), yb, reduction="sum") for xb, yb in parts)
    loss.backward()
    for k in wants[0]:
        torch.testing.assert_close(model.get_parameter(k).grad, wants[0][k] + wants[1][k], rtol=1e-10, atol=1e-12,
                                   msg=k)
