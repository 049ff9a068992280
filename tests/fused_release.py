"""The release check shared by the fused-layer test files (tests/test_fused_conv1d.py,
test_fused_conv3d.py): a layer of a registered type followed by a PositionalEmbedding, the loss
``<out, G>`` so that both layers' upstream gradient is ``G`` exactly in every dtype, and the
zero-noise release of ``convert_model`` against ``Σ_i clip(G_i, C)`` with ``G_i`` from each example
run alone through a float64 copy of the torch modules. ``kinds``: name -> (factory of the torch
layer, per-example input shape); ``scale(layer, x_i, g_i)``: an upper bound on the Frobenius norm
of the absolute products that make example i's gradient of the layer (its own derivation)."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from bpclip_fast import modules, registry
from bpclip_fast import nn as bnn

F64 = torch.float64
U32 = 2.0 ** -24  # unit roundoff of the fp32 accumulation every dtype's sums and norms run in
R = 4  # roundings to a low-precision dtype per example (as tests/test_registry_harness.py derives)


def layer_of(kinds, kind):
    torch.manual_seed(0)
    layer = kinds[kind][0]().to(F64)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
    return layer


def model_of(kinds, kind, dtype):
    layer = layer_of(kinds, kind)
    with torch.no_grad():
        out = layer(torch.zeros(1, *kinds[kind][1], dtype=F64))
    pos = modules.PositionalEmbedding(*out.shape[1:], dtype=F64)
    with torch.no_grad():
        pos.weight.copy_(torch.randn(pos.weight.shape, generator=torch.Generator().manual_seed(2), dtype=F64))
    return nn.Sequential(layer, pos).to(dtype)


def data_of(kinds, kind, n, dtype, out_shape, contiguous=True):
    """(x, G) rounded to ``dtype``; example i's G scaled by 2^(i−2) so that the norms spread. A
    non-contiguous x is a transposed view of the same values."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, *kinds[kind][1], generator=gen, dtype=F64).to(dtype)
    g = torch.randn(n, *out_shape, generator=gen, dtype=F64)
    g = (g * torch.tensor([2.0 ** (i - 2) for i in range(n)], dtype=F64).reshape(-1, *[1] * len(out_shape)))
    if not contiguous:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
        assert not x.is_contiguous()
    return x, g.to(dtype)


def truth(model, x, g):
    """Each example alone through a float64 copy of the torch modules: ``{name: [B, *shape]}``."""
    ref = copy.deepcopy(model).double()
    grads = {}
    for i in range(x.shape[0]):
        ref.zero_grad(set_to_none=True)
        (ref(x[i:i + 1].double()) * g[i:i + 1].double()).sum().backward()
        for name, p in ref.named_parameters():
            grads.setdefault(name, []).append(p.grad.clone())
    return {k: torch.stack(v) for k, v in grads.items()}


def units_of(names, mode):
    return [names] if mode == "flat" else [[n for n in names if n.startswith("0.")], ["1.weight"]]


def check(kinds, scale, kind, mode, dtype, n, contiguous=True):
    model = model_of(kinds, kind, dtype)
    with torch.no_grad():
        out_shape = tuple(model[0](torch.zeros(1, *kinds[kind][1], dtype=dtype)).shape[1:])
    x, g = data_of(kinds, kind, n, dtype, out_shape, contiguous)
    grads = truth(model, x, g)
    units = units_of(list(grads), mode)
    norms = [torch.sqrt(sum(grads[k].flatten(1).square().sum(1) for k in u)) for u in units]
    # thresholds between the two smallest norms: the smallest example unclipped, the others clipped
    # (a lone example clipped to half its norm)
    thresholds = [math.sqrt(float(v.sort().values[0] * v.sort().values[1])) if n > 1 else 0.5 * float(v[0])
                  for v in norms]
    want = {}
    for unit, c, nrm in zip(units, thresholds, norms):
        factor = torch.clamp(c / nrm, max=1.0)
        assert (factor < 1).any() and ((factor == 1).any() or n == 1)
        for k in unit:
            want[k] = (grads[k] * factor.reshape(-1, *[1] * (grads[k].dim() - 1))).sum(0)

    ours = bnn.convert_model(copy.deepcopy(model), clipping=mode,
                             max_grad_norm=thresholds if mode == "per_layer" else thresholds[0])
    assert type(ours[0]) is registry.layer_type(model[0]).clipped_type and not registry.is_generic(ours[0])
    assert all(getattr(m, "noise_multiplier", 0.0) == 0 for m in ours.modules())
    (ours(x) * g).sum().backward()
    got = dict(ours.named_parameters())
    assert set(want) == {k for k, p in got.items() if p.grad is not None}
    for k in want:
        assert got[k].grad.dtype == dtype and got[k].grad.shape == got[k].shape and got[k].grad.is_contiguous()
    # Released Σ_i RZ(c_i·Ĝ_i), rounded once to the dtype. Example i errs by its gradient's
    # dot-product error plus its factor's (≤ the bound's excess over the norm), each ≤ K·u32 relative
    # to the scale s_i (K: the terms summed along the computation: the input, the output positions,
    # the parameters' squares, the batch), twice (norm root, factor division and product), plus R
    # roundings of a low-precision dtype; the final rounding is u·‖release‖.
    u = 2.0 ** -53 if dtype == F64 else torch.finfo(dtype).eps / 2
    k_terms = x[0].numel() + math.prod(out_shape) * 2 + sum(p.numel() for p in model.parameters()) + n
    s = sum(scale(model[0], x[i], g[i]) for i in range(n))
    tol = s * (2 * k_terms * U32 + R * u) + u * math.sqrt(sum(float(v.square().sum()) for v in want.values()))
    err = math.sqrt(sum(float((got[k].grad.double() - want[k]).square().sum()) for k in want))
    assert err <= tol, f"{kind} {mode} {dtype}: ‖release − truth‖ = {err:.3g} > {tol:.3g}"
    return err, tol


def check_forward(kinds, kind):
    """The clipped layer's output and input gradient (from the unclipped upstream gradient) are torch's
    own module's, in float64; returns the two outputs (torch's, ours)."""
    layer = layer_of(kinds, kind)
    x = torch.randn(3, *kinds[kind][1], dtype=F64, generator=torch.Generator().manual_seed(4))
    ours = bnn.convert_model(copy.deepcopy(layer), clipping="per_layer", max_grad_norm=0.1)
    assert type(ours) is registry.layer_type(layer).clipped_type
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [layer(xs[0]), ours(xs[1])]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    g = torch.randn(outs[0].shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    for o in outs:
        (o * g).sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-12, atol=1e-12)
    return outs
