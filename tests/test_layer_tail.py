"""layer_tail_ (csrc/include/bpclip_fast/tail.h): the epilogue of a backpropagation-clipping layer's
backward in one op: the weight's and bias' noise, the bias' sum over the rows, the input clipping's
VJP. Each job against its definition (the noise ops' streams, clip_rows_backward) and the bias sum
against float64 truth; the layers that use it against float64 truth at the rows where the bias sum
moves from the tail's launch to ATen's."""

import pytest
import torch
from torch import nn

from bpclip_fast import _ops

OPS = torch.ops.bpclip_fast
pytestmark = pytest.mark.skipif(not _ops.extension_loaded(), reason="needs the extension")


def _dyadic(shape, dtype, gen, bits=20):
    """Integers times 2^-bits below 1 in magnitude: any sum of up to 2^12 of them is a multiple of
    2^-bits below 2^12, exact in float64 (32 significant bits) whatever the order, so the float64 sum is
    the truth and the op's one rounding of it is checkable bit for bit."""
    return (torch.randint(-(1 << bits), 1 << bits, shape, generator=gen) * 2.0 ** -bits).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("R,nb", [(1, 1), (7, 33), (8, 5), (19, 64), (2048, 3)])
def test_bias_sum_is_the_exact_column_sum_rounded_once(device, dtype, R, nb):
    gen = torch.Generator().manual_seed(R * 100 + nb)
    rows = _dyadic((R, nb), dtype, gen).to(device)
    w, b = torch.zeros(4, 3, dtype=dtype, device=device), torch.full((nb,), 7.0, dtype=dtype, device=device)
    OPS.layer_tail_(w, b, rows, None, None, None, None, 1.0, "clip", 1, 2, 0.0, 1.0)
    truth = rows.double().sum(0)
    assert torch.equal(b, truth.to(dtype)), "the column sums, rounded once to the dtype"
    assert torch.equal(w, torch.zeros_like(w)), "std 0 and scale 1 leave w as it was"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("with_rows", [False, True])
def test_noise_is_philox_noise2_accumulated_then_scaled(device, dtype, scale, with_rows):
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(5, 300, generator=gen, dtype=dtype).to(device)
    b0 = torch.randn(5, generator=gen, dtype=dtype).to(device)
    rows = _dyadic((11, 5), dtype, gen).to(device) if with_rows else None
    w, b = w0.clone(), b0.clone()
    gx = OPS.layer_tail_(w, b, rows, None, None, None, None, 1.0, "clip", 2**40 + 3, 2**63 - 1, 0.7, scale)
    assert gx.numel() == 0
    wr, br = w0.clone(), rows.double().sum(0).to(dtype) if with_rows else b0.clone()
    OPS.philox_noise2_(wr, br, 2**40 + 3, 2**63 - 1, 0.7, True, True, scale)  # b's key wraps to -2^63
    assert torch.equal(w, wr) and torch.equal(b, br)
    assert not torch.equal(w, w0 * scale), "a draw was added"


def test_std_zero_draws_nothing_and_only_scales(device):
    gen = torch.Generator().manual_seed(4)
    w0, b0 = torch.randn(6, 7, generator=gen).to(device), torch.randn(6, generator=gen).to(device)
    w, b = w0.clone(), b0.clone()
    OPS.layer_tail_(w, b, None, None, None, None, None, 1.0, "clip", 1, 2, 0.0, 2.5)
    assert torch.equal(w, w0.mul(2.5)) and torch.equal(b, b0.mul(2.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("clip_fn", ["clip", "normalize", "global"])
def test_vjp_is_clip_rows_backward(device, dtype, clip_fn):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 40, generator=gen) * torch.tensor([0.1, 1, 3, 10, 0.5, 30]).unsqueeze(1)).to(dtype)
    x, g = x.to(device), torch.randn(6, 40, generator=gen).to(dtype).to(device)
    cnt = torch.zeros(1, dtype=torch.int64, device=device)
    xc, factor, nrm = OPS.clip_rows(x, cnt, 5.0, "l2", clip_fn, 0.01)
    acc = factor.dtype
    w, b = torch.zeros(3, 2, dtype=acc, device=device), torch.zeros(3, dtype=acc, device=device)
    gx = OPS.layer_tail_(w, b, None, g, xc, factor, nrm, 5.0, clip_fn, 1, 2, 0.3, 1.0)
    assert torch.equal(gx, OPS.clip_rows_backward(g, xc, factor, nrm, 5.0, clip_fn))


def test_bad_arguments_are_named(device):
    w, b = torch.zeros(4, 3, device=device), torch.zeros(4, device=device)
    args = (None, None, None, None, None, 1.0, "clip", 1, 2, 0.5, 1.0)
    with pytest.raises(RuntimeError, match="layer_tail_: w is Half; .*accumulation dtype"):
        OPS.layer_tail_(w.half(), b.half(), *args)
    with pytest.raises(RuntimeError, match="layer_tail_: w is Float but b is Double"):
        OPS.layer_tail_(w, b.double(), *args)
    with pytest.raises(RuntimeError, match="layer_tail_: w and b must be contiguous"):
        OPS.layer_tail_(torch.zeros(3, 4, device=device).t(), b, *args)
    with pytest.raises(RuntimeError, match=r"layer_tail_: bias_rows must be a contiguous \[rows, 4\]"):
        OPS.layer_tail_(w, b, torch.zeros(5, 3, device=device), *args[1:])
    with pytest.raises(RuntimeError, match="layer_tail_: grad needs the forward's clipped input"):
        OPS.layer_tail_(w, b, None, torch.zeros(2, 3, device=device), None, None, None, *args[5:])
    with pytest.raises(RuntimeError, match="layer_tail_: w and b overlap"):
        OPS.layer_tail_(w.view(-1)[:4], w.view(-1)[2:6], *args)
    with pytest.raises(RuntimeError, match="layer_tail_: std must be 0 or between"):
        OPS.layer_tail_(w, b, *args[:-2], -1.0, 1.0)
    with pytest.raises(RuntimeError, match=r"layer_tail_: std must be 0 or between 2\^-80"):  # reviews 38, 39 F2
        OPS.layer_tail_(w.double(), b.double(), *args[:-2], 1e-30, 1.0)
    with pytest.raises(RuntimeError, match="clip_fn must be"):  # checked with or without grad
        OPS.layer_tail_(w, b, None, None, None, None, None, 1.0, "bogus", 1, 2, 0.5, 1.0)


def _vjp_args(device, **bad):
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(7)).to(device)
    cnt = torch.zeros(1, dtype=torch.int64, device=device)
    xc, f, n = OPS.clip_rows(x, cnt, 1.0, "l2", "clip", 0.01)
    g = torch.randn(3, bad.get("grad_cols", 5), device=device)
    return g, xc, f, n.to(bad.get("norm_dtype", n.dtype)), bad.get("bound", 1.0), bad.get("clip_fn", "clip")


@pytest.mark.parametrize("bad", [dict(clip_fn="bogus"), dict(grad_cols=6), dict(bound=-1.0),
                                 dict(norm_dtype=torch.float64)], ids=["clip_fn", "shape", "bound", "norm dtype"])
def test_a_refused_call_leaves_w_and_b_as_they_were(device, bad):
    """Every argument is checked before anything is written, on every device (review 37 F2: the CPU
    kernel had summed the bias and drawn both noises before the VJP's checks raised)."""
    g, xc, f, n, bound, clip_fn = _vjp_args(device, **bad)
    w0, b0, rows = (torch.randn(4, 5, device=device), torch.randn(4, device=device),
                    torch.randn(6, 4, device=device))
    w, b = w0.clone(), b0.clone()
    with pytest.raises(RuntimeError):
        OPS.layer_tail_(w, b, rows, g, xc, f, n, bound, clip_fn, 1, 2, 0.5, 1.0)
    assert torch.equal(w, w0) and torch.equal(b, b0)


@pytest.mark.parametrize("which", ["bias_rows", "grad", "clipped"])
def test_inputs_sharing_memory_with_w_or_b_are_refused(device, which):
    """One launch reads the inputs while it rewrites w and b (review 37 F3: bias_rows a view of w gave
    a result that depended on the block schedule under the emulator)."""
    w, b = torch.randn(3, 5, device=device), torch.randn(5, device=device)
    g, xc, f, n, bound, clip_fn = _vjp_args(device)
    rows = torch.randn(4, 5, device=device)
    if which == "bias_rows":
        rows = w
    elif which == "grad":
        g = w
    else:
        xc = w
    with pytest.raises(RuntimeError, match=f"layer_tail_: {which} shares memory with w or b"):
        OPS.layer_tail_(w, b, rows, g, xc, f, n, bound, clip_fn, 1, 2, 0.5, 1.0)


def test_two_storages_over_the_same_memory_are_refused():
    """Two tensors of distinct storages can wrap one memory (``torch.from_numpy`` of one array twice):
    their bytes are compared, not only their storages (review 39 L2); disjoint memory passes."""
    import numpy as np

    mem = np.zeros(9, dtype=np.float32)
    b = torch.from_numpy(mem)[:5]
    rows = torch.from_numpy(mem)[4:9].reshape(1, 5)  # another storage, one float shared with b
    w = torch.zeros(3, 5)
    with pytest.raises(RuntimeError, match="layer_tail_: bias_rows shares memory with w or b"):
        OPS.layer_tail_(w, b, rows, None, None, None, None, 1.0, "clip", 1, 2, 0.5, 1.0)
    apart = torch.from_numpy(np.zeros(5, dtype=np.float32)).reshape(1, 5)
    OPS.layer_tail_(w, b, apart, None, None, None, None, 1.0, "clip", 1, 2, 0.5, 1.0)
    assert b.abs().sum() > 0  # the bias: zero rows summed, plus its draw


@pytest.mark.parametrize("rows", [2048, 2049])
def test_linear_at_the_bias_sum_threshold_matches_float64_truth(device, rows):
    """kTailBiasRowsMax rows: the bias summed in the tail's launch; one more: by ATen. Both against
    the float64 oracle (tests/test_layers.py's tolerance and comparison)."""
    from test_layers import assert_matches_float64_truth, paired

    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 4))
    ours, ref = paired(model, input_clip=1.5, grad_clip=0.3, clip_fn="clip")
    B = 2 if rows == 2048 else 3
    x = torch.randn(B, rows // B, 5, device=device) * 2
    assert B * x.shape[1] == rows
    assert_matches_float64_truth(ours.to(device), ref.to(device), x)


@pytest.mark.parametrize("rows", [2048, 2049])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_release_at_the_bias_sum_threshold_matches_float64_truth(device, rows, dtype):
    """The exact modes' Linear release at a mean-loss scale sums the bias in layer_tail_ up to
    kTailBiasRowsMax rows and with ATen above. Against float64 truth: per entry the op rounds c_i g_it
    toward zero (relative r), sums K = rows products in the accumulation dtype (γ_K(u) of the
    absolute sum) and scales once (u), so |got − truth| ≤ (K + 3)·u·scale·Σ|c_i g_it x_itᵀ|."""
    B = 2 if rows == 2048 else 3
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(B, rows // B, 3, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(B, rows // B, 5, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(5, 3, generator=gen, dtype=torch.float64).to(dtype)
    factor = torch.rand(B, generator=gen, dtype=torch.float64).to(dtype)
    scale = 0.37
    gw, gb = OPS.linear_clipped_grads(g.to(device), x.to(device), factor.to(device), w.to(device), [True, True],
                                      [0, 0], 0.0, None, None, scale)
    gs = factor.double()[:, None, None] * g.double()
    truth_w, truth_b = scale * torch.einsum("bto,bti->oi", gs, x.double()), scale * gs.sum((0, 1))
    abs_w = scale * torch.einsum("bto,bti->oi", gs.abs(), x.double().abs())
    abs_b = scale * gs.abs().sum((0, 1))
    u = 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24
    assert ((gw.cpu().double() - truth_w).abs() <= (rows + 3) * u * abs_w).all()
    assert ((gb.cpu().double() - truth_b).abs() <= (rows + 3) * u * abs_b).all()


@pytest.mark.parametrize("std,scale", [(0.0, 1.0), (0.7, 0.5)])
def test_an_empty_batch_sums_the_bias_to_zero_not_to_the_buffer(device, std, scale):
    """Zero rows sum to zero: the bias buffer (uninitialised memory in the layers, here 1234.5) is never
    read where its sum is asked for. Review 38 F1: an empty tensor's data pointer is null, and the
    CUDA kernel took a null pointer for "no sum asked", so an empty batch released the buffer's old
    contents (plus the noise; none at std 0)."""
    w, b = torch.zeros(0, device=device), torch.full((9,), 1234.5, device=device)
    OPS.layer_tail_(w, b, torch.zeros(0, 9, device=device), None, None, None, None, 1.0, "clip", 3, 8, std, scale)
    ref = torch.zeros(9, device=device)
    if std > 0:
        OPS.philox_noise_(ref, 3, 9, std, True, scale)
    assert torch.equal(b, ref)
