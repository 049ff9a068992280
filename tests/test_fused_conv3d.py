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

import fused_release as fr
from fused_release import F64

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
    return fr.layer_of(KINDS, kind)


def _check(kind, mode, dtype, n, contiguous=True):
    return fr.check(KINDS, _scale, kind, mode, dtype, n, contiguous)


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
    outs = fr.check_forward(KINDS, kind)
    assert type(bnn.convert_model(_layer(kind), clipping="flat", max_grad_norm=0.1)) is bnn.Conv3d
    assert outs[1].shape == outs[0].shape and outs[1].is_contiguous()


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
