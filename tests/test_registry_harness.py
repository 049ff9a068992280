"""One harness over every registered layer type (ARCHITECTURE.md item 6, issue 26).

The tests are parametrised by ``registry.layer_types()``: a type registered later gets them without
being named here, and fails until :data:`EXAMPLES` holds a tiny module and batch of it. Per type,
mode of its ``modes`` and dtype:

1. exactness: the noise-free release equals ``Σ_i clip(g_i, C)`` with ``g_i`` example i's gradient
   in float64 (tests/exact_oracle.py), on batches of 4 (some examples clipped, some not) and 1, with
   a contiguous and a strided input;
2. removal: removing an example whose gradient is far above ``C`` changes the release by ``C``
   (flat; ``C_l`` per layer under per_layer), up to the rounding derived below;
3. ``plain`` is the torch type's forward, and the clipped layer computes that forward too;
4. (in 1 and 3) batches of one and non-contiguous inputs;
5. backprop, where the type allows it: each example's contribution is within the layer's
   ``sensitivity_for`` (per-example gradients of the clipped inputs, bpclip_fast.reference), and
   the layer's gradient is their sum;
6. ``torch.library.opcheck`` of every extension op the layer's forward and backward call (recorded
   with a dispatch mode, with their real arguments), as tests/test_ops.py checks each op.

Each exact-mode test runs two copies of the example module side by side (:class:`Twin`), so that
flat (one norm over both) and per_layer (one per layer) clip differently.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from bpclip_fast import modules, reference, registry
from bpclip_fast.modes import EXACT
from bpclip_fast.nn import convert_model
import exact_oracle as eo
from test_exact_layers import perturbed

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

U32 = 2.0 ** -24  # unit roundoff of the fp32 arithmetic every dtype's sums and norms run in (or wider)
DTYPES = [torch.float32, torch.bfloat16]


def _tokens(n, gen, vocab=7, t=4):
    idx = torch.randint(1, vocab, (n, t), generator=gen)
    idx[0, 1] = idx[0, 0]  # a repeated token: the embedding norm is by index equality
    idx[n - 1, 2] = 0  # padding: no gradient
    return idx


# torch type -> factory(n, gen) -> (module in float32, input batch of n examples). Inputs are centred
# (randn): the tolerance below assumes no cancellation in a normalisation's statistics.
EXAMPLES = {
    nn.Linear: lambda n, g: (nn.Linear(6, 5), torch.randn(n, 3, 6, generator=g)),
    nn.Conv2d: lambda n, g: (nn.Conv2d(3, 4, 3, padding=1, stride=(1, 2)), torch.randn(n, 3, 5, 5, generator=g)),
    nn.LayerNorm: lambda n, g: (nn.LayerNorm(6), torch.randn(n, 3, 6, generator=g)),
    nn.GroupNorm: lambda n, g: (nn.GroupNorm(2, 4), torch.randn(n, 4, 3, 3, generator=g)),
    nn.Embedding: lambda n, g: (nn.Embedding(7, 5, padding_idx=0), _tokens(n, g)),
    nn.EmbeddingBag: lambda n, g: (nn.EmbeddingBag(7, 5, mode="mean", padding_idx=0), _tokens(n, g)),
    modules.PositionalEmbedding: lambda n, g: (modules.PositionalEmbedding(3, 5), torch.randn(n, 3, 5, generator=g)),
    modules.ClassToken: lambda n, g: (modules.ClassToken(5, 2), torch.randn(n, 3, 5, generator=g)),
    # Not registered yet (used once they are):
    nn.RMSNorm: lambda n, g: (nn.RMSNorm(6), torch.randn(n, 3, 6, generator=g)),
    nn.InstanceNorm1d: lambda n, g: (nn.InstanceNorm1d(4, affine=True), torch.randn(n, 4, 5, generator=g)),
    nn.InstanceNorm2d: lambda n, g: (nn.InstanceNorm2d(4, affine=True), torch.randn(n, 4, 3, 3, generator=g)),
    nn.InstanceNorm3d: lambda n, g: (nn.InstanceNorm3d(3, affine=True), torch.randn(n, 3, 2, 2, 2, generator=g)),
    nn.Conv1d: lambda n, g: (nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2), torch.randn(n, 4, 7, generator=g)),
    nn.Conv3d: lambda n, g: (nn.Conv3d(3, 4, (2, 3, 2), stride=(1, 2, 1), padding=1),
                             torch.randn(n, 3, 3, 4, 3, generator=g)),
}
try:  # Hugging Face's Conv1D is registered once transformers is imported (registry.load_optional)
    from transformers.pytorch_utils import Conv1D as _HFConv1D
    EXAMPLES[_HFConv1D] = lambda n, g: (_HFConv1D(5, 6), torch.randn(n, 3, 6, generator=g))
except ImportError:
    pass
# Types whose clipped layer refuses bfloat16 (type: why); every other type is tested in it too.
NO_BF16: dict = {}
ENTRIES = registry.layer_types()
EXACT_CASES = [(e, m) for e in ENTRIES for m in e.modes if m in EXACT]
BACKPROP = [e for e in ENTRIES if "backprop" in e.modes]


def _name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _id(v):
    if isinstance(v, registry.LayerType):
        return v.torch_type.__name__
    return str(v).replace("torch.", "") if isinstance(v, torch.dtype) else None


def example(entry, n, dtype, seed=0):
    """``(module of entry's torch type in dtype, input batch of n)``; fails for a type with no example."""
    factory = EXAMPLES.get(entry.torch_type)
    if factory is None:
        pytest.fail(f"add an example for {_name(entry.torch_type)} to tests/test_registry_harness.py")
    if dtype == torch.bfloat16 and entry.torch_type in NO_BF16:
        pytest.skip(f"{_name(entry.torch_type)}: no bfloat16 ({NO_BF16[entry.torch_type]})")
    gen = torch.Generator().manual_seed(seed)
    module, x = factory(n, gen)
    assert type(module) is entry.torch_type, f"EXAMPLES[{_name(entry.torch_type)}] built a {type(module)}"
    perturbed(module, seed)  # torch initialises norms' affine parameters to 1 and 0
    return module.to(dtype), (x.to(dtype) if x.is_floating_point() else x)


def strided(x):
    """The same values in a non-contiguous view (every other element of a twice-wide tensor)."""
    wide = x.new_zeros(*x.shape, 2)
    wide[..., 0] = x
    view = wide[..., 0]
    assert not view.is_contiguous() and torch.equal(view, x)
    return view


class Twin(nn.Module):
    """Two copies of one layer on the same input, outputs stacked: two clipping units."""

    def __init__(self, layer, seed):
        super().__init__()
        self.a, self.b = layer, perturbed(copy.deepcopy(layer), seed + 100)

    def forward(self, x):
        return torch.stack([self.a(x), self.b(x)], dim=1)


def inner(out, g):
    """The loss whose gradient is the backward with upstream ``g``: ``<out, g>``."""
    return (out * g).sum()


def upstream(out, seed=1):
    """An upstream gradient in out's dtype, example i of 4 scaled by 2^(i - 1.5) so that norms differ."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g * torch.logspace(-1.5, 1.5, len(g), base=2, dtype=torch.float64).reshape(-1, *[1] * (g.dim() - 1))
    return g.to(out.dtype)


def release(model, x, g):
    """The parameters' gradients after one backward with upstream g (noise off), in float64."""
    model.zero_grad(set_to_none=True)
    inner(model(x), g).backward()
    return {k: p.grad.double().cpu() for k, p in model.named_parameters()}


def norm(tensors):
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


# ------------------------------------------------------------------------------ rounding
#
# The released value is Σ_i RZ(c_i·Ĝ_i), Ĝ_i the computed gradient of example i, c_i the factor of
# the proved upper bound b_i ≥ ‖Ĝ_i‖. Against the truth Σ_i f(n_i)·G_i (float64, same stored inputs
# and parameters) the error of example i is ‖Ĝ_i − G_i‖ plus the factor's, which is at most
# b_i − n_i whether or not it clips (C·n/b vs C: C(b−n)/b ≤ b − n; n vs C·n/b when n ≤ C < b: ≤ b − n).
# Both are dot-product errors: each entry sums products whose absolute values have a Frobenius norm
# at most the scale s_i the probes use (validate._own_gradients, from the registry's taps and
# multiplier_norm: √taps·‖g_i‖·‖x_i‖ for the weight, √rows·‖g_i‖ for the bias). Composed stages'
# relative errors add: the forward's statistics (≤ numel x_i terms), one gradient entry (≤ numel out_i
# positions), the norm (≤ numel params squares), the batch (B), so K = their sum and the fp32 part is
# 2K·u32·s_i (2 for the norm's square root, the factor's division and product). Low-precision data
# adds R = 4 roundings to its dtype per example (ATen's CPU norm statistics mean and rstd, the
# normalised value, the per-example value stored in the dtype: csrc/exact.cpp, examples.h), and the
# release is rounded to the dtype once: u_dt·‖release‖.

R = 4


def unit(dtype):
    return torch.finfo(dtype).eps / 2


def terms(layer, x, out_shape, batch):
    return x[0].numel() + math.prod(out_shape[1:]) + sum(p.numel() for p in layer.parameters()) + batch


def scales(entry, layers, x, g):
    """``s_il`` per example and layer, ``[B, L]`` (g: ``[B, L, *out]``)."""
    s = torch.zeros(len(x), len(layers), dtype=torch.float64)
    for i in range(len(x)):
        xi = x[i:i + 1]
        for l, layer in enumerate(layers):
            gn = float(g[i, l].double().norm())
            mult = (entry.multiplier_norm(layer, xi) if entry.multiplier_norm is not None
                    else float(xi.double().norm()))
            s[i, l] += math.sqrt(entry.taps(layer)) * gn * mult
            if getattr(layer, "bias", None) is not None:
                s[i, l] += math.sqrt(g[i, l].numel() // layer.weight.shape[0]) * gn
    return s


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_every_registered_type_has_an_example(entry):
    module, x = example(entry, 2, torch.float32)
    assert registry.layer_type(module) is entry


def twin_case(entry, mode, dtype, n, seed=0):
    layer, x = example(entry, n, dtype, seed)
    twin = Twin(layer, seed)
    with torch.no_grad():
        g = upstream(twin(x), seed=seed + 1)
    per_ex = eo.per_example_grads(twin, x, g, loss_fn=inner)
    return twin, x, g, per_ex


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("n", [4, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("entry,mode", EXACT_CASES, ids=_id)
def test_release_equals_the_clipped_sum_of_float64_example_gradients(entry, mode, dtype, n, layout):
    check_release(entry, mode, dtype, n, layout, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("n", [4, 1])
@pytest.mark.parametrize("entry,mode", EXACT_CASES, ids=_id)
def test_release_on_cuda_equals_the_clipped_sum_of_float64_example_gradients(entry, mode, n, monkeypatch):
    """Every registered type's CUDA path against the same float64 truth, fp32, with TF32 off: the
    tolerance's u32 is fp32 arithmetic's (the bound itself covers TF32, csrc/exact.cpp; this
    tolerance is derived without it)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    check_release(entry, mode, torch.float32, n, "contiguous", "cuda")


def check_release(entry, mode, dtype, n, layout, device):
    twin, x, g, per_ex = twin_case(entry, mode, dtype, n)
    groups = eo.layer_groups(twin)
    norms = {u: sum(per_ex[p].flatten(1).pow(2).sum(1) for p in ps).sqrt() for u, ps in eo.clipping_units(groups, mode)}
    # Some examples clipped and some not (the median of 4 spread norms); a lone example clipped.
    cut = {u: float(v.median()) if n > 1 else 0.5 * float(v[0]) for u, v in norms.items()}
    c = cut["all"] if mode == "flat" else [cut[u] for u, _ in groups]
    want = eo.clipped_sum(per_ex, groups, c, mode)
    factors = torch.cat(list(want.factors.values()))
    assert (factors < 1).any() and ((factors == 1).any() or n == 1)

    model = convert_model(copy.deepcopy(twin), clipping=mode, max_grad_norm=c).to(device)
    assert all(getattr(m, "noise_multiplier", 0.0) == 0 for m in model.modules())
    got = release(model, (strided(x) if layout == "strided" else x).to(device), g.to(device))
    err = norm(got[k] - want.sums[k] for k in want.sums)
    u = unit(dtype)
    k = terms(twin.a, x, g.shape[1:], n) + terms(twin.b, x, g.shape[1:], 0)
    tol = float(scales(entry, [twin.a, twin.b], x, g).sum()) * (2 * k * U32 + R * u) + u * norm(want.sums.values())
    assert err <= tol, f"‖release − truth‖ = {err:.3g} > {tol:.3g} (‖truth‖ = {norm(want.sums.values()):.3g})"


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("entry,mode", EXACT_CASES, ids=_id)
def test_removing_an_example_far_above_c_changes_the_release_by_c(entry, mode, dtype):
    n = 4
    twin, x, g, per_ex = twin_case(entry, mode, dtype, n, seed=3)
    groups = eo.layer_groups(twin)
    units = eo.clipping_units(groups, mode)
    c = 1e-3 * float(sum(v.flatten(1).pow(2).sum(1) for v in per_ex.values()).sqrt().min())
    c_unit = dict(zip((u for u, _ in units), eo.split_thresholds(c, len(units))))
    # float64 truth: every example clipped, so each one's contribution is C_u exactly.
    want = eo.clipped_sum(per_ex, groups, c, mode)
    assert all(bool((f < 1e-2).all()) for f in want.factors.values())

    model = convert_model(copy.deepcopy(twin), clipping=mode, max_grad_norm=c)
    full = release(model, x, g)
    # Example j's released contribution c_j·Ĝ_j is within C_u·ρ_j of C_u·G_j/n_j (as in the test above:
    # c_j ≤ C_u/n_j scales the gradient's error, and the factor's is ≤ b_j − n_j), ρ_j from the scale
    # s_j of the unit's layers over n_j; each release also rounds once to the dtype (≤ u·B·C_u).
    u = unit(dtype)
    k = terms(twin.a, x, g.shape[1:], n) + terms(twin.b, x, g.shape[1:], 0)
    s = scales(entry, [twin.a, twin.b], x, g)
    layers = {"all": [0, 1], "a": [0], "b": [1]}
    for i in range(n):
        keep = [j for j in range(n) if j != i]
        part = release(model, x[keep], g[keep])
        for unit_name, params in units:
            n_j = sum(per_ex[p].flatten(1).pow(2).sum(1) for p in params).sqrt()
            rho = (2 * k * U32 + R * u) * s[:, layers[unit_name]].sum(1) / n_j
            rel = 2 * float(rho.sum()) + 2 * n * u
            change = norm(full[p] - part[p] for p in params)
            cu = c_unit[unit_name]
            assert abs(change - cu) <= cu * rel, f"example {i}, {unit_name}: {change:.6g} vs C = {cu:.6g} (±{rel:.2g})"


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("n", [4, 1])
@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_plain_and_the_clipped_layer_compute_the_torch_forward(entry, n, layout):
    """In float64, where both sides compute one function to ~1e-16 relative (a few dozen terms)."""
    layer, x = example(entry, n, torch.float64, seed=5)
    if layout == "strided":
        x = strided(x)
    with torch.no_grad():
        want = layer(x)
        params = dict(layer.named_parameters())
        scale = float(want.abs().max())
        torch.testing.assert_close(entry.plain(layer, x, params), want, rtol=1e-12, atol=1e-12 * scale)
        for mode in entry.modes:
            kw = (dict(input_clip=1.0, grad_clip=1.0) if mode == "backprop" else dict(max_grad_norm=1.0))
            clipped = convert_model(copy.deepcopy(layer), clipping=mode, **kw)
            if hasattr(clipped, "set_max_input_shape"):
                clipped.set_max_input_shape(x.shape[1:])
            assert type(clipped) is entry.clipped_type
            # backprop clipping computes the layer on the clipped input x̃ (as the torch type would)
            own = layer(reference.clip_input(x, 1.0)) if mode == "backprop" else want
            torch.testing.assert_close(clipped(x), own, rtol=1e-12, atol=1e-12 * scale, msg=mode)
            torch.testing.assert_close(entry.plain(clipped, x, dict(clipped.named_parameters())), want,
                                       rtol=1e-12, atol=1e-12 * scale, msg=mode)


@pytest.mark.parametrize("n", [4, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("entry", BACKPROP, ids=_id)
def test_backprop_contributions_are_within_the_sensitivity(entry, dtype, n):
    """Each example's contribution ∇_θ<layer(x̃_i), g̃_i> (x̃, g̃ the clipped input and upstream
    gradient, bpclip_fast.reference, float64 from the stored values) is within the layer's
    sensitivity; the layer's gradient is their sum (rounding as in the exactness test)."""
    layer, x = example(entry, n, dtype, seed=7)
    with torch.no_grad():
        g = upstream(layer(x), seed=8)
    # The upstream norm the clipped type uses (Conv2d: l15 by default), read from a converted copy.
    kind = getattr(convert_model(copy.deepcopy(layer), clipping="backprop", input_clip=1.0, grad_clip=1.0), "norm", "l2")
    xn, gn = reference.l2_norm(x.double()), (reference.l2_norm if kind == "l2" else reference.l15_norm)(g.double())
    # Some inputs and upstream gradients clipped and some not (medians of 4); a lone example's clipped.
    cx, cg = (float(v.median()) if n > 1 else 0.5 * float(v[0]) for v in (xn, gn))
    clipped = convert_model(copy.deepcopy(layer), clipping="backprop", input_clip=cx, grad_clip=cg)
    assert clipped.noise_multiplier == 0
    if hasattr(clipped, "set_max_input_shape"):
        clipped.set_max_input_shape(x.shape[1:])
    inner(clipped(x), g).backward()
    sens = clipped.sensitivity_for(tuple(x.shape))
    assert sens == pytest.approx(reference.layer_sensitivity(clipped, tuple(x.shape), input_clip=cx, grad_clip=cg,
                                                             norm=kind), rel=1e-12)
    xt = reference.clip_input(x.double(), cx)
    gt = reference.clip_upstream(g.double(), cg, kind)
    assert (reference.l2_norm(xt) < xn).any() and (reference.l2_norm(gt) < reference.l2_norm(g.double())).any()
    contrib = eo.per_example_grads(layer, xt, gt, loss_fn=inner)
    per_norm = sum(v.flatten(1).pow(2).sum(1) for v in contrib.values()).sqrt()
    assert bool((per_norm <= sens * (1 + 1e-12)).all()), f"{per_norm.tolist()} > Δ = {sens}"
    err = norm(getattr(clipped, k).grad.double() - v.sum(0) for k, v in contrib.items())
    u = unit(dtype)
    k = terms(layer, x, g.shape, n)
    tol = float(scales(entry, [layer], xt, gt.unsqueeze(1)).sum()) * (2 * k * U32 + R * u) \
        + u * norm(v.sum(0) for v in contrib.values())
    assert err <= tol, f"‖gradient − Σ contributions‖ = {err:.3g} > {tol:.3g}"


class _Recorder(TorchDispatchMode):
    """The extension's ops called under it, each with a copy of its arguments as they came in."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "bpclip_fast" and func not in self.calls:
            self.calls[func] = tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
        return func(*args, **kwargs)


@pytest.mark.parametrize("entry,mode", [(e, m) for e in ENTRIES for m in e.modes], ids=_id)
def test_opcheck_the_ops_the_layer_calls(entry, mode):
    layer, x = example(entry, 3, torch.float32, seed=9)
    kw = dict(input_clip=1.0, grad_clip=1.0) if mode == "backprop" else dict(max_grad_norm=1.0)
    clipped = convert_model(layer, clipping=mode, **kw)
    if hasattr(clipped, "set_max_input_shape"):
        clipped.set_max_input_shape(x.shape[1:])
    with _Recorder() as rec:
        out = clipped(x)
        inner(out, upstream(out.detach())).backward()
    assert rec.calls, f"{entry.clipped_type.__name__} ({mode}) called no op of the extension"
    for op, (args, kwargs) in rec.calls.items():
        torch.library.opcheck(op, args, kwargs)
