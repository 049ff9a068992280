"""Tests of the exact-clipping oracle (tests/exact_oracle.py) itself, before anything is checked against it.

(a) torch.func per-example gradients add up to the batch gradient, and one of them is the gradient
of that example alone; (b) Opacus' own clipping (hooks + DPOptimizer / DPPerLayerOptimizer, noise
off) gives the oracle's clipped sum, in float64 to 1e-9 and in float32 to float32 accuracy, with
examples far above and far below their thresholds; (c) norms, factors and sums obey their definitions.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import exact_oracle as eo

pytest.importorskip("opacus")

MODELS = eo.models()
OPACUS_EPS = 1e-6  # Opacus' clip factor is (C / (n + 1e-6)).clamp(max=1)


def batch(name: str, scales: tuple[float, ...], seed: int = 0):
    """A model of the zoo (float32, seeded) and a batch whose example i is scaled by ``scales[i]``."""
    factory, shape, classes = MODELS[name]
    torch.manual_seed(seed)
    model = factory()
    x = torch.randn(len(scales), *shape) * torch.tensor(scales).view(-1, *[1] * len(shape))
    y = torch.randint(0, classes, (len(scales),))
    return model, x, y


def mixed_scales(name: str) -> tuple[float, ...]:
    """Inputs scaled by 100, 1 and 1e-3; two examples only on the 29M-parameter CIFAR net."""
    return (100.0, 1e-3) if name == "cifar10" else (100.0, 1.0, 1e-3)


def assert_close(got: dict, want: dict, scale: dict, rtol: float):
    """``||got_p - want_p|| <= rtol * scale_p`` per parameter, ``scale_p`` the size of the terms summed into it."""
    assert sorted(got) == sorted(want)
    for p in want:
        assert got[p].shape == want[p].shape, p
        err = (got[p].double() - want[p].double()).norm().item()
        assert err <= rtol * scale[p] + 1e-300, f"{p}: |diff| {err:.3e} > {rtol:g} * {scale[p]:.3e}"


def contribution_scale(per_ex: dict, ref: eo.ClippedSum) -> dict[str, float]:
    """``sum_i c_i ||G_{p,i}||``: a bound on ``||sum_i c_i G_{p,i}||`` that cancellation cannot shrink."""
    unit_of = {p: u for u, ps in ref.units for p in ps}
    return {p: (ref.factors[unit_of[p]] * g.flatten(1).norm(dim=1)).sum().item() for p, g in per_ex.items()}


# --- (a) per-example gradients ----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_per_example_grads_sum_to_batch_gradient(name):
    model, x, y = batch(name, mixed_scales(name))
    per_ex = eo.per_example_grads(model, x, y, eo.sum_cross_entropy)
    model64 = model.double()
    eo.sum_cross_entropy(model64(x.double()), y).backward()
    want = {n: p.grad for n, p in model64.named_parameters()}
    assert list(per_ex) == list(want)
    scale = {n: g.flatten(1).norm(dim=1).sum().item() for n, g in per_ex.items()}
    assert_close({n: g.sum(0) for n, g in per_ex.items()}, want, scale, rtol=1e-12)
    assert all(g.dtype == torch.float64 and g.shape == (len(x), *want[n].shape) for n, g in per_ex.items())


@pytest.mark.parametrize("name", ["odd_conv", "sequence_linear", "mnist"])
def test_per_example_grad_is_the_examples_own_gradient(name):
    """Catches a mix-up of examples, which the sum over the batch cannot see."""
    model, x, y = batch(name, mixed_scales(name))
    per_ex = eo.per_example_grads(model, x, y, eo.sum_cross_entropy)
    model64 = model.double()
    for i in range(len(x)):
        model64.zero_grad()
        eo.sum_cross_entropy(model64(x[i:i + 1].double()), y[i:i + 1]).backward()
        own = {n: p.grad for n, p in model64.named_parameters()}
        assert_close({n: g[i] for n, g in per_ex.items()}, own, {n: g.norm().item() for n, g in own.items()}, 1e-12)


def test_frozen_parameters_are_left_out():
    model, x, y = batch("odd_conv", (1.0, 2.0))
    model[0].bias.requires_grad_(False)
    per_ex = eo.per_example_grads(model, x, y)
    assert "0.bias" not in per_ex and "0.weight" in per_ex
    assert ("0", ["0.weight"]) in eo.layer_groups(model)


# --- layer groups -----------------------------------------------------------------------------------

def test_layer_groups_pair_weight_and_bias():
    model = eo.odd_conv_net()
    assert eo.layer_groups(model) == [("0", ["0.weight", "0.bias"]), ("2", ["2.weight"]),
                                      ("4", ["4.weight", "4.bias"]), ("6", ["6.weight"]),
                                      ("9", ["9.weight", "9.bias"])]


@pytest.mark.parametrize("name", list(MODELS))
def test_layer_groups_partition_the_parameters(name):
    model = MODELS[name][0]()
    groups = eo.layer_groups(model)
    assert [p for _, ps in groups for p in ps] == [n for n, _ in model.named_parameters()]
    modules = dict(model.named_modules())
    for layer, params in groups:
        assert all(p.rsplit(".", 1)[0] == layer for p in params)
        assert isinstance(modules[layer], (torch.nn.Linear, torch.nn.Conv2d))
    if name == "resnet20":
        assert len(groups) == 22  # 21 convolutions (3 of them 1x1 shortcuts) and one Linear


# --- (b) Opacus' clipping ---------------------------------------------------------------------------

CASES = {  # name: (scales of the inputs, threshold of each unit from its norms [B] over the batch)
    "B1-far-above": ((100.0,), lambda n: n.max() / 100),
    "B1-far-below": ((1e-3,), lambda n: n.max() * 100),
    "mixed": (None, lambda n: (n.min() * n.max()).sqrt()),
}
OPACUS_MODES = {"flat": "flat", "per_layer": "per_param"}  # Opacus' name -> the oracle's


@functools.lru_cache(maxsize=None)
def cached_batch(name: str, scales: tuple[float, ...]):
    """:func:`batch` and its per-example gradients, shared by the Opacus tests (the oracle copies the model)."""
    model, x, y = batch(name, scales)
    return model, x, y, eo.per_example_grads(model, x, y)


def opacus_case(name: str, case: str, opacus_clipping: str, dtype: torch.dtype):
    """Opacus' clipped sum and the oracle's, thresholds picked per unit so that the case holds."""
    scales, threshold_of = CASES[case]
    model, x, y, per_ex = cached_batch(name, scales or mixed_scales(name))
    groups = eo.layer_groups(model)
    clipping = OPACUS_MODES[opacus_clipping]
    norms = eo.clipped_sum(per_ex, groups, 1.0, clipping).norms
    thresholds = [threshold_of(n).item() for n in norms.values()]
    ref = eo.clipped_sum(per_ex, groups, thresholds, clipping, eps=OPACUS_EPS)
    mgn = thresholds[0] if opacus_clipping == "flat" else thresholds
    got = eo.opacus_clipped_sum(model, x, y, eo.sum_cross_entropy, mgn, opacus_clipping, dtype=dtype)
    return got, ref, contribution_scale(per_ex, ref)


def check_case_holds(case: str, ref: eo.ClippedSum):
    """The thresholds really put the examples where the case says (so the comparison tests clipping)."""
    factors = torch.stack(list(ref.factors.values()))
    if case == "B1-far-above":
        assert (factors < 0.011).all()
    elif case == "B1-far-below":
        assert (factors == 1).all()
    else:
        assert ((factors < 1).any(1) & (factors == 1).any(1)).all()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("opacus_clipping", list(OPACUS_MODES))
@pytest.mark.parametrize("name", list(MODELS))
def test_opacus_float64_matches_oracle(name, opacus_clipping, case):
    got, ref, scale = opacus_case(name, case, opacus_clipping, torch.float64)
    check_case_holds(case, ref)
    assert_close(got, ref.sums, scale, rtol=1e-9)


# Float32 on the CIFAR net is coarser, for two reasons measured on this CPU: torch's float32
# ``Tensor.norm`` over one example's 29.4M-element Linear weight is off by ~4e-4 relative (1.7e-3 on
# randn rows, where ``pow(2).sum().sqrt()`` is good to 5e-8) and Opacus takes its norms that way, so
# its clip factors are off by as much; and the first conv's gradient of the 1e-3-scaled example is a
# sum that cancels, so any float32 computation of it is good to only ~1e-2 of itself. The float64
# test above is the exact one.
FLOAT32_RTOL = {"cifar10": 5e-3}


@pytest.mark.parametrize("opacus_clipping", list(OPACUS_MODES))
@pytest.mark.parametrize("name", list(MODELS))
def test_opacus_float32_matches_oracle(name, opacus_clipping):
    got, ref, scale = opacus_case(name, "mixed", opacus_clipping, torch.float32)
    assert all(g.dtype == torch.float32 for g in got.values())
    assert_close(got, ref.sums, scale, rtol=FLOAT32_RTOL.get(name, 1e-5))


def test_opacus_epsilon_is_visible_in_float64():
    """Without Opacus' 1e-6 the float64 comparison fails on a small clipped gradient: it has the power to tell."""
    model, x, y = batch("mnist", (1e-3,))
    per_ex = eo.per_example_grads(model, x, y)
    groups = eo.layer_groups(model)
    n = eo.clipped_sum(per_ex, groups, 1.0, "flat").norms["all"].item()
    assert n < 0.1
    got = eo.opacus_clipped_sum(model, x, y, eo.sum_cross_entropy, n / 10, "flat", dtype=torch.float64)
    exact = eo.clipped_sum(per_ex, groups, n / 10, "flat")
    scale = contribution_scale(per_ex, exact)
    with pytest.raises(AssertionError):
        assert_close(got, exact.sums, scale, rtol=1e-9)
    assert_close(got, exact.sums, scale, rtol=2e-6 / n)


def test_opacus_per_layer_is_per_parameter_tensor():
    """Opacus' "per_layer" clips weight and bias apart: on a biased net it differs from clipping them together."""
    model, x, y = batch("odd_conv", (100.0,))
    per_ex = eo.per_example_grads(model, x, y)
    groups = eo.layer_groups(model)
    got = eo.opacus_clipped_sum(model, x, y, eo.sum_cross_entropy, 1e-3, "per_layer", dtype=torch.float64)
    per_param = eo.clipped_sum(per_ex, groups, 1e-3, "per_param", eps=OPACUS_EPS)
    per_layer = eo.clipped_sum(per_ex, groups, 1e-3, "per_layer", eps=OPACUS_EPS)
    assert_close(got, per_param.sums, contribution_scale(per_ex, per_param), rtol=1e-9)
    assert not torch.allclose(got["0.bias"], per_layer.sums["0.bias"].to(got["0.bias"]))


# --- (c) the definitions ----------------------------------------------------------------------------

def synthetic():
    """Two layers, three examples with hand-picked norms: example 0 has norm 0, example 2 norm 13 overall.

    Layer "a" (weight 2x2, bias 2) and layer "b" (weight 3): per-tensor norms of example 2 are
    3, 4, 12, so its layer norms are 5 and 12 and its flat norm 13.
    """
    g = {"a.weight": torch.zeros(3, 2, 2, dtype=torch.float64), "a.bias": torch.zeros(3, 2, dtype=torch.float64),
         "b.weight": torch.zeros(3, 3, dtype=torch.float64)}
    g["a.weight"][1, 0, 0], g["a.bias"][1, 1], g["b.weight"][1, 2] = 0.1, -0.2, 0.05
    g["a.weight"][2, 1, 1], g["a.bias"][2, 0], g["b.weight"][2] = 3.0, -4.0, torch.tensor([0.0, 12.0, 0.0])
    return g, [("a", ["a.weight", "a.bias"]), ("b", ["b.weight"])]


def test_norms_on_hand_picked_gradients():
    g, groups = synthetic()
    assert eo.clipped_sum(g, groups, 1.0, "flat").norms["all"][2].item() == 13.0
    assert [n[2].item() for n in eo.clipped_sum(g, groups, 1.0, "per_layer").norms.values()] == [5.0, 12.0]
    assert [n[2].item() for n in eo.clipped_sum(g, groups, 1.0, "per_param").norms.values()] == [3.0, 4.0, 12.0]


@pytest.mark.parametrize("clip_fn", eo.CLIP_FNS)
@pytest.mark.parametrize("clipping", ["flat", "per_layer", "per_param"])
def test_factors_follow_their_definitions(clipping, clip_fn):
    g, groups = synthetic()
    out = eo.clipped_sum(g, groups, 2.0, clipping, clip_fn=clip_fn, gamma=0.01)
    assert [u for u, _ in out.units] == list(out.factors) == list(out.norms)
    for unit, params in out.units:
        n, c, cap = out.norms[unit], out.factors[unit], out.thresholds[unit]
        assert cap == pytest.approx(2.0 / math.sqrt(len(out.units)))
        torch.testing.assert_close(n, torch.cat([g[p].flatten(1) for p in params], 1).norm(dim=1))
        if clip_fn == "clip":
            want = torch.where(n <= cap, torch.ones_like(n), cap / n)
            assert (c * n <= cap * (1 + 1e-15)).all()
        elif clip_fn == "global":
            want = (n <= cap).double()
        else:
            want = cap / (n + 0.01)
            assert (c * n < cap).all()
        torch.testing.assert_close(c, want, rtol=1e-15, atol=0)
        for p in params:
            torch.testing.assert_close(out.sums[p], (c.view(-1, *[1] * (g[p].dim() - 1)) * g[p]).sum(0))


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "per_param"])
def test_clipped_release_has_norm_at_most_C_per_example(clipping):
    """With C split as C/sqrt(U), each example's clipped gradient has total norm <= C in every mode."""
    g, groups = synthetic()
    out = eo.clipped_sum(g, groups, 1.5, clipping)
    unit_of = {p: u for u, ps in out.units for p in ps}
    clipped_sq = sum((out.factors[unit_of[p]] * t.flatten(1).norm(dim=1)) ** 2 for p, t in g.items())
    assert (clipped_sq.sqrt() <= 1.5 * (1 + 1e-12)).all()
    assert clipped_sq[2].sqrt().item() == pytest.approx(1.5)  # example 2 is clipped in every unit


def test_norm_exactly_at_the_threshold_is_kept():
    """``n == C`` is inside the ball: factor 1 under "clip" and "global" (``1[n <= C]``, not ``n < C``)."""
    g, groups = synthetic()
    for clip_fn in ("clip", "global"):
        assert eo.clipped_sum(g, groups, 13.0, "flat", clip_fn=clip_fn).factors["all"][2].item() == 1.0


def test_zero_gradient_is_kept_whole_or_normalized():
    g, groups = synthetic()
    assert eo.clipped_sum(g, groups, 1.0, "flat").factors["all"][0].item() == 1.0
    assert eo.clipped_sum(g, groups, 1.0, "flat", clip_fn="global").factors["all"][0].item() == 1.0
    assert eo.clipped_sum(g, groups, 1.0, "flat", clip_fn="normalize", gamma=0.5).factors["all"][0].item() == 2.0


def test_one_threshold_per_unit_as_given():
    g, groups = synthetic()
    out = eo.clipped_sum(g, groups, [2.0, 6.0], "per_layer")
    assert out.thresholds == {"a": 2.0, "b": 6.0}
    assert [f[2].item() for f in out.factors.values()] == [2.0 / 5.0, 6.0 / 12.0]
    with pytest.raises(ValueError, match="thresholds"):
        eo.clipped_sum(g, groups, [2.0, 6.0], "per_param")
    with pytest.raises(ValueError, match="cover"):
        eo.clipped_sum(g, groups[:1], 1.0, "flat")


def test_per_layer_equals_per_param_without_biases():
    """The MNIST net has no biases, so its layers are single tensors: the two modes must coincide."""
    model, x, y = batch("mnist", (100.0, 1e-3))
    per_ex = eo.per_example_grads(model, x, y)
    groups = eo.layer_groups(model)
    a = eo.clipped_sum(per_ex, groups, 0.1, "per_layer")
    b = eo.clipped_sum(per_ex, groups, 0.1, "per_param")
    assert all(torch.equal(a.sums[p], b.sums[p]) for p in per_ex)
