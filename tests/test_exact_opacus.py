"""Exactness against Opacus itself (noise off): our ``flat`` release equals Opacus' per-sample
clipping (``grad_sample_mode="hooks"``, ``DPOptimizer``) on the paper's MNIST and CIFAR-10 nets,
ResNet-20 without BatchNorm, a 3-D-input Linear stack and a net of grouped, depthwise, dilated and
strided convolutions; ``per_layer`` equals Opacus' ``clipping="per_layer"`` where the two define
the same thing (Opacus clips each parameter tensor, we clip each layer's ``[W, b]``: the bias-free
MNIST net), and the torch.func oracle elsewhere. Batches of one and of three, with examples far
above and far below the threshold. All in float64, so that the comparison is the algorithms'
(Opacus' own factor is ``C/(n + 1e-6)``; the oracle with ``eps=1e-6`` reproduces it, see
tests/test_exact_oracle.py, and our release equals the oracle with ``eps=0``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from bpclip_fast import nn as bnn
import exact_oracle as eo

MODELS = eo.models()


def batch(name, n, seed=0):
    _, shape, classes = MODELS[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g, dtype=torch.float64)
    scales = torch.tensor([100.0, 1e-3, 1.0][:n], dtype=torch.float64)
    return x * scales.view(-1, *[1] * len(shape)), torch.randint(0, classes, (n,), generator=g)


def ours(net, x, y, clipping, c):
    model = copy.deepcopy(net)
    bnn.convert_model(model, clipping=clipping, max_grad_norm=c)
    eo.sum_cross_entropy(model(x), y).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def assert_same(a, b, scale, what):
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-8, atol=1e-10 * scale, msg=f"{what}: {k}")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n", [1, 3])
def test_flat_equals_opacus_and_the_oracle(name, n):
    if name == "cifar10" and n > 2:
        n = 2  # 29.6M parameters: Opacus materialises B copies of the gradient
    torch.manual_seed(0)
    net = MODELS[name][0]().double()
    x, y = batch(name, n)
    per_ex = eo.per_example_grads(net, x, y)
    groups = eo.layer_groups(net)
    c = 0.5 * float(min(sum(v[i].pow(2).sum() for v in per_ex.values()).sqrt() for i in range(n)))
    c = max(c, 1e-3)
    got = ours(net, x, y, "flat", c)
    assert_same(got, eo.clipped_sum(per_ex, groups, c, "flat").sums, c, f"{name} oracle")
    opacus = eo.opacus_clipped_sum(net, x, y, eo.sum_cross_entropy, c, "flat", dtype=torch.float64)
    assert_same(opacus, eo.clipped_sum(per_ex, groups, c, "flat", eps=1e-6).sums, c, f"{name} opacus")
    assert_within_opacus_eps(got, opacus, eo.clipped_sum(per_ex, groups, c, "flat"), per_ex)


def assert_within_opacus_eps(got, opacus, ref, per_ex):
    """Ours against Opacus directly: Opacus' factor C/(n+1e-6) differs from C/n by at most
    c·1e-6/n, so the releases differ by at most Σ_i (1e-6/n_i)·c_i‖G_i‖ (and 1e-9 of it for float64)."""
    for unit, params in ref.units:
        budget = sum(1e-6 / float(ref.norms[unit][i]) * float(ref.factors[unit][i]) *
                     float(sum(per_ex[p][i].pow(2).sum() for p in params).sqrt())
                     for i in range(len(ref.norms[unit])))
        gap = float(sum((got[p] - opacus[p]).pow(2).sum() for p in params).sqrt())
        assert gap <= budget * (1 + 1e-6) + 1e-12, f"{unit}: ours vs Opacus {gap:.3g} > {budget:.3g}"


@pytest.mark.parametrize("name", [m for m in MODELS if m != "cifar10"])
def test_per_layer_equals_the_oracle_and_opacus_where_they_agree(name):
    torch.manual_seed(0)
    net = MODELS[name][0]().double()
    x, y = batch(name, 3)
    per_ex = eo.per_example_grads(net, x, y)
    groups = eo.layer_groups(net)
    got = ours(net, x, y, "per_layer", 0.8)
    assert_same(got, eo.clipped_sum(per_ex, groups, 0.8, "per_layer").sums, 0.8, name)
    if name == "mnist":  # no biases: one parameter per layer, so Opacus' per-parameter clipping is ours
        opacus = eo.opacus_clipped_sum(net, x, y, eo.sum_cross_entropy, 0.8, "per_layer", dtype=torch.float64)
        assert_within_opacus_eps(got, opacus, eo.clipped_sum(per_ex, groups, 0.8, "per_layer"), per_ex)
