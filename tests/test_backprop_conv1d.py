"""Backpropagation clipping for ``nn.Conv1d`` (issue 26): the Conv2d machinery at height 1.

Each example's contribution — the float64 per-example gradient (``torch.func``) of the *clipped*
input and *clipped* upstream gradient (:mod:`bpclip_fast.reference`, float64) — is within the
layer's ``sensitivity_for``, which equals the independently counted
``reference.layer_sensitivity``; the layer's gradient is the sum of the contributions; the bound is
attained where the proof says (so a Δ set too high would fail here too); norms l15 and l2 over
the geometries of a Conv1d (stride, 'same' with odd and even kernels, 'valid', dilation, groups,
no bias, a batch of one); end to end through ``PrivacyEngine.make_private`` against the hook-based
reference, with the step boundary's checks (the parameter's ``.grad`` is the layer's own release);
and under ``torch.compile``.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine, reference
from bpclip_fast import nn as bnn
from bpclip_fast.nn import convert_model

import exact_oracle as eo

F64 = torch.float64
EPS = torch.finfo(F64).eps

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

GEOMETRIES = {
    "stride2": dict(kernel_size=3, stride=2, padding=1),
    "same_odd": dict(kernel_size=3, padding="same"),
    "same_even": dict(kernel_size=4, padding="same"),  # the odd total: one explicit zero on the right
    "valid": dict(kernel_size=3, padding="valid"),
    "dilation2": dict(kernel_size=3, dilation=2, padding=2),
    "groups2": dict(kernel_size=3, padding=1, groups=2),
    "no_bias": dict(kernel_size=2, stride=3, bias=False),
}


def plain(geometry, seed=0):
    torch.manual_seed(seed)
    return nn.Conv1d(4, 6, dtype=F64, **geometry)


def inner(out, g):
    return (out * g).sum()


def gamma(k):
    return k * EPS / (1 - k * EPS)


def contributions(layer, xt, gt):
    """Each example's gradient of ``<layer(x̃_i), g̃_i>`` in float64, as ``[B, P]``."""
    grads = eo.per_example_grads(layer, xt, gt, loss_fn=inner)
    return torch.cat([grads[n].flatten(1) for n in ("weight", "bias") if n in grads], 1)


def clipped_grad(clipped):
    parts = [clipped.weight.grad] + ([clipped.bias.grad] if clipped.bias is not None else [])
    return torch.cat([p.reshape(-1) for p in parts])


def release_tolerance(xt, gt, n_out, want):
    """‖release − Σ contributions‖ in float64: each gradient entry sums B·L_out products in float64
    (γ_{B·L_out + 2} of the sum of their absolute values, whose Frobenius norm is at most
    S = Σ_i Σ_t ‖g̃_it‖·‖[P_t(x̃_i); 1]‖ <= Σ_i Σ_t ‖g̃_it‖ √(‖x̃_i‖² + 1): a patch holds distinct entries);
    the kernels' clipped rows differ from the reference's by their factors' relative error (a norm of
    N entries summed in double, (N + 4)·eps, and a few roundings), on both factors of a bilinear term."""
    b = xt.shape[0]
    s = float((gt.norm(dim=1).sum(-1) * (xt.flatten(1).square().sum(1) + 1).sqrt()).sum())
    n = max(xt[0].numel(), gt[0].numel())
    dx = 3 * (n + 4) * EPS + 4 * EPS
    return (gamma(b * n_out + 2) + 2 * dx + dx * dx) * s + 4 * EPS * float(want.norm())


@pytest.mark.parametrize("batch", [4, 1])
@pytest.mark.parametrize("norm", ["l15", "l2"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_contributions_are_within_the_sensitivity_and_the_gradient_is_their_sum(name, norm, batch):
    layer = plain(GEOMETRIES[name])
    gen = torch.Generator().manual_seed(3)
    length = 9
    x = torch.randn(batch, 4, length, generator=gen, dtype=F64) * torch.tensor([0.3, 3.0, 1.0, 10.0][:batch],
                                                                               dtype=F64).view(-1, 1, 1)
    with torch.no_grad():
        out_shape = layer(x).shape
    g = torch.randn(out_shape, generator=gen, dtype=F64) * torch.tensor([5.0, 0.2, 2.0, 0.7][:batch],
                                                                        dtype=F64).view(-1, 1, 1)
    gnorm = reference.l2_norm if norm == "l2" else reference.l15_norm
    xn, gn = reference.l2_norm(x), gnorm(g)
    # some examples clipped and some not (between the middle two of 4: no norm at its bound, where the
    # clipping map has a kink and the input gradient's one-sided derivatives differ); a lone example's clipped
    cx, cg = (float(v.sort().values[1:3].mean()) if batch > 1 else 0.5 * float(v[0]) for v in (xn, gn))
    clipped = convert_model(copy.deepcopy(layer), clipping="backprop", input_clip=cx, grad_clip=cg, norm=norm)
    assert type(clipped) is bnn.Conv1d and clipped.norm == norm and not clipped.exact
    xin = x.clone().requires_grad_(True)
    out = clipped(xin)
    torch.testing.assert_close(out, layer(reference.clip_input(x, cx)), rtol=1e-12, atol=1e-12)
    inner(out, g).backward()

    sens = clipped.sensitivity_for(tuple(x.shape))
    assert sens == pytest.approx(reference.layer_sensitivity(layer, tuple(x.shape), input_clip=cx, grad_clip=cg,
                                                             norm=norm), rel=1e-12)
    xt, gt = reference.clip_input(x, cx), reference.clip_upstream(g, cg, norm)
    assert (reference.l2_norm(xt) < xn).any() and (gnorm(gt) < gn).any()
    contrib = contributions(layer, xt, gt)
    per = contrib.norm(dim=1)
    # float64's own evaluation of the norms: a few roundings per entry
    assert bool((per <= sens * (1 + 64 * EPS)).all()), f"{per.tolist()} > Δ = {sens}"
    want = contrib.sum(0)
    err = float((clipped_grad(clipped) - want).norm())
    tol = release_tolerance(xt, gt, out_shape[-1], want)
    assert err <= tol, f"‖gradient − Σ contributions‖ = {err:.3g} > {tol:.3g}"
    # the input gradient is the one of the clipped upstream gradient through the clipped input's map
    xr = x.clone().requires_grad_(True)
    inner(layer(reference.clip_input(xr, cx)), gt).backward()
    torch.testing.assert_close(xin.grad, xr.grad, rtol=1e-10, atol=1e-12 * float(xr.grad.abs().max()))


@pytest.mark.parametrize("bias", [True, False])
def test_l15_bound_is_attained_when_the_kernel_covers_the_input(bias):
    """One output position: row o of [∇W, ∇b] is g̃_o [x̃; 1], of norm |g̃_o| √(C_x² + 1); summed,
    C_g √(C_x² + [bias]) exactly (for x and g beyond their bounds)."""
    layer = nn.Conv1d(3, 5, 7, bias=bias, dtype=F64)
    gen = torch.Generator().manual_seed(1)
    x = 10 * torch.randn(2, 3, 7, generator=gen, dtype=F64)
    g = 10 * torch.randn(2, 5, 1, generator=gen, dtype=F64)
    cx, cg = 0.7, 1.3
    clipped = convert_model(copy.deepcopy(layer), clipping="backprop", input_clip=cx, grad_clip=cg)
    sens = clipped.sensitivity_for((2, 3, 7))
    assert sens == pytest.approx(cg * math.sqrt(cx ** 2 + bias), rel=1e-15)
    per = contributions(layer, reference.clip_input(x, cx), reference.clip_upstream(g, cg, "l15")).norm(dim=1)
    torch.testing.assert_close(per, torch.full_like(per, sens), rtol=16 * EPS, atol=0)


def test_l2_bound_is_attained_by_equal_positions():
    """Kernel 1, stride 1: m = 1, L_out = L; x_t = u and g_t = v at every t give ‖∇W‖ = L|v||u| =
    C_g C_x and ‖∇b‖ = L|v| = √L C_g: Δ = C_g √(C_x² + L) exactly."""
    length = 6
    layer = nn.Conv1d(3, 2, 1, dtype=F64)
    u = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    v = torch.tensor([3.0, 1.0], dtype=F64)
    x = (4 * u).view(1, 3, 1).expand(1, 3, length).contiguous()
    g = (4 * v).view(1, 2, 1).expand(1, 2, length).contiguous()
    cx, cg = 0.9, 0.4
    clipped = convert_model(copy.deepcopy(layer), clipping="backprop", input_clip=cx, grad_clip=cg, norm="l2")
    sens = clipped.sensitivity_for((1, 3, length))
    assert sens == pytest.approx(cg * math.sqrt(cx ** 2 + length), rel=1e-15)
    per = contributions(layer, reference.clip_input(x, cx), reference.clip_upstream(g, cg, "l2")).norm(dim=1)
    torch.testing.assert_close(per, torch.full_like(per, sens), rtol=16 * EPS, atol=0)


def test_l2_sensitivity_is_shape_dependent_and_fixed_by_the_largest_shape():
    layer = bnn.Conv1d(4, 6, 3, padding="same", input_clip=1.0, grad_clip=1.0, norm="l2")
    with pytest.raises(RuntimeError, match="Δ grows with the input's length"):
        layer.sensitivity
    layer.set_max_input_shape((4, 16))
    assert layer.sensitivity == pytest.approx(math.sqrt(3 + 16))
    assert bnn.Conv1d(4, 6, 3, input_clip=1.0, grad_clip=2.0).sensitivity == pytest.approx(2 * math.sqrt(2))


def test_other_padding_modes_stay_refused_under_backprop():
    with pytest.raises(ValueError, match="padding_mode='reflect' is not supported"):
        bnn.Conv1d(2, 2, 3, padding=1, padding_mode="reflect", input_clip=1.0, grad_clip=1.0)
    with pytest.raises(ValueError, match=r"0 \(Conv1d\): padding_mode='circular'"):
        convert_model(nn.Sequential(nn.Conv1d(2, 2, 3, padding=1, padding_mode="circular")), clipping="backprop",
                      input_clip=1.0, grad_clip=1.0)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv1d(3, 4, 4, padding="same"), nn.Tanh(), nn.Conv1d(4, 4, 3, stride=2, groups=2),
                         nn.Flatten(), nn.Linear(4 * 4, 2)).to(F64)


SIGMA = 1e-9  # make_private takes a positive σ; the noise, std σΔ per entry, is held to 10 std below


@pytest.mark.parametrize("norm", ["l15", "l2"])
def test_make_private_step_is_the_reference_backprop_clipping(norm):
    """End to end: the engine's gradients are the hook-based float64 reference's
    (bpclip_fast.reference.attach) plus the step's draw, and the step passes the boundary's checks
    (each parameter's .grad is its layer's own release, the draw added to it)."""
    length = 9
    model = _model()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(8, 3, length, generator=gen, dtype=F64), torch.randint(0, 2, (8,), generator=gen))
    cx, cg = 0.5, 0.05
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=8), noise_multiplier=SIGMA,
            input_clip=cx, grad_clip=cg, conv_norm=norm, loss_reduction="sum",
            max_input_shape=(3, length) if norm == "l2" else None, noise_seed=3)
    fused = [m for m in model.modules() if type(m) is bnn.Conv1d]
    assert len(fused) == 2 and all(m.norm == norm and not m.exact for m in fused)
    x, y = next(iter(loader))
    assert x.shape[0] > 1
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    deltas = {n: m.sensitivity for n, m in model.named_modules() if hasattr(m, "sensitivity_for")}
    opt.step()  # refused if a .grad were not its layer's own release

    reference.attach(ref, input_clip=cx, grad_clip=cg, norm=norm)
    nn.functional.cross_entropy(ref(x), y, reduction="sum").backward()
    for n, p in ref.named_parameters():
        delta = deltas[n.rsplit(".", 1)[0]]
        # float64 both ways through a 3-layer backward: a few hundred roundings per entry, relative to the
        # sum of 8 clipped contributions (each <= Δ); the noise: 10 std (fixed seed; ~1e-23 per entry)
        tol = 1000 * EPS * 8 * delta + 10 * SIGMA * delta
        torch.testing.assert_close(got[n], p.grad, rtol=0, atol=tol, msg=n)


def test_compiled_backprop_is_the_eager_layer():
    """Under torch.compile (aot_eager: the custom ops' fake kernels and autograd) the backprop op gets the
    parameter and maps the release back: gradients equal eager's in float64 (the same kernels)."""
    torch._dynamo.reset()
    layer = plain(GEOMETRIES["same_even"])
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 9, generator=gen, dtype=F64)
    g = torch.randn(3, 6, 9, generator=gen, dtype=F64)
    eager = convert_model(copy.deepcopy(layer), clipping="backprop", input_clip=1.0, grad_clip=0.5, norm="l2")
    comp_layer = convert_model(copy.deepcopy(layer), clipping="backprop", input_clip=1.0, grad_clip=0.5, norm="l2")
    inner(eager(x), g).backward()
    seen = []  # the shapes the compiled op takes Δ from: the layer's own input, not the padded kernel view
    own = comp_layer._bp_noise_sensitivity
    comp_layer._bp_noise_sensitivity = lambda t: seen.append(tuple(t.shape)) or own(t)
    compiled = torch.compile(comp_layer, backend="aot_eager", fullgraph=True)
    inner(compiled(x), g).backward()
    assert seen and set(seen) == {tuple(x.shape)}, seen
    assert comp_layer.weight.grad.shape == comp_layer.weight.shape
    torch.testing.assert_close(comp_layer.weight.grad, eager.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(comp_layer.bias.grad, eager.bias.grad, rtol=0, atol=0)
    torch._dynamo.reset()


def test_audit_finds_every_conv1d_contribution_within_its_bound():
    """bpclip_fast.audit.sensitivity on the real engine's Conv1d layers (removal in float64, the
    adversarial search steering by the layer's own l15 norm of a [1, O, L] upstream gradient)."""
    from bpclip_fast.audit import sensitivity

    model = _model()
    gen = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(12, 3, 9, generator=gen, dtype=F64), torch.randint(0, 2, (12,), generator=gen))
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          data_loader=DataLoader(data, batch_size=6), noise_multiplier=1.0,
                                          input_clip=0.5, grad_clip=0.05, loss_reduction="sum")
    report = sensitivity(model, data.tensors, engine=engine, adversarial_steps=3, noise_draws=0)
    rows = {r.name: r for r in report.rows}
    assert {"0", "2"} <= set(rows)  # the two Conv1d layers
    assert all(r.status == "ok" and not r.failed for r in report.rows), report.rows
