"""Exact per-example clipping (``flat``, ``per_layer``; bpclip_fast/exact.py, csrc/exact.cpp).

* The per-example squared norms (ghost and instantiation, chunked or not) equal those of
  ``torch.func`` per-example gradients in float64, and the norm bound the factors are taken from
  is an upper bound that stays within its proven rounding margin.
* The released gradients equal ``Σ_i f(n_i; C) G_i`` computed here from ``torch.func`` gradients,
  for every clip function, batch kind and geometry (noise off).
* Bounds: each example's exact contribution (removing it) is at most ``C`` (flat: over all layers;
  per_layer: ``C_l`` per layer), on adversarial batches; one example's release computed exactly
  from the stored low-precision values is at most ``C``.
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from bpclip_fast import exact
from bpclip_fast import nn as bnn

OPS = torch.ops.bpclip_fast
DT = torch.float64
CLIP_FNS = ("clip", "global", "normalize")
GAMMA = 0.01


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# --------------------------------------------------------------------------- references

def per_example(module, x, g):
    """``{name: [B, *shape]}``: ∇ of ``<module(x_i), g_i>`` for each example alone (torch.func)."""
    params = {k: v.detach() for k, v in module.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in module.named_parameters() if not v.requires_grad}

    def inner(p, xi, gi):
        return (functional_call(module, {**p, **frozen}, (xi.unsqueeze(0),)) * gi.unsqueeze(0)).sum()

    return vmap(grad(inner), in_dims=(None, 0, 0))(params, x, g)


def sq_norms(grads):
    return sum(v.reshape(v.shape[0], -1).pow(2).sum(1) for v in grads.values())


def factor_of(n, c, clip_fn):
    if clip_fn == "clip":
        return torch.clamp(c / n, max=1.0)
    if clip_fn == "global":
        return (n <= c).to(n.dtype)
    return c / (n + GAMMA)


def weighted_sum(grads, c):
    return {k: (c.view(-1, *[1] * (v.dim() - 1)) * v).sum(0) for k, v in grads.items()}


LINEARS = {  # name: (in, out, positions or (), bias)
    "2d": (6, 5, (), True),
    "2d-nobias": (6, 5, (), False),
    "T1": (6, 5, (1,), True),
    "T4": (6, 5, (4,), True),
    "T7-nobias": (3, 4, (7,), False),
    "T2x3": (5, 2, (2, 3), True),
}

CONVS = {  # name: (in, out, kwargs, (H, W))
    "plain": (3, 4, dict(kernel_size=3), (7, 7)),
    "stride": (3, 4, dict(kernel_size=3, stride=2, padding=1), (9, 8)),
    "dilation": (2, 3, dict(kernel_size=3, dilation=2, padding=2), (9, 9)),
    "groups": (4, 6, dict(kernel_size=3, padding=1, groups=2), (6, 5)),
    "depthwise": (3, 3, dict(kernel_size=2, groups=3), (5, 5)),
    "mixed": (4, 4, dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2), (9, 8)),
    "1x1-out": (2, 3, dict(kernel_size=4), (4, 4)),
}


def torch_layer(kind, name, bias=None, dtype=DT):
    if kind == "linear":
        fin, fout, pos, b = LINEARS[name]
        return nn.Linear(fin, fout, bias=b if bias is None else bias, dtype=dtype), (*pos, fin)
    cin, cout, kw, hw = CONVS[name]
    return nn.Conv2d(cin, cout, bias=True if bias is None else bias, dtype=dtype, **kw), (cin, *hw)


LAYER_CASES = [("linear", n) for n in LINEARS] + [("conv", n) for n in CONVS]


def batch(kind, shape, n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *shape), generator=gen, dtype=DT)
    if kind == "mixed":  # far above and far below any threshold, and one all-zero example
        x[0] *= 1e4
        x[1] *= 1e-4
        x[2] = 0
    elif kind == "huge":
        x *= 1e6
    elif kind == "spike":
        x = x * 1e-6
        x.reshape(n, -1)[:, 0] = 1e5
    return x


def norms_of(layer, x, g, method, params=None, workspace=1 << 20):
    if params is None:
        params = (True, layer.bias is not None)
    if isinstance(layer, nn.Linear):
        return OPS.linear_grad_norms(g, x, list(params), method, workspace, False)[:2]
    return OPS.conv2d_grad_norms(g, x, list(layer.kernel_size), list(layer.stride), list(layer.padding),
                                 list(layer.dilation), layer.groups, list(params), method, workspace, False)[:2]


# --------------------------------------------------------------------------- 1. norms

@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("method", ["ghost", "instantiate", "auto"])
def test_norms_equal_torch_func_in_float64(case, method):
    layer, shape = torch_layer(*case)
    x = batch("mixed", shape)
    g = torch.randn_like(layer(x))
    ref = sq_norms(per_example(layer, x, g))
    # The fp64 margin is tiny: 1e-9 relative, and absolutely what underflow may lose (csrc/exact.cpp):
    # the position norms' 3k·τ under their roots (τ = 2^-1022, k <= d + p squares) carried through the
    # margins' sums over the T positions against the other side's norms, a few such terms.
    _, a1, b1 = position_sums(layer, x, g)
    k = layer.weight[0].numel() + layer.weight.shape[0]  # d + p (Conv2d: the patch and the channels)
    positions = g[0].numel() // layer.weight.shape[0]
    absolute = 10 * math.sqrt(3 * k * torch.finfo(torch.float64).tiny) * (a1 + b1 + positions)
    for workspace in (1 << 20, 1):  # one chunk, and one example per chunk
        sq, bound = norms_of(layer, x, g, method, workspace=workspace)
        torch.testing.assert_close(sq, ref, rtol=1e-12, atol=1e-300)
        assert (bound >= ref.sqrt()).all()
        assert ((bound - ref.sqrt()) <= 1e-9 * bound + absolute).all()


@pytest.mark.parametrize("case", [("linear", "T4"), ("conv", "groups")], ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("params", [(True, False), (False, True)])
def test_norms_cover_only_the_parameters_that_train(case, params):
    layer, shape = torch_layer(*case)
    layer.weight.requires_grad_(params[0])
    layer.bias.requires_grad_(params[1])
    x = batch("normal", shape)
    g = torch.randn_like(layer(x))
    sq, _ = norms_of(layer, x, g, "auto", params)
    torch.testing.assert_close(sq, sq_norms(per_example(layer, x, g)), rtol=1e-12, atol=0)


# the release scales c·g toward zero in fp32 for every data dtype (csrc/exact_release.cpp)
RZ_UNIT = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -23, torch.bfloat16: 2.0 ** -23}


def _linear_like(layer):
    """A Linear, or Hugging Face's Conv1D (a Linear with the weight transposed; nf/nx its widths)."""
    return isinstance(layer, nn.Linear) or hasattr(layer, "nf")


def _unfold(layer, x, g):
    """``(patches, g)`` of a Conv2d, or of an nn.Conv1d as the Conv2d of height 1 the fused layer runs; of
    an nn.Conv3d (one group, zero padding) as ``[B, C·kd·kh·kw, T]`` and ``[B, O, 1, T]``, the patches
    taken by torch's own convolution with one-hot kernels (independent of the layer's unfold)."""
    if isinstance(layer, nn.Conv3d):
        c, k = layer.in_channels, math.prod(layer.kernel_size)
        eye = torch.eye(k, dtype=x.dtype).reshape(k, 1, *layer.kernel_size).repeat(c, 1, 1, 1, 1)
        u = F.conv3d(x, eye, None, layer.stride, layer.padding, layer.dilation, groups=c)
        return u.flatten(2), g.flatten(2).unsqueeze(2)
    if isinstance(layer, nn.Conv1d):
        return F.unfold(x.unsqueeze(2), (1, *layer.kernel_size), (1, *layer.dilation), (0, *layer.padding),
                        (1, *layer.stride)), g.unsqueeze(2)
    return F.unfold(x, layer.kernel_size, layer.dilation, layer.padding, layer.stride), g


def spread(layer, x, g):
    """P = Σ_t ‖g_t‖·‖[x_t; 1]‖ per example (x_t: the input row or the patch of t's channel group)."""
    if _linear_like(layer):
        xs, gs = x.reshape(x.shape[0], -1, x.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1])
        return (gs.norm(dim=2) * (xs.pow(2).sum(2) + 1).sqrt()).sum(1)
    groups = layer.groups
    u, g = _unfold(layer, x, g)
    u = u.reshape(x.shape[0], groups, -1, u.shape[-1])
    gg = g.reshape(g.shape[0], groups, -1, g.shape[-2] * g.shape[-1])
    return (gg.norm(dim=2) * (u.pow(2).sum(2) + 1).sqrt()).sum((1, 2))


def position_norms64(layer, x, g):
    """``(‖x_t‖, ‖g_t‖)`` per example and position ``[n, positions]`` (channel groups flattened into the
    positions), the positions of :func:`spread`; in the inputs' dtype (pass float64)."""
    if _linear_like(layer):
        return (x.reshape(x.shape[0], -1, x.shape[-1]).norm(dim=2),
                g.reshape(g.shape[0], -1, g.shape[-1]).norm(dim=2))
    groups = layer.groups
    u, g = _unfold(layer, x, g)
    xn = u.reshape(x.shape[0], groups, -1, u.shape[-1]).norm(dim=2).flatten(1)
    gn = g.reshape(g.shape[0], groups, -1, g.shape[-2] * g.shape[-1]).norm(dim=2).flatten(1)
    return xn, gn


def position_sums(layer, x, g):
    """``(M, A1, B1)`` per example: ``Σ_t ‖x_t‖‖g_t‖``, ``Σ_t ‖x_t‖``, ``Σ_t ‖g_t‖`` over the positions of
    :func:`spread` (weight rows only, no bias 1): what csrc/exact.cpp's underflow terms are built from."""
    if _linear_like(layer):
        xn = x.reshape(x.shape[0], -1, x.shape[-1]).norm(dim=2)
        gn = g.reshape(g.shape[0], -1, g.shape[-1]).norm(dim=2)
        return (xn * gn).sum(1), xn.sum(1), gn.sum(1)
    groups = layer.groups
    u, g = _unfold(layer, x, g)
    xn = u.reshape(x.shape[0], groups, -1, u.shape[-1]).norm(dim=2)
    gn = g.reshape(g.shape[0], groups, -1, g.shape[-2] * g.shape[-1]).norm(dim=2)
    return (xn * gn).sum((1, 2)), xn.sum((1, 2)), gn.sum((1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [("linear", "2d"), ("linear", "T4"), ("conv", "mixed")],
                         ids=lambda c: f"{c[0]}-{c[1]}")
def test_low_precision_bound_covers_the_exact_norm_of_the_stored_values(dtype, case):
    """The data as stored in ``dtype``, its exact per-example norm (float64 from the same values):
    the bound is above it, by no more than the scaling's rounding toward zero (r·P, the dominant
    term of the proof's margin; csrc/exact.cpp) plus 1e-4·P for the fp32 arithmetic."""
    layer, shape = torch_layer(*case, dtype=dtype)
    x = batch("normal", shape).to(dtype)
    g = torch.randn_like(layer(x))
    exact = copy.deepcopy(layer).double()
    ref = sq_norms(per_example(exact, x.double(), g.double())).sqrt()
    p = spread(exact, x.double(), g.double())
    for method in ("ghost", "instantiate"):
        sq, bound = norms_of(layer, x, g, method)
        assert (bound >= ref).all(), method
        assert (bound <= ref + (RZ_UNIT[dtype] + 1e-4) * p).all(), method


# --------------------------------------------------------------------------- 2. releases

def exact_model(kind, name, mode, c, clip_fn, bias=None):
    layer, shape = torch_layer(kind, name, bias)
    plain = copy.deepcopy(layer)
    model = nn.Sequential(layer)
    bnn.convert_model(model, clipping=mode, max_grad_norm=c, clip_fn=clip_fn, gamma=GAMMA)
    return model, plain, shape


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("clip_fn", CLIP_FNS)
@pytest.mark.parametrize("kind", ["normal", "mixed"])
def test_one_layer_release_equals_the_clipped_sum_of_per_example_gradients(case, mode, clip_fn, kind):
    c = 0.7
    model, plain, shape = exact_model(*case, mode, c, clip_fn)
    x = batch(kind, shape)
    g = torch.randn_like(plain(x))
    model(x).backward(g)
    grads = per_example(plain, x, g)
    expect = weighted_sum(grads, factor_of(sq_norms(grads).sqrt(), c, clip_fn))
    for k, p in model[0].named_parameters():
        torch.testing.assert_close(p.grad, expect[k], rtol=1e-10, atol=1e-12)


def two_branch_net(dtype=DT):
    """Conv -> (branch a: conv; branch b: 1x1 strided conv) summed, then two Linears: the order in
    which the layers' backward passes run differs from their forward order and from
    ``named_modules`` order."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(2, 4, 3, padding=1, dtype=dtype)
            self.a = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=2, dtype=dtype)
            self.b = nn.Conv2d(4, 4, 1, stride=2, bias=False, dtype=dtype)
            self.head = nn.Linear(4 * 3 * 3, 5, dtype=dtype)
            self.side = nn.Linear(2 * 6 * 6, 5, bias=False, dtype=dtype)

        def forward(self, x):
            h = torch.tanh(self.stem(x))
            y = torch.tanh(self.a(h)) + self.b(h)
            return self.head(y.flatten(1)) + self.side(x.flatten(1))

    return Net()


def loss_per_example_grads(model, x, y):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def inner(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0), reduction="sum")

    return vmap(grad(inner), in_dims=(None, 0, 0))(params, x, y)


def layer_groups(grads):
    out = {}
    for k in grads:
        out.setdefault(k.rsplit(".", 1)[0], []).append(k)
    return out


def reference_release(grads, mode, c, clip_fn, thresholds=None):
    if mode == "flat":
        return weighted_sum(grads, factor_of(sq_norms(grads).sqrt(), c, clip_fn))
    groups = layer_groups(grads)
    out = {}
    for i, keys in enumerate(groups.values()):
        part = {k: grads[k] for k in keys}
        cl = thresholds[i] if thresholds else c / math.sqrt(len(groups))
        out.update(weighted_sum(part, factor_of(sq_norms(part).sqrt(), cl, clip_fn)))
    return out


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("clip_fn", CLIP_FNS)
@pytest.mark.parametrize("n", [1, 3, 7])
def test_branching_model_release(mode, clip_fn, n):
    """Flat clipping's end of the backward comes from autograd's dependencies (the collector), so a
    model whose layers' backward passes run in another order than their forward is released right."""
    torch.manual_seed(n)
    net = two_branch_net()
    x = batch("mixed", (2, 6, 6), n=n, seed=n) if n > 3 else batch("normal", (2, 6, 6), n=n, seed=n)
    y = torch.randint(0, 5, (n,))
    grads = loss_per_example_grads(net, x, y)
    model = copy.deepcopy(net)
    bnn.convert_model(model, clipping=mode, max_grad_norm=1.3, clip_fn=clip_fn, gamma=GAMMA)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    expect = reference_release(grads, mode, 1.3, clip_fn)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expect[k], rtol=1e-10, atol=1e-12, msg=f"{mode} {k}")


def test_per_layer_thresholds_list_and_noise_bound():
    net = two_branch_net()
    thresholds = [0.5, 1.0, 2.0, 0.25, 3.0]  # named_modules order: stem, a, b, head, side
    model = copy.deepcopy(net)
    bnn.convert_model(model, clipping="per_layer", max_grad_norm=thresholds)
    layers = [layer for _, layer in bnn.clipped_layers(model)]
    assert [layer._bp_max_grad_norm for layer in layers] == thresholds
    assert all(layer.sensitivity == pytest.approx(math.sqrt(sum(t * t for t in thresholds))) for layer in layers)
    x, y = batch("mixed", (2, 6, 6), n=5), torch.randint(0, 5, (5,))
    F.cross_entropy(model(x), y, reduction="sum").backward()
    expect = reference_release(loss_per_example_grads(net, x, y), "per_layer", None, "clip", thresholds)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expect[k], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="max_grad_norm has 2 thresholds but the model has 5 layers"):
        bnn.convert_model(copy.deepcopy(net), clipping="per_layer", max_grad_norm=[1.0, 2.0])


def test_frozen_layer_is_left_out_of_the_flat_norm():
    net = two_branch_net()
    net.a.requires_grad_(False)
    net.head.bias.requires_grad_(False)
    x, y = batch("mixed", (2, 6, 6), n=4), torch.randint(0, 5, (4,))
    model = copy.deepcopy(net)
    bnn.convert_model(model, clipping="flat", max_grad_norm=0.5)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in net.named_parameters() if not v.requires_grad}

    def inner(p, xi, yi):
        return F.cross_entropy(functional_call(net, {**p, **frozen}, (xi.unsqueeze(0),)), yi.unsqueeze(0),
                               reduction="sum")

    grads = vmap(grad(inner), in_dims=(None, 0, 0))(params, x, y)
    expect = reference_release(grads, "flat", 0.5, "clip")
    for k, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, expect[k], rtol=1e-10, atol=1e-12)
        else:
            assert p.grad is None


# --------------------------------------------------------------------------- 3. bounds

def release(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def adversarial_input(net, x, y, steps=15):
    """Gradient ascent on example 0's input to maximise its whole per-example gradient norm."""
    x = x.clone()
    for _ in range(steps):
        xi = x[:1].clone().requires_grad_(True)
        gs = torch.autograd.grad(F.cross_entropy(net(xi), y[:1], reduction="sum"), list(net.parameters()),
                                 create_graph=True)
        total = sum(g.pow(2).sum() for g in gs)
        (step,) = torch.autograd.grad(total, xi)
        x[:1] = x[:1] + 0.5 * step / (step.norm() + 1e-30) * x[:1].norm().clamp(min=1.0)
    return x


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("clip_fn", CLIP_FNS)
@pytest.mark.parametrize("kind", ["normal", "huge", "spike", "adversarial"])
def test_each_examples_contribution_is_within_the_bound(mode, clip_fn, kind):
    """Removing example i changes the release by its contribution: at most C over all layers
    (flat), at most C_l per layer (per_layer), exactly (float64)."""
    torch.manual_seed(3)
    net = two_branch_net()
    n, c = 5, 0.8
    x, y = batch("normal" if kind == "adversarial" else kind, (2, 6, 6), n=n, seed=4), torch.randint(0, 5, (n,))
    if kind == "adversarial":
        x = adversarial_input(net, x, y)
    model = copy.deepcopy(net)
    bnn.convert_model(model, clipping=mode, max_grad_norm=c, clip_fn=clip_fn, gamma=GAMMA)
    full = release(model, x, y)
    groups = layer_groups(full)
    for i in range(n):
        keep = [j for j in range(n) if j != i]
        part = release(model, x[keep], y[keep])
        diff = {k: full[k] - part[k] for k in full}
        if mode == "flat":
            assert math.sqrt(sum(float(v.pow(2).sum()) for v in diff.values())) <= c * (1 + 1e-12)
        else:
            for keys in groups.values():
                cl = c / math.sqrt(len(groups))
                assert math.sqrt(sum(float(diff[k].pow(2).sum()) for k in keys)) <= cl * (1 + 1e-12)


def exact_sq(t):
    return sum((Fraction(v) ** 2 for v in t.double().reshape(-1).tolist()), Fraction(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("clip_fn", CLIP_FNS)
def test_one_examples_release_is_within_the_bound_exactly_from_stored_values(dtype, mode, clip_fn):
    """B = 1 through a biased Linear on 2-D input: the bias gradient is the stored RZ(c·g) itself, so
    the contribution ‖RZ(c g) x^T‖² + ‖RZ(c g)‖² is computed exactly (fractions) from what the layer
    stored, on rows scaled so that the bound falls between representable norms. fp16/bf16 layers
    release the fp32 sum plus the noise rounded once to their dtype (post-processing of the noised
    value, csrc/exact.cpp): there the fp32 values the op returns before that rounding are checked,
    and the stored gradient must be exactly them rounded to nearest."""
    gen = torch.Generator().manual_seed(11)
    for trial in range(12):
        lin = nn.Linear(5, 4, dtype=dtype)
        model = nn.Sequential(lin)
        x = torch.randn(1, 5, generator=gen).to(dtype)
        g = torch.randn(1, 4, generator=gen).to(dtype)
        c = float(torch.rand(1, generator=gen)) * 2 + 0.1
        target = Fraction(c) ** 2
        # scale g so that the example's exact norm is just above C: the case rounding could push over
        n0 = math.sqrt(float(exact_sq(g)) * (float(exact_sq(x)) + 1))
        g = (g.double() * (c / n0) * (1 + 2.0 ** -(trial + 6))).to(dtype)
        bnn.convert_model(model, clipping=mode, max_grad_norm=c, clip_fn=clip_fn, gamma=GAMMA)
        model(x).backward(g)
        gb = model[0].bias.grad
        if dtype != torch.float32:
            _, bound, _, _ = OPS.linear_grad_norms(g, x, [True, True], "auto", 1 << 20, False)
            factor = exact.factors(bound, c, clip_fn, GAMMA, torch.zeros(1, dtype=torch.long), dtype)
            gw32, gb32 = OPS.linear_clipped_grads(g, x, factor, lin.weight.detach(), [True, True], [0, 0], 0.0,
                                                  None, None)
            assert gb32.dtype == torch.float32
            assert torch.equal(gb, gb32.to(dtype)) and torch.equal(model[0].weight.grad, gw32.to(dtype))
            gb = gb32
        contribution = exact_sq(gb) * (exact_sq(x) + 1)
        assert contribution <= target, f"trial {trial}: {math.sqrt(contribution)!r} > {c!r}"  # one layer: C_l = C
