"""Finding 5 of issue 24: a loss that couples the examples of a batch breaks the per-example bound.

Every clipping mode clips example ``i``'s gradient of the *total* loss. With InfoNCE against a frozen
(public) encoder of paired data, the other examples of the batch are the negatives: example ``j``
changes ``∂L/∂out_i``. With hard-example mining (the sum of the top-k per-example losses) example
``j`` decides whether example ``i`` counts at all. Removing one example then moves the release by
more than ``C`` (measured here in float64 by differencing two releases with one explicit seed, so
the draw cancels: sampling rate 1, sum loss, flat clipping). ``make_private(..., criterion=)``
refuses such a criterion (:mod:`bpclip_fast.criterion`); per-example losses are accepted.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast
from bpclip_fast.engine import InsecureSeedWarning

C = 1.0
N, D_IN, D_PAIR, K = 6, 4, 5, 3


def encoder(dtype=torch.float32):
    """The frozen, public encoder of the paired data (not part of the private model)."""
    torch.manual_seed(1)
    return nn.Linear(D_PAIR, K, dtype=torch.float64).to(dtype).requires_grad_(False)


def infonce(frozen, reduction="sum"):
    """InfoNCE with in-batch negatives: example i's logits are z_i·e_j for every j of the batch."""
    def loss(z, paired):
        return F.cross_entropy(z @ frozen(paired).t(), torch.arange(len(z)), reduction=reduction)
    return loss


class InfoNCE(nn.Module):
    """The same loss as a module holding the frozen encoder (checked in float64 on a converted copy)."""

    def __init__(self):
        super().__init__()
        self.frozen = encoder()

    def forward(self, z, paired):
        return F.cross_entropy(z @ self.frozen(paired).t(), torch.arange(len(z)), reduction="sum")


def top_k(k=2, reduction="sum"):
    """Hard-example mining: the sum (or mean) of the k largest per-example losses."""
    def loss(out, y):
        worst = F.cross_entropy(out, y, reduction="none").topk(min(k, len(out))).values
        return worst.sum() if reduction == "sum" else worst.mean()
    return loss


def dataset(seed=7, dtype=torch.float32):
    """Inputs large enough that every example's gradient is clipped; seed 7 is one where example 0 is
    among the two hardest (so removing it changes the top-k) — any seed shows InfoNCE's coupling."""
    g = torch.Generator().manual_seed(seed)
    X = 5 * torch.randn(N, D_IN, generator=g, dtype=torch.float64)
    P = 3 * torch.randn(N, D_PAIR, generator=g, dtype=torch.float64)
    Y = torch.randint(0, K, (N,), generator=g)
    return X.to(dtype), P.to(dtype), Y


def make_private(X, T, *, dtype=torch.float32, loss_reduction="sum", **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, K, dtype=torch.float64)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DataLoader(TensorDataset(X, T), batch_size=len(X))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureSeedWarning)
        return bpclip_fast.PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, noise_seed=7, clipping="flat",
            max_grad_norm=C, loss_reduction=loss_reduction, **kw)


def release(X, T, loss_fn, **kw):
    """The gradient one step releases (lr = 1: minus the update), sum loss, every example in the batch."""
    model, opt, loader = make_private(X, T, dtype=X.dtype, **kw)
    before = [p.detach().clone() for p in model.parameters()]
    x, t = next(iter(loader))
    opt.zero_grad()
    loss_fn(model(x), t).backward()
    opt.step()
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])


def removal(loss_fn, T, X):
    """How far removing example 0 moves the release: same seed, so the draw cancels (float64)."""
    return (release(X, T, loss_fn) - release(X[1:], T[1:], loss_fn)).norm().item()


# ---------------------------------------------------------------- the danger, measured without the criterion


def test_coupled_losses_move_the_release_beyond_the_bound_when_accepted():
    """Without ``criterion=`` (what the engine cannot see) both coupled losses are accepted and one example
    moves the release by more than C (measured 1.24·C for InfoNCE, 1.40·C for top-2 of 6); the control,
    a per-example cross-entropy, stays within C. Given as ``criterion=``, both are refused."""
    X, P, Y = dataset(dtype=torch.float64)
    control = removal(lambda out, y: F.cross_entropy(out, y, reduction="sum"), Y, X)
    assert control <= C * (1 + 1e-9), f"control: a per-example loss moved the release by {control / C:.4f}·C"
    frozen = encoder(torch.float64)
    for name, loss_fn, T in (("InfoNCE", infonce(frozen), P), ("top-k", top_k(), Y)):
        move = removal(loss_fn, T, X)
        assert move > 1.1 * C, f"{name}: removing example 0 moved the release by only {move / C:.3f}·C"
        with pytest.raises(ValueError, match="coupled loss"):
            make_private(X, T, dtype=torch.float64, criterion=loss_fn)


# ---------------------------------------------------------------- refused


@pytest.mark.parametrize("kind, reduction", [("infonce", "sum"), ("infonce", "mean"), ("infonce-module", "sum"),
                                             ("top-k", "sum"), ("top-k", "mean")])
def test_a_coupled_criterion_is_refused_at_make_private(kind, reduction):
    X, P, Y = dataset()
    if kind == "infonce":
        loss_fn, T = infonce(encoder(), reduction), P
    elif kind == "infonce-module":
        loss_fn, T = InfoNCE(), P
    else:
        loss_fn, T = top_k(reduction=reduction), Y
    with pytest.raises(ValueError, match=r"criterion.*\(rule: coupled loss\).*negatives from public data") as info:
        make_private(X, T, loss_reduction=reduction, criterion=loss_fn)
    assert "the model cannot be trained privately" in str(info.value)


def test_the_criterion_is_checked_with_probe_off():
    X, P, _ = dataset()
    with pytest.raises(ValueError, match="coupled loss"):
        make_private(X, P, probe=False, criterion=infonce(encoder()))


def test_a_class_weighted_mean_is_refused():
    """``cross_entropy(weight=w)`` with reduction "mean" divides by Σ_i w[y_i], not by B (the gap of
    ``test_guarantee.py::test_extra_loss_with_a_data_dependent_normaliser_keeps_the_bound``, closed when
    the loss is given as the criterion)."""
    X, _, Y = dataset()
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 5.0, 25.0]))
    with pytest.raises(ValueError, match=r"not the mean of its values on each example alone.*coupled loss"):
        make_private(X, Y, loss_reduction="mean", criterion=weighted)


@pytest.mark.parametrize("declared, actual", [("sum", "mean"), ("mean", "sum")])
def test_a_criterion_whose_reduction_differs_from_loss_reduction_is_refused(declared, actual):
    X, _, Y = dataset()
    with pytest.raises(ValueError, match=f"pass loss_reduction='{actual}'"):
        make_private(X, Y, loss_reduction=declared, criterion=nn.CrossEntropyLoss(reduction=actual))


def gradient_coupled(out, y):
    """Its value is the per-example sum, but its backward hands each example its neighbour's output (as a
    straight-through trick or a batch-normalised gradient would): only the gradient comparison sees it."""
    return F.cross_entropy(out, y, reduction="sum") + ((out - out.detach()) * out.roll(1, 0).detach()).sum()


def test_a_criterion_coupled_through_its_gradient_only_is_refused():
    X, _, Y = dataset()
    with pytest.raises(ValueError, match=r"output gradient differs from the gradient of its own loss.*coupled loss"):
        make_private(X, Y, criterion=gradient_coupled)


def test_a_criterion_that_does_not_reduce_is_refused():
    X, _, Y = dataset()
    with pytest.raises(ValueError, match="not the scalar loss"):
        make_private(X, Y, criterion=nn.CrossEntropyLoss(reduction="none"))


# ---------------------------------------------------------------- accepted


def per_example_custom(out, y):
    """A per-example loss of our own: log(1 + squared distance to the one-hot target), summed."""
    return torch.log1p((out - F.one_hot(y, out.shape[1]).to(out.dtype)).pow(2).sum(1)).sum()


@pytest.mark.parametrize("name, loss_fn, reduction, target", [
    ("cross_entropy sum", lambda o, y: F.cross_entropy(o, y, reduction="sum"), "sum", "labels"),
    ("cross_entropy mean", lambda o, y: F.cross_entropy(o, y), "mean", "labels"),
    ("CrossEntropyLoss mean", nn.CrossEntropyLoss(), "mean", "labels"),
    ("MSELoss sum", nn.MSELoss(reduction="sum"), "sum", "vectors"),
    ("MSELoss mean", nn.MSELoss(), "mean", "vectors"),
    ("MSELoss mean over rows", lambda o, t: F.mse_loss(o, t, reduction="none").sum(1).mean(), "mean", "vectors"),
    ("per-example custom", per_example_custom, "sum", "labels"),
])
def test_a_per_example_criterion_is_accepted_and_trains(name, loss_fn, reduction, target):
    X, _, Y = dataset()
    T = Y if target == "labels" else torch.randn(N, K, generator=torch.Generator().manual_seed(3))
    model, opt, loader = make_private(X, T, loss_reduction=reduction, criterion=loss_fn)
    x, t = next(iter(loader))
    opt.zero_grad()
    loss_fn(model(x), t).backward()
    opt.step()


def test_the_probe_leaves_the_model_and_the_random_state_as_they_were():
    from bpclip_fast.criterion import criterion_problems

    X, P, _ = dataset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, K), nn.Dropout(0.5))
    loss_fn = infonce(encoder())  # before the state is saved: encoder() seeds the global generator
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    problems = criterion_problems(model, (X, P), loss_fn, "sum", rows=N)
    assert len(problems) == 1 and "coupled loss" in problems[0]
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and model.training


@pytest.mark.parametrize("loss_reduction, make_criterion", [
    ("mean", lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 1.0, 25.0]))),
    ("mean", lambda: nn.CrossEntropyLoss()),
    ("sum", lambda: top_k(reduction="sum")),
])
def test_the_verdict_does_not_depend_on_the_first_batchs_labels(loss_reduction, make_criterion):
    """The loader's labels are private: the probe draws its own classes, so two data sets that differ only
    in their labels get the same verdict, message for message. (A class-weighted mean whose first batch
    held only classes of weight 1 was accepted while the same data with another label was refused.)"""
    from bpclip_fast.criterion import criterion_problems

    X, _, _ = dataset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, K))
    verdicts = [criterion_problems(model, (X, labels), make_criterion(), loss_reduction, rows=N)
                for labels in (torch.zeros(N, dtype=torch.long), torch.full((N,), 2), torch.arange(N) % K)]
    assert verdicts[0] == verdicts[1] == verdicts[2]
