"""The RDP accountant's warning about orders dp_accounting cannot evaluate (issue 26).

dp_accounting's series for fractional orders below 2 does not converge for moderate sample
rates and small noise multipliers and returns RDP = ∞ there; those orders then take no part in
the minimum over orders. That is always sound (ε is an upper bound), and it changes nothing when
no left-out order could have been the best: then a warning only alarms. It must still warn where
a left-out order could have given a smaller ε.

References: ε computed here by calling dp_accounting directly (the previous code's arithmetic)
and Opacus' RDP accountant, which evaluates every fractional order by its own series.
"""

import logging
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("dp_accounting")
from dp_accounting import NeighboringRelation, PoissonSampledDpEvent, GaussianDpEvent  # noqa: E402
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp  # noqa: E402

from bpclip_fast import PrivacyEngine  # noqa: E402
from bpclip_fast.accounting import OPACUS_RDP_ORDERS, RDPAccountant, get_noise_multiplier  # noqa: E402

MESSAGE = "could not evaluate"


def dpa_epsilon(sigma, q, n, delta):
    """ε from dp_accounting alone, with the same orders (left-out orders are ∞ there too)."""
    acc = dpa_rdp.RdpAccountant(orders=list(OPACUS_RDP_ORDERS),
                                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
    logger = logging.getLogger("absl")
    level, _ = logger.level, logger.setLevel(logging.ERROR)
    try:
        acc.compose(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), n)
    finally:
        logger.setLevel(level)
    assert np.isinf(acc._rdp).any(), "the setting must leave orders out, or the test proves nothing"
    return acc.get_epsilon(delta)


def opacus_epsilon(sigma, q, n, delta):
    from opacus.accountants import RDPAccountant as OpacusRDP
    acc = OpacusRDP()
    acc.history = [(sigma, q, n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return acc.get_epsilon(delta)


def accountant(sigma, q, n):
    acc = RDPAccountant()
    acc._append(sigma, q, n)
    return acc


def rdp_warnings(record):
    return [w for w in record if MESSAGE in str(w.message)]


# Settings that leave fractional orders out, at ordinary ε (the digits example at σ = 1, or
# per-layer noise split over 4 layers; a q = 0.125 run): no left-out order can be the best.
HARMLESS = [(1.0, 128 / 1437, 220, 1e-5), (0.7, 0.05, 40, 1e-5), (1.0, 0.125, 16, 1e-5),
            (1.5, 0.2, 50, 1e-6)]


@pytest.mark.parametrize("sigma,q,n,delta", HARMLESS)
def test_no_warning_where_left_out_orders_cannot_matter(sigma, q, n, delta):
    from opacus.accountants.analysis.rdp import compute_rdp
    acc = accountant(sigma, q, n)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        eps = acc.get_epsilon(delta)
    assert rdp_warnings(record) == []
    # ε is unchanged: exactly dp_accounting's over the same orders ...
    assert eps == dpa_epsilon(sigma, q, n, delta)
    # ... and the left-out orders, at their true RDP (Opacus' series, which converges there and
    # matches numerical integration), give no smaller ε: they could not have been the best.
    left_out = np.isinf(acc.rdp)
    orders = np.asarray(acc.orders)[left_out]
    true_rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=n, orders=list(orders))
    assert dpa_rdp.compute_epsilon(orders, true_rdp, delta)[0] > eps
    # never below the ε of every order evaluated by Opacus (dp_accounting's fractional-order
    # series is the larger where they differ)
    assert eps >= opacus_epsilon(sigma, q, n, delta) * (1 - 1e-12)


def test_warning_kept_where_a_left_out_order_can_be_the_best():
    # q = 0.5, σ = 2, 100 steps: Opacus' best order is below 2, where dp_accounting gives up.
    sigma, q, n, delta = 2.0, 0.5, 100, 1e-5
    with pytest.warns(RuntimeWarning, match=MESSAGE):
        eps = accountant(sigma, q, n).get_epsilon(delta)
    assert eps == dpa_epsilon(sigma, q, n, delta)
    theirs = opacus_epsilon(sigma, q, n, delta)
    assert theirs < eps  # the case the warning is about: ours is the larger (still an upper bound)


def test_lower_bound_of_left_out_orders_is_below_their_true_epsilon():
    """The warning's test compares ε with a lower bound of what each left-out order could give.
    Check that bound against Opacus' RDP at those orders (an independent series that converges)."""
    from opacus.accountants.analysis.rdp import compute_rdp
    for sigma, q, n in [(2.0, 0.5, 100), (1.0, 0.1, 1000), (0.5, 0.05, 500), (1.0, 0.3, 10)]:
        acc = accountant(sigma, q, n)
        rdp = acc.rdp
        left_out = np.isinf(rdp)
        assert left_out.any()
        floor = acc._rdp_floor()
        true_rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=n,
                               orders=list(np.asarray(acc.orders)[left_out]))
        assert np.all(floor <= true_rdp)


def test_calibration_warns_only_for_the_noise_it_returns():
    # The search tries σ = 1 first, which leaves orders out at q = 0.125 (and is far from the
    # answer); the σ it returns does not need them.
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.125, steps=16)
    assert rdp_warnings(record) == []
    assert accountant(sigma, 0.125, 16).get_epsilon(1e-5) <= 3.0
    # where the returned σ itself is affected, the warning is kept
    with pytest.warns(RuntimeWarning, match=MESSAGE):
        get_noise_multiplier(target_epsilon=15.0, target_delta=1e-5, sample_rate=0.5, steps=100)


def test_ordinary_make_private_run_is_silent():
    """make_private_with_epsilon, a few steps, get_epsilon: the newcomer's first run."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 8), torch.randint(0, 3, (256,))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    engine = PrivacyEngine()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, optimizer, loader = engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0,
            target_delta=1e-5, epochs=2, clipping="flat", max_grad_norm=1.0)
        for _ in range(2):
            for xb, yb in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                optimizer.step()
        eps = engine.get_epsilon(1e-5)
    assert rdp_warnings(record) == [], [str(w.message) for w in record]
    assert eps <= 3.0
    sigma = engine.effective_noise_multiplier
    assert eps == accountant(sigma, 32 / 256, engine.steps).get_epsilon(1e-5)
    assert math.isclose(eps, opacus_epsilon(sigma, 32 / 256, engine.steps, 1e-5), rel_tol=1e-3)
