"""The fused exact path for ``nn.Conv3d`` (issue 26).

Before, every Conv3d was trained by the generic exact path (a vectorised backward per chunk of
examples); now a Conv3d of one group is a registered layer type (bpclip_fast/layers/conv3d.py) that
runs the fused Linear kernels on its patches ``[B, D'·H'·W', C·kd·kh·kw]``, the weight viewed as
``[O, d]`` and the release viewed back in the parameter's shape (bpclip_fast.exact.FLATTENED).

* Exactness: a zero-noise release (never armed) equals ``Σ_i clip(G_i, C)`` with ``G_i`` computed by
  running each example alone through a float64 copy of torch's Conv3d, in flat and per_layer,
  float32 and bfloat16 parameters, stride 2, padding 'same' (odd and even kernels: the even one's
  extra zero on the right), 'valid', dilation 2, reflect padding, no bias, a batch of one and a
  non-contiguous input. The model is ``layer -> PositionalEmbedding`` with the loss ``<out, G>``, so
  both layers' upstream gradient is ``G`` exactly in every dtype and flat clips two layers' norms
  together (as tests/test_fused_conv1d.py).
* The forward and the input gradient (from the unclipped upstream gradient) are torch's, float64.
* ``groups > 1`` stays on the generic exact path; backprop clipping is refused.
* A small 3-D CNN through ``PrivacyEngine.make_private``: the Conv3d is fused, no generic unit is
  left, and the step's gradients equal per-example clipping in float64; and under torch.compile.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine, modules, registry
from bpclip_fast import nn as bnn

F64 = torch.float64
U32 = 2.0 ** -24  # unit roundoff of the fp32 accumulation every dtype's sums and norms run in
R = 4  # roundings to a low-precision dtype per example (as tests/test_registry_harness.py derives)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# kind -> (torch module in float64, per-example input shape)
KINDS = {
    "stride2": (lambda: nn.Conv3d(2, 3, 3, stride=2, padding=1), (2, 5, 6, 5)),
    "same-odd-kernel": (lambda: nn.Conv3d(2, 3, 3, padding="same"), (2, 4, 3, 5)),
    "same-even-kernel": (lambda: nn.Conv3d(2, 3, (2, 4, 3), padding="same"), (2, 4, 5, 3)),  # extra zero right
    "valid": (lambda: nn.Conv3d(2, 2, (1, 2, 3), padding="valid"), (2, 3, 4, 5)),
    "dilation2": (lambda: nn.Conv3d(2, 3, 2, dilation=(2, 1, 2), padding=(1, 0, 2), stride=(1, 2, 1)), (2, 4, 5, 3)),
    "reflect": (lambda: nn.Conv3d(2, 3, 3, padding=1, padding_mode="reflect"), (2, 3, 4, 3)),
    "no-bias": (lambda: nn.Conv3d(2, 3, 2, stride=(2, 1, 3), bias=False), (2, 4, 3, 7)),
}


def _layer(kind):
    torch.manual_seed(0)
    layer = KINDS[kind][0]().to(F64)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
    return layer


def _model(kind, dtype):
    layer = _layer(kind)
    with torch.no_grad():
        out = layer(torch.zeros(1, *KINDS[kind][1], dtype=F64))
    pos = modules.PositionalEmbedding(*out.shape[1:], dtype=F64)
    with torch.no_grad():
        pos.weight.copy_(torch.randn(pos.weight.shape, generator=torch.Generator().manual_seed(2), dtype=F64))
    return nn.Sequential(layer, pos).to(dtype)


def _data(kind, n, dtype, out_shape, contiguous=True):
    """(x, G) rounded to ``dtype``; example i's G scaled by 2^(i−2) so that the norms spread. A
    non-contiguous x is a transposed view of the same values."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, *KINDS[kind][1], generator=gen, dtype=F64).to(dtype)
    g = torch.randn(n, *out_shape, generator=gen, dtype=F64)
    g = (g * torch.tensor([2.0 ** (i - 2) for i in range(n)], dtype=F64).reshape(-1, *[1] * len(out_shape)))
    if not contiguous:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
        assert not x.is_contiguous()
    return x, g.to(dtype)


def _truth(model, x, g):
    """Each example alone through a float64 copy of the torch modules: ``{name: [B, *shape]}``."""
    ref = copy.deepcopy(model).double()
    grads = {}
    for i in range(x.shape[0]):
        ref.zero_grad(set_to_none=True)
        (ref(x[i:i + 1].double()) * g[i:i + 1].double()).sum().backward()
        for name, p in ref.named_parameters():
            grads.setdefault(name, []).append(p.grad.clone())
    return {k: torch.stack(v) for k, v in grads.items()}


def _units(names, mode):
    return [names] if mode == "flat" else [[n for n in names if n.startswith("0.")], ["1.weight"]]


def _scale(layer, xi, gi):
    """An upper bound on the Frobenius norm of the absolute products that make example i's gradient
    of the layer: each weight entry sums ``|g_{o,t}|·|patch entry|`` over positions t; for one kernel
    offset the positions read distinct entries of the padded input, so over the ``taps`` offsets the
    patches' norm is at most ``√taps·‖pad(x_i)‖`` (zero padding: ``‖x_i‖``), and the weight's is
    ``√taps·‖g_i‖·‖pad(x_i)‖``; the bias sums ``|g_{o,t}|`` over ``rows`` positions:
    ``√rows·‖g_i‖``."""
    gn = float(gi.double().norm())
    xn = registry.layer_type(layer).multiplier_norm(layer, xi.unsqueeze(0))
    s = math.sqrt(layer.weight[0, 0].numel()) * gn * xn
    if layer.bias is not None:
        s += math.sqrt(gi.numel() // layer.weight.shape[0]) * gn
    return s + gn  # + the PositionalEmbedding's own gradient, g_i itself


def _check(kind, mode, dtype, n, contiguous=True):
    model = _model(kind, dtype)
    with torch.no_grad():
        out_shape = tuple(model[0](torch.zeros(1, *KINDS[kind][1], dtype=dtype)).shape[1:])
    x, g = _data(kind, n, dtype, out_shape, contiguous)
    grads = _truth(model, x, g)
    units = _units(list(grads), mode)
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
    assert type(ours[0]) is bnn.Conv3d and not registry.is_generic(ours[0])
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
    s = sum(_scale(model[0], x[i], g[i]) for i in range(n))
    tol = s * (2 * k_terms * U32 + R * u) + u * math.sqrt(sum(float(v.square().sum()) for v in want.values()))
    err = math.sqrt(sum(float((got[k].grad.double() - want[k]).square().sum()) for k in want))
    assert err <= tol, f"{kind} {mode} {dtype}: ‖release − truth‖ = {err:.3g} > {tol:.3g}"
    return err, tol


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_release_equals_the_clipped_sum_of_examples_run_alone_in_float64(kind, mode, dtype):
    _check(kind, mode, dtype, n=5)


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_float64_release_is_per_example_clipping(mode):
    _check("dilation2", mode, F64, n=4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_batch_of_one(kind):
    _check(kind, "flat", torch.float32, n=1)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_non_contiguous_input(kind):
    _check(kind, "per_layer", torch.float32, n=4, contiguous=False)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_clipped_layer_computes_the_torch_forward_and_input_gradient(kind):
    """Output and input gradient (from the unclipped upstream gradient) as torch's own module, float64."""
    layer = _layer(kind)
    x = torch.randn(3, *KINDS[kind][1], dtype=F64, generator=torch.Generator().manual_seed(4))
    ours = bnn.convert_model(copy.deepcopy(layer), clipping="per_layer", max_grad_norm=0.1)
    assert type(ours) is bnn.Conv3d
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [layer(xs[0]), ours(xs[1])]
    assert outs[1].shape == outs[0].shape and outs[1].is_contiguous()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    g = torch.randn(outs[0].shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    for o in outs:
        (o * g).sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-12, atol=1e-12)


def test_an_empty_batch_runs_as_torch():
    """B = 0 (a removal of the only example): torch's Conv3d returns an empty output, and so does ours."""
    layer = _layer("stride2")
    ours = bnn.convert_model(copy.deepcopy(layer), clipping="flat", max_grad_norm=0.1)
    x = torch.zeros(0, *KINDS["stride2"][1], dtype=F64)
    assert ours(x).shape == layer(x).shape


# ---------------------------------------------------------------------------------------- what stays generic, refusals


def test_groups_stay_on_the_generic_path():
    """A grouped Conv3d is no single Linear over its patches: the generic exact path trains it, as before."""
    model = nn.Sequential(nn.Conv3d(4, 4, 3, groups=2), nn.Conv3d(4, 2, 1))
    assert registry.layer_type(model[0]) is None and registry.generic_candidate(model[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = bnn.convert_model(model, clipping="flat", max_grad_norm=1.0)
    assert registry.is_generic(ours[0]) and type(ours[1]) is bnn.Conv3d
    with pytest.raises(ValueError, match="groups=2 is not fused.*generic exact path"):
        bnn.Conv3d(4, 4, 3, groups=2, clipping="flat", max_grad_norm=1.0)


def test_backprop_clipping_is_refused_naming_the_exact_modes():
    with pytest.raises(ValueError, match="clipping='backprop' has no proved bound.*'flat' or 'per_layer'"):
        bnn.Conv3d(2, 2, 3)
    with pytest.raises(ValueError, match=r"0 \(Conv3d\): clipping='backprop' has no proved bound"):
        bnn.convert_model(nn.Sequential(nn.Conv3d(2, 2, 3)), clipping="backprop", input_clip=1.0, grad_clip=1.0)
    assert bnn.Conv3d(2, 2, 3, clipping="flat", max_grad_norm=1.0).clipping == "flat"


# ---------------------------------------------------------------------------------------- end to end


SIGMA = 1e-16


def _cnn():
    return nn.Sequential(nn.Conv3d(2, 3, 3, padding=1, stride=(1, 2, 2)), nn.ReLU(), nn.Conv3d(3, 2, 2, bias=False),
                         nn.Flatten(1), nn.Linear(2 * 3 * 1 * 1, 3))


def test_make_private_fuses_conv3d_and_its_step_is_per_example_clipping():
    """A 3-D CNN made private in float64 with negligible noise (the engine needs σ > 0): every Conv3d
    is fused, no generic unit is left, and each gradient before the step equals Σ_i clip(G_i, C)
    with G_i from a batch of one."""
    torch.manual_seed(0)
    model = _cnn().double()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(12, 2, 4, 4, 4, generator=gen, dtype=F64),
                         torch.randint(0, 3, (12,), generator=gen))
    C = 1e-3  # below every example's gradient norm here: each one is clipped
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=6), noise_multiplier=SIGMA,
            max_grad_norm=C, clipping="flat", loss_reduction="sum", noise_seed=7)
    assert sum(type(m) is bnn.Conv3d for m in model.modules()) == 2
    assert not any(registry.is_generic(m) for m in model.modules())
    x, y = next(iter(loader))
    assert x.shape[0] > 1
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    names = {id(p): n for n, p in model.named_parameters()}
    got = {names[id(p)]: p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None}
    truth = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for i in range(x.shape[0]):
        reference.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(reference(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        params = dict(reference.named_parameters())
        norm = math.sqrt(sum(float(p.grad.square().sum()) for p in params.values()))
        assert norm > C
        for n, p in params.items():
            truth[n] += p.grad * min(1.0, C / norm)
    # float64 both ways: ≤ ~10³ roundings per entry (the forward, the patches' sums, the norms), each
    # within an ulp of magnitudes that scale with an example's clipped gradient (≤ C); and the noise,
    # std σC per entry: 10 std (a fixed seed; exceeded with probability ~1e-23 per entry)
    tol = 1000 * torch.finfo(F64).eps * x.shape[0] * C + 10 * SIGMA * C
    for n, p in model.named_parameters():
        assert n in got, n
        assert torch.all((got[n] - truth[n]).abs() <= tol), n


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_compiled_release_is_per_example_clipping(mode):
    """Under torch.compile (aot_eager: the custom ops' fake kernels and autograd, no codegen) the
    weights are viewed and mapped back too: float64 model, release against float64 per-example
    clipping (a few dozen roundings of float64 per entry, relative to the clipped gradients' scale)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _cnn().double()
    x = torch.randn(3, 2, 4, 4, 4, dtype=F64, generator=torch.Generator().manual_seed(6))
    grads = {}
    for i in range(3):
        ref = copy.deepcopy(model)
        ref(x[i:i + 1]).square().sum().backward()
        for n, p in ref.named_parameters():
            grads.setdefault(n, []).append(p.grad)
    grads = {n: torch.stack(v) for n, v in grads.items()}
    norm = torch.sqrt(sum(v.flatten(1).square().sum(1) for v in grads.values()))
    C = float(norm.median())
    ours = bnn.convert_model(copy.deepcopy(model), clipping=mode, max_grad_norm=C if mode == "flat" else [C] * 3)
    assert type(ours[0]) is bnn.Conv3d and type(ours[2]) is bnn.Conv3d
    torch.compile(ours, backend="aot_eager")(x).square().sum().backward()
    if mode == "flat":
        factors = {n: torch.clamp(C / norm, max=1.0) for n in grads}
    else:
        per = {k: torch.sqrt(sum(grads[n].flatten(1).square().sum(1) for n in grads if n.startswith(k)))
               for k in ("0.", "2.", "4.")}
        factors = {n: torch.clamp(C / per[n[:2]], max=1.0) for n in grads}
    for n, p in ours.named_parameters():
        want = (grads[n] * factors[n].reshape(-1, *[1] * (grads[n].dim() - 1))).sum(0)
        torch.testing.assert_close(p.grad, want, rtol=0, atol=1e-12 * C)
