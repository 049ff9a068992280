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
