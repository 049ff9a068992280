"""Fused exact paths for ``nn.RMSNorm`` and affine ``nn.InstanceNorm1d/2d/3d`` (issue 26).

Before, these were trained by the generic exact path (one vectorised backward per chunk of
examples); now they are registered layer types (bpclip_fast/layers/norms.py) whose per-example
gradients come from the LayerNorm/GroupNorm kernel and are released as DenseExamples.

* Exactness: a zero-noise private step (never armed: no noise, no scaling) equals the clipped sum of
  per-example gradients computed by running each example alone in float64, in flat and per_layer,
  with float64, float32 and bfloat16 parameters, a batch of one and a non-contiguous input. The
  model is ``norm -> PositionalEmbedding`` with the loss ``Σ out ⊙ G``, so both layers' upstream
  gradient is ``G`` exactly in every dtype and flat clips two layers' norms together.
* Refusals: backpropagation clipping, InstanceNorm with running statistics.
* The registry converts them to the fused types, no longer to generic units.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from bpclip_fast import modules, registry
from bpclip_fast import nn as bnn
from fuzz_bounds import INSTANCE_NORM_BIAS_OPTION

F64 = torch.float64

# kind -> (torch module, its clipped type, per-example input shape)
KINDS = {
    "rms": (lambda dt: nn.RMSNorm(6, eps=1e-5, dtype=dt), bnn.RMSNorm, (3, 6)),
    "rms-default-eps": (lambda dt: nn.RMSNorm((2, 3), dtype=dt), bnn.RMSNorm, (4, 2, 3)),
    "instance1d": (lambda dt: nn.InstanceNorm1d(3, affine=True, dtype=dt), bnn.InstanceNorm1d, (3, 7)),
    "instance2d": (lambda dt: nn.InstanceNorm2d(2, affine=True, dtype=dt), bnn.InstanceNorm2d, (2, 3, 4)),
}
# The 3-d case has no bias where torch's InstanceNorm takes the option (not on torch 2.11).
INSTANCE3D = "instance3d-no-bias" if INSTANCE_NORM_BIAS_OPTION else "instance3d"
KINDS[INSTANCE3D] = (lambda dt: nn.InstanceNorm3d(2, affine=True, dtype=dt,
                                                  **({"bias": False} if INSTANCE_NORM_BIAS_OPTION else {})),
                     bnn.InstanceNorm3d, (2, 2, 3, 2))


def _model(kind, dtype, seed=0):
    make, _, shape = KINDS[kind]
    model = nn.Sequential(make(F64), modules.PositionalEmbedding(*shape, dtype=F64))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # not torch's 1/0 affine init
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
    return model.to(dtype)


def _data(kind, n, dtype, seed=1, contiguous=True):
    """(x, G) rounded to ``dtype``; a non-contiguous x is a transposed view of the same values."""
    shape = KINDS[kind][2]
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, *shape, generator=gen, dtype=F64) * 2 + 0.5).to(dtype)
    g = torch.randn(n, *shape, generator=gen, dtype=F64).to(dtype)
    if not contiguous:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
        assert not x.is_contiguous()
    return x, g


def _eps64(norm, dtype):
    """The float64 truth computes the same function: RMSNorm's eps=None means the eps of the dtype
    torch computes in for the data's dtype (float32 for fp16/bf16 data, the dtype itself otherwise:
    tests/test_attack_review9.py), not float64's."""
    ref = copy.deepcopy(norm).double()
    if isinstance(ref, nn.RMSNorm) and ref.eps is None:
        ref.eps = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
    return ref


def _truth(model, x, g, dtype):
    """Each example alone in float64: ``{param name: [B, *shape]}``, and for each example the float64
    ``A`` of each weight/bias entry (``Σ_t |g_t|·(|x̂_t| + |μ_t|·rstd_t)``, ``Σ_t |g_t|``, ``|G|``): the
    scale of the rounding errors of that entry's computation."""
    ref = nn.Sequential(_eps64(model[0], dtype), copy.deepcopy(model[1]).double())
    grads, scales = {}, {}
    for i in range(x.shape[0]):
        xi, gi = x[i:i + 1].double(), g[i:i + 1].double()
        ref.zero_grad(set_to_none=True)
        (ref(xi) * gi).sum().backward()
        for name, p in ref.named_parameters():
            grads.setdefault(name, []).append(p.grad.clone())
        norm = ref[0]
        if isinstance(norm, nn.RMSNorm):
            dims = tuple(range(-len(norm.normalized_shape), 0))
            rstd = (xi.square().mean(dims, keepdim=True) + norm.eps).rsqrt()
            a_w = (gi.abs() * (xi * rstd).abs()).reshape(-1, *norm.normalized_shape).sum(0)
            a = {"0.weight": a_w}
        else:
            dims = tuple(range(2, xi.dim()))
            mean = xi.mean(dims, keepdim=True)
            rstd = (xi.var(dims, keepdim=True, correction=0) + norm.eps).rsqrt()
            term = gi.abs() * ((xi - mean).abs() * rstd + mean.abs() * rstd)
            a = {"0.weight": term.sum(dims)[0], "0.bias": gi.abs().sum(dims)[0]}
        a["1.weight"] = gi[0].abs()
        for name in grads:
            scales.setdefault(name, []).append(a[name])
    return ({k: torch.stack(v) for k, v in grads.items()}, {k: torch.stack(v) for k, v in scales.items()})


def _units(names, mode):
    return [names] if mode == "flat" else [[n for n in names if n.startswith("0.")], ["1.weight"]]


def _clipped_sum(grads, scales, mode, thresholds):
    """The clipped sum and, per entry, ``Σ_i c_i (A_i,e + ‖A_i‖)`` over each unit: the error scale (a
    factor's relative error ``ε‖A_i‖/‖G_i‖`` times ``|G_i,e| ≤ ‖G_i‖`` gives the ``‖A_i‖`` term)."""
    sums, scale = {}, {}
    for unit, c in zip(_units(list(grads), mode), thresholds):
        norms = torch.sqrt(sum(grads[k].flatten(1).square().sum(1) for k in unit))
        a_norm = torch.sqrt(sum(scales[k].flatten(1).square().sum(1) for k in unit))
        factor = torch.clamp(c / norms, max=1.0)
        for k in unit:
            shape = (-1,) + (1,) * (grads[k].dim() - 1)
            sums[k] = (grads[k] * factor.reshape(shape)).sum(0)
            scale[k] = ((scales[k] + a_norm.reshape(shape)) * factor.reshape(shape)).sum(0)
    return sums, scale


def _epsilon(kind, dtype):
    """Relative error per unit of scale. Roundings of the parameters' dtype (u_d): the forward's mean
    and rstd (the data dtype on the CPU for instance norms), the stored per-example gradient, the norm
    of those stored values in the factor, the release's product and its final rounding (6). The
    float32 accumulation (u_acc): the statistic's sum over D entries and its root, the sum over R
    positions, a few products (R + D + 16)."""
    shape = KINDS[kind][2]
    if kind.startswith("rms"):
        d = 6  # both RMSNorms normalize 6 entries
        r = math.prod(shape) // d
    else:
        d = r = math.prod(shape[1:])  # the positions of one channel make its statistic and its sum
    u_d = 2.0 ** -53 if dtype == F64 else torch.finfo(dtype).eps / 2
    u_acc = 2.0 ** -53 if dtype == F64 else 2.0 ** -24
    return 6 * u_d + (r + d + 16) * u_acc


def _check(kind, mode, dtype, n, contiguous=True):
    model = _model(kind, dtype)
    x, g = _data(kind, n, dtype, contiguous=contiguous)
    grads, scales = _truth(model, x, g, dtype)
    # thresholds below the median norm: some examples clipped, some (for n > 1) not
    units = _units(list(grads), mode)
    norms = [torch.sqrt(sum(grads[k].flatten(1).square().sum(1) for k in u)) for u in units]
    thresholds = [float(v.median()) * (0.9 if n > 1 else 0.5) for v in norms]
    want, scale = _clipped_sum(grads, scales, mode, thresholds)
    ours = bnn.convert_model(copy.deepcopy(model), clipping=mode,
                             max_grad_norm=thresholds if mode == "per_layer" else thresholds[0])
    assert type(ours[0]) is KINDS[kind][1] and not registry.is_generic(ours[0])
    (ours(x) * g).sum().backward()
    eps = _epsilon(kind, dtype)
    got = dict(ours.named_parameters())
    assert set(want) == {k for k, p in got.items() if p.grad is not None}
    for k in want:
        err = (got[k].grad.double() - want[k]).abs()
        tol = eps * scale[k]
        assert bool((err <= tol).all()), f"{kind} {mode} {dtype} {k}: error {err.max():.3g} above {tol.min():.3g}"
        assert got[k].grad.dtype == dtype


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_release_equals_the_clipped_sum_of_examples_run_alone_in_float64(kind, mode, dtype):
    _check(kind, mode, dtype, n=5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_batch_of_one(kind):
    _check(kind, "flat", torch.float32, n=1)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_non_contiguous_input(kind):
    _check(kind, "per_layer", torch.float32, n=4, contiguous=False)


@pytest.mark.parametrize("kind", list(KINDS))
def test_input_gradient_is_torchs(kind):
    """The input gradient comes from the unclipped upstream gradient, as torch's own module gives it."""
    model = _model(kind, F64)
    x, g = _data(kind, 3, F64)
    ref = copy.deepcopy(model[0])
    ours = bnn.convert_model(copy.deepcopy(model[0]), clipping="per_layer", max_grad_norm=0.1)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    (ref(xs[0]) * g).sum().backward()
    (ours(xs[1]) * g).sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("make", [lambda **k: bnn.RMSNorm(4, **k), lambda **k: bnn.InstanceNorm1d(3, **k),
                                  lambda **k: bnn.InstanceNorm2d(3, **k), lambda **k: bnn.InstanceNorm3d(3, **k)])
def test_backprop_clipping_is_refused_naming_the_exact_modes(make):
    with pytest.raises(ValueError, match="clipping='backprop' has no proved bound.*'flat' or 'per_layer'"):
        make()
    assert make(clipping="flat", max_grad_norm=1.0).clipping == "flat"


@pytest.mark.parametrize("module", [nn.RMSNorm(4), nn.InstanceNorm2d(3, affine=True)])
def test_convert_model_refuses_backprop_before_changing_anything(module):
    model = nn.Sequential(module, nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"0 \(" + type(module).__name__ + r"\): clipping='backprop' has no proved"):
        bnn.convert_model(model, clipping="backprop", input_clip=1.0, grad_clip=1.0)
    assert type(model[0]) is type(module) and type(model[1]) is nn.Linear


@pytest.mark.parametrize("cls", [bnn.InstanceNorm1d, bnn.InstanceNorm2d, bnn.InstanceNorm3d])
def test_instance_norm_with_running_statistics_is_refused(cls):
    with pytest.raises(ValueError, match=f"{cls.__name__}: track_running_stats=True .* released without noise; "
                                         "use track_running_stats=False"):
        cls(3, track_running_stats=True, clipping="flat", max_grad_norm=1.0)
    torch_type = getattr(nn, cls.__name__)
    model = nn.Sequential(torch_type(3, affine=True, track_running_stats=True))
    with pytest.raises(ValueError, match="InstanceNorm with track_running_stats=True .* use track_running_stats=False"):
        bnn.convert_model(model, clipping="flat", max_grad_norm=1.0)
    assert type(model[0]) is torch_type
    assert registry.mixes_batch(model[0])


def test_bad_inputs_name_the_layer_and_the_shape():
    rms = bnn.RMSNorm(4, clipping="per_layer", max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"RMSNorm: the input must be \[B, \*, 4\]"):
        rms(torch.randn(3, 5))
    inorm = bnn.InstanceNorm2d(3, clipping="per_layer", max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"InstanceNorm2d: the input must be \[B, 3, \*, \*\]"):
        inorm(torch.randn(3, 4, 4))  # unbatched: torch's module takes it, ours needs the batch dimension
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        inorm(torch.randn(2, 3, 1, 1))


def test_the_registry_converts_them_to_fused_layers_not_generic_units():
    for module in (nn.RMSNorm(4), nn.InstanceNorm1d(3, affine=True), nn.InstanceNorm2d(3, affine=True),
                   nn.InstanceNorm3d(3, affine=True, **({"bias": False} if INSTANCE_NORM_BIAS_OPTION else {}))):
        assert not registry.generic_candidate(module), type(module).__name__
        assert registry.convertible(module)
        model = nn.Sequential(module)
        assert registry.generic_units(model) == []
        bnn.convert_model(model, clipping="flat", max_grad_norm=1.0)
        assert type(model[0]) is getattr(bnn, type(module).__name__)
    # Without affine parameters there is nothing to clip: left as torch's module.
    plain = nn.Sequential(nn.InstanceNorm2d(3), nn.RMSNorm(4, elementwise_affine=False))
    bnn.convert_model(plain, clipping="flat", max_grad_norm=1.0)
    assert type(plain[0]) is nn.InstanceNorm2d and type(plain[1]) is nn.RMSNorm
