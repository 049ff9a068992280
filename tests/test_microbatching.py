"""Micro-batching with a mean loss (README, "Micro-batching"; issue 26, the newcomer's path).

Under ``loss_reduction="mean"`` every backward over ``d`` rows clips at ``C/d`` and rescales by
``d/B̄`` (proof in bpclip_fast/engine/__init__.py), so each micro-batch's loss is its own plain
mean and the step releases the clipped mean over the whole batch
(tests/test_exact_engine.py::test_release_is_the_clipped_mean_plus_one_draw_of_std_sigma_c).

The habit of non-private gradient accumulation, ``loss / n_micro``, cannot be detected (a constant
factor on the loss is indistinguishable from a model whose gradients are that much smaller), so
the README states what it does instead; these tests pin that statement against float64 truth:
the release is ``(1/k)·(1/B̄)(Σ_i clip(G_i; k·C) + N(0, σ²C²))``, i.e. the run at
``max_grad_norm = k·C`` with the learning rate divided by ``k``: still within the privacy claim
(each example moves it by at most ``C/B̄``, the noise is unchanged), but examples whose gradient is
below ``k·C`` count ``k`` times less than intended against the same noise.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from test_exact_engine import C, clipped_sum, exact_private, per_example
from test_guarantee import SEED, SEED2, data, mlp, moved, snapshot

K = 3  # micro-batches
N = 6


def habit_step(model, opt, loader, k=K):
    """The non-private habit: every micro-batch's mean loss divided by the number of micro-batches."""
    x, y = next(iter(loader))
    opt.zero_grad()
    with opt.accumulate():
        for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
            (F.cross_entropy(model(xm), ym) / k).backward()
    opt.step()


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_the_readme_loop_with_uneven_micro_batches_releases_the_clipped_mean(mode):
    """The README's loop: ``x.split(m)``, so the last micro-batch is smaller (3, 3, 1 here); each
    micro-batch's own plain mean, no division; the release is Σ_i c_i G_i / B̄ in float64 truth."""
    n = 7
    X, Y = data(n=n)
    net = mlp()
    expect = clipped_sum(per_example(copy.deepcopy(net).double(), X.double(), Y), mode, C)
    model = copy.deepcopy(net)
    _, model, opt, loader = exact_private(model, X, Y, mode, seed=SEED, sigma=1e-20)
    before = snapshot(model)
    x, y = next(iter(loader))
    assert [len(m) for m in x.split(3)] == [3, 3, 1]
    opt.zero_grad()
    with opt.accumulate():
        for xm, ym in zip(x.split(3), y.split(3)):
            F.cross_entropy(model(xm), ym).backward()
    opt.step()
    for k, v in moved(model, before).items():
        torch.testing.assert_close(-v.double(), expect[k] / n, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_dividing_by_the_number_of_micro_batches_is_the_run_at_k_times_the_clip_bound(mode):
    X, Y = data(n=N)
    net = mlp()
    grads = per_example(copy.deepcopy(net).double(), X.double(), Y)
    habit = {k: v / K for k, v in clipped_sum(grads, mode, K * C).items()}
    intended = clipped_sum(grads, mode, C)
    model = copy.deepcopy(net)
    _, model, opt, loader = exact_private(model, X, Y, mode, seed=SEED, sigma=1e-20)
    before = snapshot(model)
    habit_step(model, opt, loader)
    released = {k: -v.double() for k, v in moved(model, before).items()}
    for k in released:  # fp32 release of a 6-8-3 net: rounding well below 1e-4 relative
        torch.testing.assert_close(released[k], habit[k] / N, rtol=1e-4, atol=1e-6)
    # and not what the loop meant: some examples' gradients lie below k·C here
    norms = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    assert (norms < K * C).any()
    gap = max(float((released[k] - intended[k] / N).abs().max()) for k in released)
    assert gap > 1e-3


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_dividing_by_the_number_of_micro_batches_keeps_the_noise(mode):
    """The noise std stays σC/B̄ (two seeds differenced, as in test_exact_engine): the habit costs
    signal, not privacy."""
    X, Y = data(n=N)
    net = mlp(h=64)  # 643 coordinates
    noise = []
    for seed in (SEED, SEED2):
        model = copy.deepcopy(net)
        _, model, opt, loader = exact_private(model, X, Y, mode, seed=seed, sigma=50.0)
        before = snapshot(model)
        habit_step(model, opt, loader)
        noise.append(torch.cat([v.flatten() for v in moved(model, before).values()]))
    std = float((noise[0] - noise[1]).std() / math.sqrt(2))
    # the sample std of 643 coordinates has a relative standard error of 1/√(2·643) ≈ 2.8%: 15% is
    # over five of them
    assert std == pytest.approx(50.0 * C / N, rel=0.15)
