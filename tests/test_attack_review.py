"""Adversarial review of the issue-24 fixes: ordinary loops and inputs that still break the guarantee.

Each test measures a breach the way issue 24 did (difference of two releases with one explicit
noise seed on D and D minus example 0, sampling rate 1, sum loss, float64, against C), or shows
that a check meant to refuse the situation accepts it. A test marked ``xfail(strict=True)`` is a
breach not yet fixed (its reason names the root cause).
"""

from __future__ import annotations

import sys
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_coupled_loss import C, dataset as coupled_dataset, make_private as coupled_private, removal  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------- criterion probe: NaN on a batch of one


def standardised_logits(out, y):
    """Cross-entropy of the logits standardised over the batch (a batch-norm on the outputs): it
    couples every example with every other; on a batch of one its std is NaN."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that std() of one row has no degrees of freedom
        z = (out - out.mean(0)) / out.std(0)
    return F.cross_entropy(z, y, reduction="sum")


def test_a_criterion_not_finite_on_one_example_is_not_accepted_unchecked():
    """The probe gave "no verdict" (accepted) when the criterion was finite on the batch but not on
    each example alone; batch statistics make exactly that happen. Accepted, one example moves the
    release by 3.0·C (seed 28, example 0 scaled up: an outlier shifts the others' standardisation)."""
    X, _, Y = coupled_dataset(seed=28, dtype=torch.float64)
    X[0] *= 20
    move = removal(standardised_logits, Y, X)
    assert move > 2 * C, f"removing example 0 moved the release by only {move / C:.3f}·C"
    with pytest.raises(ValueError, match=r"criterion.*coupled loss"):
        coupled_private(X, Y, dtype=torch.float64, criterion=standardised_logits)


# ---------------------------------------------------------------- DDP: layers built by hand with per-rank bounds


def _hand_built(rank, case):
    """A model whose clipped layer the user built, with a bound that differs on rank 1 (one edited
    constant, a config read per rank): make_private compares its own arguments only."""
    from torch import nn

    from bpclip_fast import nn as bnn

    torch.manual_seed(1)
    if case == "backprop":
        layer = bnn.Linear(64, 10, input_clip=2.0, grad_clip=0.5 if rank == 0 else 50.0)
        kw = dict(input_clip=2.0, grad_clip=0.5)
    else:
        layer = bnn.Linear(64, 10, clipping="per_layer", max_grad_norm=0.7 if rank == 0 else 70.0)
        kw = dict(clipping="per_layer", max_grad_norm=0.7)
    return nn.Sequential(nn.Flatten(), layer), kw


def _hand_built_worker(rank, port, out_dir):
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from bpclip_fast import PrivacyEngine
    from bpclip_fast import nn as bnn
    from test_distributed import SEED, dataset, init_gloo

    init_gloo(rank, port)
    try:
        for case in ("backprop", "per_layer"):
            model, kw = _hand_built(rank, case)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            result = {"error": None}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    PrivacyEngine().make_private(module=model, optimizer=opt,
                                                 data_loader=DataLoader(dataset(), batch_size=6),
                                                 noise_multiplier=0.8, noise_seed=SEED, **kw)
                except Exception as exc:  # noqa: BLE001
                    result["error"] = f"{type(exc).__name__}: {exc}"
            layer = [m for m in model.modules() if isinstance(m, bnn._Clipped)][0]
            result["sensitivity"] = float(layer.sensitivity) if result["error"] is None else None
            torch.save(result, os.path.join(out_dir, f"{case}_rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def hand_built_runs(tmp_path_factory):
    from test_distributed import WORLD, spawn

    out = spawn(tmp_path_factory.mktemp("hand_built"), worker=_hand_built_worker)
    return {case: [torch.load(out / f"{case}_rank{r}.pt", weights_only=True) for r in range(WORLD)]
            for case in ("backprop", "per_layer")}


@pytest.mark.parametrize("case", ["backprop", "per_layer"])
def test_ddp_ranks_with_hand_built_layers_of_other_bounds_are_refused(hand_built_runs, case):
    """Rank 0 alone draws the noise, scaled to *its* layers' Δ; rank 1's layer clips to 100x that
    bound (its examples move the all-reduced release by up to 100·Δ against noise σΔ). The agreement
    check of make_private compares the arguments of make_private, not the clipped layers the user
    built, which keep their own bounds (convert_model leaves them as they are)."""
    ranks = hand_built_runs[case]
    for rank, r in enumerate(ranks):
        assert r["error"] is not None, (f"rank {rank} was made private (Δ per rank: "
                                        f"{[x['sensitivity'] for x in ranks]})")
        assert "clipped layers built by hand is rank 0:" in r["error"] and "same full dataset" in r["error"], r["error"]
    assert ranks[0]["error"] == ranks[1]["error"]


# ---------------------------------------------------------------- budget: a charged refusal before the first batch


def test_shuffled_refusal_before_the_first_batch_is_refused_and_charged():
    """Shuffled batches (zCDP): a charged refusal (here a parameter unfrozen after make_private,
    found by the model's forward) before the loop drew any batch crashed in the accountant's charge
    (``None + 1``: no batch index yet) with a TypeError: not a StepRefused, nothing charged, nothing
    discarded. It must be refused and charged like any other (one step, epoch 0's)."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import bpclip_fast
    from bpclip_fast.engine import InsecureSeedWarning

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    model[1].requires_grad_(False)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
    engine = bpclip_fast.PrivacyEngine(accountant="zcdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureSeedWarning)
        model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=4),
                                                 noise_multiplier=1.0, input_clip=1.0, grad_clip=1.0,
                                                 poisson_sampling=False, noise_seed=1)
    model[1].weight.requires_grad_(True)
    with pytest.raises(bpclip_fast.StepRefused) as info:
        model(torch.randn(2, 4))
    assert info.value.rule == "unclipped-param" and info.value.charged
    assert len(engine.accountant) == 1
    assert model[1].weight.grad is None
