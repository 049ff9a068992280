"""The per-example sensitivity bounds of our layers, checked against exact per-example gradients.

For every layer configuration, clip function and kind of batch:

* each example's contribution to ``[∇W, ∇b]`` is computed exactly with ``torch.func`` (vmap of
  grad) on an independent plain-torch formulation of the clipped layer,
  ``∇_{W,b} <layer_{W,b}(x̃_i), g̃_i>`` with ``x̃``/``g̃`` clipped by ``bpclip_fast.reference``;
* its Frobenius norm must not exceed ``layer.sensitivity_for(x.shape)``;
* the sum of the contributions must equal the weight/bias gradient our kernels produce in one
  backward with ``grad_output = g`` (noise off), which ties the per-example view to the real layer.

Then the bounds are shown to be tight where a worst case exists (attainment), and the
``sensitivity`` property is compared with ``reference.layer_sensitivity`` and with a brute-force
patch multiplicity computed here by autograd.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from bpclip_fast import nn as bnn
from bpclip_fast import reference as ref

DT = torch.float64
CLIP_FNS = ("clip", "global", "normalize")
GAMMA = 0.01
BOUND_RTOL = 1e-5       # contribution <= Δ (1 + BOUND_RTOL) on arbitrary batches
ATTAIN_RTOL = 1e-9      # contribution <= Δ (1 + ATTAIN_RTOL) on the constructed worst cases
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# --------------------------------------------------------------------------- layer configurations

LINEAR_CONFIGS = {
    # name: (in_features, out_features, tokens or None for 2-D input, bias)
    "2d-bias": (6, 5, None, True),
    "2d-nobias": (6, 5, None, False),
    "T1-bias": (6, 5, (1,), True),
    "T1-nobias": (6, 5, (1,), False),
    "T3-bias": (6, 5, (3,), True),
    "T3-nobias": (6, 5, (3,), False),
    "T5-bias": (6, 5, (5,), True),
    "T5-nobias": (6, 5, (5,), False),
}

CONV_GEOMETRIES = {
    # name: (in_channels, out_channels, layer kwargs, (H, W))
    "plain": (3, 4, dict(kernel_size=3), (7, 7)),
    "stride": (3, 4, dict(kernel_size=3, stride=2), (9, 8)),
    "padding": (2, 3, dict(kernel_size=3, padding=2), (5, 6)),
    "dilation": (2, 3, dict(kernel_size=3, dilation=2, padding=1), (9, 9)),
    "groups": (4, 6, dict(kernel_size=3, padding=1, groups=2), (6, 5)),
    "depthwise": (3, 3, dict(kernel_size=2, groups=3), (5, 5)),
    "gaps": (2, 3, dict(kernel_size=2, stride=3), (8, 7)),     # stride > kernel: unread entries
    "same": (2, 3, dict(kernel_size=3, padding="same"), (5, 6)),
    "mixed": (4, 4, dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2), (9, 8)),
}

CONFIGS = (
    [("linear", name, None, bias) for name, (_, _, _, bias) in LINEAR_CONFIGS.items()]
    + [("conv", geo, norm, bias) for geo in CONV_GEOMETRIES for norm in ("l15", "l2") for bias in (True, False)]
)


def config_id(cfg):
    kind, name, norm, bias = cfg
    if kind == "linear":
        return f"linear-{name}"
    return f"conv-{name}-{norm}-{'bias' if bias else 'nobias'}"


def build(cfg, clip_fn, input_clip, grad_clip, device="cpu"):
    """(our layer, a plain torch layer with the same parameters, per-example input shape)."""
    kind, name, norm, bias = cfg
    if kind == "linear":
        fin, fout, tokens, _ = LINEAR_CONFIGS[name]
        ours = bnn.Linear(fin, fout, bias=bias, input_clip=input_clip, grad_clip=grad_clip, clip_fn=clip_fn,
                          gamma=GAMMA, device=device, dtype=DT)
        plain = nn.Linear(fin, fout, bias=bias, device=device, dtype=DT)
        example_shape = (tokens or ()) + (fin,)
    else:
        cin, cout, kw, hw = CONV_GEOMETRIES[name]
        ours = bnn.Conv2d(cin, cout, bias=bias, input_clip=input_clip, grad_clip=grad_clip, norm=norm,
                          clip_fn=clip_fn, gamma=GAMMA, device=device, dtype=DT, **kw)
        plain = nn.Conv2d(cin, cout, bias=bias, device=device, dtype=DT, **kw)
        example_shape = (cin,) + hw
    with torch.no_grad():
        plain.weight.copy_(ours.weight)
        if bias:
            plain.bias.copy_(ours.bias)
    return ours, plain, example_shape


def shapes(cfg):
    """(per-example input shape, per-example output shape)."""
    kind, name, _, _ = cfg
    if kind == "linear":
        fin, fout, tokens, _ = LINEAR_CONFIGS[name]
        return (tokens or ()) + (fin,), (tokens or ()) + (fout,)
    cin, cout, kw, hw = CONV_GEOMETRIES[name]
    y = F.conv2d(torch.zeros(1, cin, *hw), torch.zeros(cout, cin // kw.get("groups", 1),
                 *nn.modules.utils._pair(kw["kernel_size"])), stride=kw.get("stride", 1),
                 padding=kw.get("padding", 0), dilation=kw.get("dilation", 1), groups=kw.get("groups", 1))
    return (cin,) + hw, tuple(y.shape[1:])


def upstream_norm(cfg):
    return "l2" if cfg[0] == "linear" else cfg[2]


# --------------------------------------------------------------------------- independent maths

def my_l2(v):
    return v.reshape(v.shape[0], -1).pow(2).sum(1).sqrt()


def my_l15(g):
    return g.abs().sum(dim=(2, 3)).pow(2).sum(1).sqrt()


def per_example_contributions(plain, xt, gt):
    """Exact per-example ∇_{W,b} <plain(x̃_i), g̃_i>, flattened and concatenated: [B, P]."""
    params = {k: v.detach() for k, v in plain.named_parameters()}

    def inner(p, xi, gi):
        return (functional_call(plain, p, (xi.unsqueeze(0),)) * gi.unsqueeze(0)).sum()

    grads = vmap(grad(inner), in_dims=(None, 0, 0))(params, xt, gt)
    names = ["weight"] + (["bias"] if "bias" in grads else [])
    return torch.cat([grads[n].reshape(xt.shape[0], -1) for n in names], dim=1), grads


def brute_force_multiplicity(layer, hw):
    """(m, HW_out) from autograd: the gradient of Σ conv(x, ones) counts how often each entry is read."""
    kh, kw = layer.kernel_size
    x = torch.zeros(1, 1, *hw, dtype=DT, requires_grad=True)
    y = F.conv2d(x, torch.ones(1, 1, kh, kw, dtype=DT), stride=layer.stride, padding=layer.padding,
                 dilation=layer.dilation)
    y.sum().backward()
    return int(round(float(x.grad.max()))), y.shape[-2] * y.shape[-1]


def hand_sensitivity(layer, input_shape, norm):
    """DESIGN.md §2, with T and m found here (m by brute force)."""
    cx, cg = layer.input_clip, layer.grad_clip
    b = 1 if layer.bias is not None else 0
    if isinstance(layer, nn.Linear):
        T = math.prod(input_shape[1:-1])
        return cg * math.sqrt(cx ** 2 + T * b)
    if norm == "l15":
        return cg * math.sqrt(cx ** 2 + b)
    m, hw_out = brute_force_multiplicity(layer, tuple(input_shape[-2:]))
    return cg * math.sqrt(m * cx ** 2 + b * hw_out)


# --------------------------------------------------------------------------- batches

BATCH_KINDS = ("normal", "huge", "spike", "one_slice", "mixed")
B = 6


def make_batch(kind, example_shape, gen, slice_dim):
    """A batch [B, *example_shape] of the given kind.

    ``slice_dim``: the dim of ``example_shape`` holding channels (conv) or tokens (linear 3-D);
    None for 2-D linear input, where 'one_slice' puts all mass on one feature.
    """
    shape = (B,) + tuple(example_shape)
    normal = torch.randn(shape, generator=gen, dtype=DT)
    if kind == "normal":
        return normal
    if kind == "huge":
        return normal * 1e6
    if kind == "spike":
        out = normal * 1e-6
        flat = out.reshape(B, -1)
        idx = torch.randint(0, flat.shape[1], (B,), generator=gen)
        sign = torch.where(torch.rand(B, generator=gen, dtype=DT) < 0.5, -1.0, 1.0).to(DT)
        flat[torch.arange(B), idx] = 1e6 * sign
        return out
    if kind == "one_slice":
        out = torch.zeros(shape, dtype=DT)
        d = slice_dim if slice_dim is not None else len(example_shape) - 1
        n = example_shape[d]
        for i in range(B):
            j = int(torch.randint(0, n, (1,), generator=gen))
            src = normal[i].select(d, j)
            out[i].select(d, j).copy_(src * 3.0)
        return out
    if kind == "mixed":
        scales = torch.logspace(-6, 6, B, dtype=DT)
        perm = torch.randperm(B, generator=gen)
        return normal * scales[perm].reshape((B,) + (1,) * len(example_shape))
    raise ValueError(kind)


def avoid_bound(v, norms, bound):
    """Moves examples whose norm is within 1e-6 of the bound (where 'global' flips) away from it."""
    close = (norms / bound - 1).abs() < 1e-6
    if close.any():
        v = v * torch.where(close, 1.5, 1.0).to(DT).reshape((-1,) + (1,) * (v.dim() - 1))
    return v


# --------------------------------------------------------------------------- bound + tie to kernels

# Every x kind against normal g, normal x against every g kind, and the same kind on both sides.
KIND_PAIRS = sorted({(k, "normal") for k in BATCH_KINDS} | {("normal", k) for k in BATCH_KINDS}
                    | {(k, k) for k in BATCH_KINDS})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_kind,g_kind", KIND_PAIRS, ids=[f"x_{a}-g_{b}" for a, b in KIND_PAIRS])
@pytest.mark.parametrize("clip_fn", CLIP_FNS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_per_example_bound_and_kernel_sum(cfg, clip_fn, x_kind, g_kind, device):
    # A stable seed (str hashes are salted per process).
    seed = sum(ord(c) * 131 ** i for i, c in enumerate(f"{config_id(cfg)}|{clip_fn}|{x_kind}|{g_kind}")) % (2 ** 31)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    norm = upstream_norm(cfg)
    example_shape, out_shape = shapes(cfg)
    x = make_batch(x_kind, example_shape, gen, slice_dim=0 if (cfg[0] == "conv" or len(example_shape) > 1) else None)
    g = make_batch(g_kind, out_shape, gen, slice_dim=0 if (cfg[0] == "conv" or len(out_shape) > 1) else None)
    # Bounds at the median norm of normal examples, so that normal batches straddle them.
    cx = float(my_l2(torch.randn((64,) + example_shape, generator=gen, dtype=DT)).median())
    gn = torch.randn((64,) + out_shape, generator=gen, dtype=DT)
    cg = float((my_l15(gn) if norm == "l15" else my_l2(gn)).median())
    ours, plain, _ = build(cfg, clip_fn, cx, cg, device)
    x = avoid_bound(x, my_l2(x), cx).to(device)
    g = avoid_bound(g, my_l15(g) if norm == "l15" else my_l2(g), cg).to(device)

    # Our layer, one forward + backward, noise off.
    assert ours.noise_multiplier == 0
    ours.set_max_input_shape(x.shape[1:])
    out = ours(x)
    out.backward(g)
    sens = ours.sensitivity_for(tuple(x.shape))
    assert ours.sensitivity == sens
    assert sens == pytest.approx(ref.layer_sensitivity(ours, tuple(x.shape), input_clip=cx, grad_clip=cg,
                                                       norm=norm), rel=1e-12)

    # The independent per-example view.
    xt = ref.clip_input(x, cx, clip_fn, GAMMA)
    gt = ref.clip_upstream(g, cg, norm, clip_fn, GAMMA)
    assert bool((my_l2(xt) <= cx * (1 + 1e-12)).all())
    assert bool(((my_l15(gt) if norm == "l15" else my_l2(gt)) <= cg * (1 + 1e-12)).all())
    contrib, grads = per_example_contributions(plain, xt, gt)
    per_norm = contrib.norm(dim=1)
    assert bool(torch.isfinite(per_norm).all())
    assert bool((per_norm <= sens * (1 + BOUND_RTOL)).all()), \
        f"per-example norms {per_norm.tolist()} exceed the sensitivity {sens}"

    # The sum of the per-example contributions is what our kernels produced.
    atol = 1e-12 * sens * B
    assert torch.allclose(ours.weight.grad, grads["weight"].sum(0), rtol=1e-10, atol=atol), \
        (ours.weight.grad - grads["weight"].sum(0)).abs().max()
    if cfg[3]:
        assert torch.allclose(ours.bias.grad, grads["bias"].sum(0), rtol=1e-10, atol=atol), \
            (ours.bias.grad - grads["bias"].sum(0)).abs().max()
    else:
        assert ours.bias is None


# --------------------------------------------------------------------------- attainment

def scaled_to_attain(v, bound, clip_fn, norm_fn):
    """Rescales each example so that its *clipped* norm is (essentially) the bound under clip_fn."""
    target = {"clip": 3.0 * bound,                   # clipped down to exactly the bound
              "global": bound * (1 - 1e-9),          # just under: kept whole
              "normalize": 1e8 * bound}[clip_fn]     # C n / (n + γ) → C
    n = norm_fn(v)
    return v * (target / n).reshape((-1,) + (1,) * (v.dim() - 1))


def attain_check(ours, plain, x, g, norm, clip_fn, cx, cg):
    ours.set_max_input_shape(x.shape[1:])
    out = ours(x)
    out.backward(g)
    sens = ours.sensitivity
    assert sens == pytest.approx(ref.layer_sensitivity(ours, tuple(x.shape), input_clip=cx, grad_clip=cg,
                                                       norm=norm), rel=1e-12)
    xt = ref.clip_input(x, cx, clip_fn, GAMMA)
    gt = ref.clip_upstream(g, cg, norm, clip_fn, GAMMA)
    contrib, _ = per_example_contributions(plain, xt, gt)
    value = float(contrib.norm(dim=1)[0])
    # B = 1: the layer's own gradient is that one example's contribution.
    layer_grad = torch.cat([ours.weight.grad.reshape(-1)]
                           + ([ours.bias.grad.reshape(-1)] if ours.bias is not None else []))
    assert float(layer_grad.norm()) == pytest.approx(value, rel=1e-10)
    return value, sens


def _vec(gen, *shape):
    return torch.randn(shape, generator=gen, dtype=DT)


@pytest.mark.parametrize("clip_fn", CLIP_FNS)
@pytest.mark.parametrize("bias", [True, False])
def test_attain_linear_T1(clip_fn, bias):
    gen = torch.Generator().manual_seed(11)
    cx, cg = 1.7, 0.6
    ours = bnn.Linear(5, 4, bias=bias, input_clip=cx, grad_clip=cg, clip_fn=clip_fn, gamma=GAMMA, dtype=DT)
    plain = nn.Linear(5, 4, bias=bias, dtype=DT)
    plain.load_state_dict(ours.state_dict())
    x = scaled_to_attain(_vec(gen, 1, 5), cx, clip_fn, my_l2)
    g = scaled_to_attain(_vec(gen, 1, 4), cg, clip_fn, my_l2)
    value, sens = attain_check(ours, plain, x, g, "l2", clip_fn, cx, cg)
    assert 0.99 * sens <= value <= sens * (1 + ATTAIN_RTOL)


@pytest.mark.parametrize("clip_fn", CLIP_FNS)
def test_attain_linear_tokens_bias(clip_fn):
    """T = 4: all x_t equal and all g_t equal (one direction) attain C_g √(C_x² + T)."""
    gen = torch.Generator().manual_seed(12)
    cx, cg, T = 1.3, 2.1, 4
    ours = bnn.Linear(5, 3, input_clip=cx, grad_clip=cg, clip_fn=clip_fn, gamma=GAMMA, dtype=DT)
    plain = nn.Linear(5, 3, dtype=DT)
    plain.load_state_dict(ours.state_dict())
    x = scaled_to_attain(_vec(gen, 1, 1, 5).expand(1, T, 5).clone(), cx, clip_fn, my_l2)
    g = scaled_to_attain(_vec(gen, 1, 1, 3).expand(1, T, 3).clone(), cg, clip_fn, my_l2)
    value, sens = attain_check(ours, plain, x, g, "l2", clip_fn, cx, cg)
    assert sens == pytest.approx(cg * math.sqrt(cx ** 2 + T))
    assert 0.99 * sens <= value <= sens * (1 + ATTAIN_RTOL)


@pytest.mark.parametrize("clip_fn", CLIP_FNS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("groups", [1, 2])
def test_attain_conv_l15_full_kernel(clip_fn, bias, groups):
    """Kernel covering the input (1×1 output); with groups, the mass sits in one group."""
    gen = torch.Generator().manual_seed(13)
    cx, cg, cin, cout, k = 0.8, 1.9, 4, 6, 3
    ours = bnn.Conv2d(cin, cout, k, groups=groups, bias=bias, input_clip=cx, grad_clip=cg, norm="l15",
                      clip_fn=clip_fn, gamma=GAMMA, dtype=DT)
    plain = nn.Conv2d(cin, cout, k, groups=groups, bias=bias, dtype=DT)
    plain.load_state_dict(ours.state_dict())
    x = _vec(gen, 1, cin, k, k)
    g = _vec(gen, 1, cout, 1, 1)
    if groups > 1:  # only group 0's input channels and output channels
        x[:, cin // groups:] = 0
        g[:, cout // groups:] = 0
    x = scaled_to_attain(x, cx, clip_fn, my_l2)
    g = scaled_to_attain(g, cg, clip_fn, my_l15)
    value, sens = attain_check(ours, plain, x, g, "l15", clip_fn, cx, cg)
    assert 0.99 * sens <= value <= sens * (1 + ATTAIN_RTOL)


@pytest.mark.parametrize("clip_fn", CLIP_FNS)
@pytest.mark.parametrize("bias", [True, False])
def test_attain_conv_l2_1x1(clip_fn, bias):
    """1×1 kernel on a 1×1 input: m = 1, HW_out = 1."""
    gen = torch.Generator().manual_seed(14)
    cx, cg = 2.2, 0.7
    ours = bnn.Conv2d(3, 5, 1, bias=bias, input_clip=cx, grad_clip=cg, norm="l2", clip_fn=clip_fn, gamma=GAMMA,
                      dtype=DT)
    plain = nn.Conv2d(3, 5, 1, bias=bias, dtype=DT)
    plain.load_state_dict(ours.state_dict())
    x = scaled_to_attain(_vec(gen, 1, 3, 1, 1), cx, clip_fn, my_l2)
    g = scaled_to_attain(_vec(gen, 1, 5, 1, 1), cg, clip_fn, my_l2)
    value, sens = attain_check(ours, plain, x, g, "l2", clip_fn, cx, cg)
    assert sens == pytest.approx(cg * math.sqrt(cx ** 2 + bias))
    assert 0.99 * sens <= value <= sens * (1 + ATTAIN_RTOL)


@pytest.mark.parametrize("clip_fn", CLIP_FNS)
@pytest.mark.parametrize("bias", [True, False])
def test_attain_conv_l2_overlapping(clip_fn, bias):
    """m = 4 (2×2 kernel, stride 1, no padding) on a constant n×n input.

    Every patch is the same vector, so the im2col matrix is rank one; with g constant over the
    output positions (one channel direction), ‖∇W‖² = C_g² HW_out·K·c² where c² = C_x²/(C_in n²),
    i.e. C_g² C_x² m (n-1)²/n², and ‖∇b‖² = C_g² HW_out exactly. n = 128 gives (127/128) > 0.99
    of the bound even without bias.
    """
    gen = torch.Generator().manual_seed(15)
    cx, cg, cin, cout, n = 1.1, 0.9, 2, 3, 128
    ours = bnn.Conv2d(cin, cout, 2, bias=bias, input_clip=cx, grad_clip=cg, norm="l2", clip_fn=clip_fn,
                      gamma=GAMMA, dtype=DT)
    plain = nn.Conv2d(cin, cout, 2, bias=bias, dtype=DT)
    plain.load_state_dict(ours.state_dict())
    x = scaled_to_attain(torch.ones(1, cin, n, n, dtype=DT), cx, clip_fn, my_l2)
    g = scaled_to_attain(_vec(gen, 1, cout, 1, 1).expand(1, cout, n - 1, n - 1).clone(), cg, clip_fn, my_l2)
    value, sens = attain_check(ours, plain, x, g, "l2", clip_fn, cx, cg)
    assert sens == pytest.approx(cg * math.sqrt(4 * cx ** 2 + bias * (n - 1) ** 2))
    assert 0.99 * sens <= value <= sens * (1 + ATTAIN_RTOL)


# --------------------------------------------------------------------------- the sensitivity property

SHAPE_CASES = (
    [("linear", name, (3,) + (tok or ()) + (LINEAR_CONFIGS[name][0],)) for name, (_, _, tok, _) in
     LINEAR_CONFIGS.items()]
    + [("linear", "2d-bias", (2, 2, 3, 6)), ("linear", "2d-nobias", (2, 4, 1, 6))]  # [B, *, in], several dims
    + [("conv", geo, (2, CONV_GEOMETRIES[geo][0]) + hw) for geo in CONV_GEOMETRIES
       for hw in (CONV_GEOMETRIES[geo][3], (11, 10), (17, 13))]
)


@pytest.mark.parametrize("norm", ["l15", "l2"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind,name,shape", SHAPE_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple)
                         else str(v))
def test_sensitivity_property(kind, name, shape, bias, norm):
    if kind == "linear" and norm == "l2":
        pytest.skip("Linear has no norm option")
    cx, cg = 1.3, 0.45
    if kind == "linear":
        fin, fout, _, _ = LINEAR_CONFIGS[name]
        layer = bnn.Linear(fin, fout, bias=bias, input_clip=cx, grad_clip=cg, dtype=DT)
    else:
        cin, cout, kw, _ = CONV_GEOMETRIES[name]
        layer = bnn.Conv2d(cin, cout, bias=bias, input_clip=cx, grad_clip=cg, norm=norm, dtype=DT, **kw)
    layer.set_max_input_shape(shape[1:])
    sens = layer.sensitivity
    assert sens == layer.sensitivity_for(shape)
    assert sens == pytest.approx(hand_sensitivity(layer, shape, norm), rel=1e-12)
    assert sens == pytest.approx(ref.layer_sensitivity(layer, shape, input_clip=cx, grad_clip=cg, norm=norm),
                                 rel=1e-12)
