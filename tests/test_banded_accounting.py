"""Accounting of amplified BandMF with cyclic Poisson sampling (``bands=b``).

References, none of them our own earlier output: Google's dp_accounting called directly on the
reduction's events (``⌈T/b⌉`` Poisson-subsampled Gaussians at the group rate ``q_g``), a brute
force over every step's cyclic position, and the published expected values of jax_privacy's
``DpsgdTrainingAccountant`` with ``cycle_length`` (google-deepmind/jax_privacy,
jax_privacy/accounting/analysis_test.py, ``DpsgdTrainingAccountantCycleLengthTest``).
"""

import math

import numpy as np
import pytest

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import (ComposedDpEvent, GaussianDpEvent, NeighboringRelation,  # noqa: E402
                           PoissonSampledDpEvent, SelfComposedDpEvent)
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant as DpaPLD  # noqa: E402
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp  # noqa: E402

from bpclip_fast.accounting import (PLDAccountant, RDPAccountant, ZCDPAccountant,  # noqa: E402
                                    get_noise_multiplier, make_accountant)
from bpclip_fast.accounting.cyclic import position_counts, worst_positions  # noqa: E402

ADD_REMOVE = NeighboringRelation.ADD_OR_REMOVE_ONE
OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def event(history):
    return ComposedDpEvent([SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(s)), n)
                            for s, q, n in history])


def rdp_truth(history, delta, orders=OPACUS_ORDERS):
    """ε of one composition, straight from dp_accounting (no code of ours)."""
    acc = dpa_rdp.RdpAccountant(orders=list(orders), neighboring_relation=ADD_REMOVE)
    acc.compose(event(history))
    return acc.get_epsilon(delta)


def pld_truth(history, delta, interval=1e-4):
    acc = DpaPLD(neighboring_relation=ADD_REMOVE, value_discretization_interval=interval)
    acc.compose(event(history))
    return acc.get_epsilon(delta), acc


def loaded(acc, history):
    acc.load_state_dict({"mechanism": acc.mechanism, "config": {"bands": acc.bands},
                         "history": [tuple(h) for h in history]})
    return acc


def brute_positions(history, b):
    """Each position's history by walking every step (independent of position_counts' arithmetic)."""
    per = [[] for _ in range(b)]
    k = 0
    for sigma, q, n in history:
        counts = [0] * b
        for _ in range(n):
            counts[k % b] += 1
            k += 1
        for p in range(b):
            if counts[p]:
                per[p].append((sigma, q, counts[p]))
    return per


# --------------------------------------------------------------------------- b = 1 is unchanged

@pytest.mark.parametrize("history", [[(1.0, 0.01, 1000)], [(0.7, 0.2, 13)], [(3.0, 0.001, 12345)],
                                     [(1.1, 0.05, 40), (2.0, 0.1, 7), (1.1, 0.05, 3)]])
def test_bands_1_rdp_is_bit_for_bit_the_dp_sgd_accountant(history):
    """The accountant's definition before bands existed: the sum over entries of n times one step's
    RDP (dp_accounting on one PoissonSampled Gaussian), converted by dp_accounting.compute_epsilon."""
    orders = np.asarray(OPACUS_ORDERS)
    total = np.zeros(len(orders))
    for sigma, q, n in history:
        one = dpa_rdp.RdpAccountant(orders=list(orders), neighboring_relation=ADD_REMOVE)
        one.compose(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)))
        total = total + n * one.rdp
    for delta in (1e-5, 1e-3):
        expected = float(dpa_rdp.compute_epsilon(orders, total, delta)[0])
        for acc in (RDPAccountant(), RDPAccountant(bands=1), make_accountant("rdp", bands=1)):
            loaded(acc, history)
            assert acc.get_epsilon(delta) == expected
            assert np.array_equal(acc.rdp, total)


@pytest.mark.parametrize("history", [[(1.0, 0.01, 300)], [(0.9, 0.2, 13)],
                                     [(1.1, 0.05, 40), (2.0, 0.1, 7)]])
def test_bands_1_pld_is_bit_for_bit_the_dp_sgd_accountant(history):
    for delta in (1e-5, 1e-3):
        expected, truth = pld_truth(history, delta)
        acc = loaded(PLDAccountant(bands=1), history)
        assert acc.get_epsilon(delta) == expected
        assert acc.get_delta(1.0) == truth.get_delta(1.0)
        assert acc.dp_event() == event(history)


# --------------------------------------------------------------------------- b > 1, one (σ, q)

# (σ, q_g, T, b): T a multiple of b, not a multiple, T < b, a large b
UNIFORM = [(1.0, 0.1, 100, 4), (2.0, 0.05, 103, 4), (0.8, 0.2, 7, 10), (4.0, 0.02, 1001, 64),
           (1.5, 0.3, 97, 3)]


@pytest.mark.parametrize("sigma,q,T,b", UNIFORM)
def test_uniform_history_is_ceil_T_over_b_events_rdp(sigma, q, T, b):
    reduced = [(sigma, q, math.ceil(T / b))]
    acc = RDPAccountant(bands=b)
    for _ in range(T):  # through the public step()
        acc.step(noise_multiplier=sigma, sample_rate=q)
    assert len(acc) == T
    for delta in (1e-5, 1e-2):
        assert acc.get_epsilon(delta) == rdp_truth(reduced, delta)
    assert acc.dp_event() == event(reduced)


@pytest.mark.parametrize("sigma,q,T,b", UNIFORM[:3])
def test_uniform_history_is_ceil_T_over_b_events_pld(sigma, q, T, b):
    reduced = [(sigma, q, math.ceil(T / b))]
    acc = loaded(PLDAccountant(bands=b), [(sigma, q, T)])
    for delta in (1e-5, 1e-2):
        expected, truth = pld_truth(reduced, delta)
        assert acc.get_epsilon(delta) == expected
    assert acc.get_delta(0.5) == truth.get_delta(0.5)
    # and it is a real change: b steps cost what one DP-SGD step at q_g costs, not b of them
    plain = loaded(PLDAccountant(), [(sigma, q, T)])
    assert plain.get_epsilon(1e-5) > acc.get_epsilon(1e-5) or T < 2


def test_epsilon_after_and_max_steps_count_cyclic_events():
    sigma, q, b = 1.0, 0.1, 4
    acc = loaded(RDPAccountant(bands=b), [(sigma, q, 10)])
    # 10 steps -> 3 events at position 0; 3 more (13 steps) -> 4 events
    assert acc.epsilon_after(1e-5, noise_multiplier=sigma, sample_rate=q, num_steps=3) == \
        rdp_truth([(sigma, q, 4)], 1e-5)
    assert len(acc) == 10
    target = rdp_truth([(sigma, q, 30)], 1e-5)  # exactly 30 events fit; the 31st does not
    k = acc.max_steps(target, 1e-5, noise_multiplier=sigma, sample_rate=q)
    assert math.ceil((10 + k) / b) == 30 and math.ceil((10 + k + 1) / b) == 31


# --------------------------------------------------------------------------- non-uniform histories

def test_position_counts_by_hand():
    # b = 5; run A = steps 0..6, run B = steps 7..12 (T = 13)
    history = [(1.0, 0.1, 7), (0.7, 0.2, 6)]
    # positions:   0: A{0,5} B{10}; 1: A{1,6} B{11}; 2: A{2} B{7,12}; 3: A{3} B{8}; 4: A{4} B{9}
    hand = np.array([[2, 1], [2, 1], [1, 2], [1, 1], [1, 1]])
    assert np.array_equal(position_counts(history, 5), hand)
    assert sorted(worst_positions(history, 5)) == sorted(
        [[(1.0, 0.1, 1), (0.7, 0.2, 2)], [(1.0, 0.1, 2), (0.7, 0.2, 1)]])
    assert brute_positions(history, 5) == [[(1.0, 0.1, c[0]), (0.7, 0.2, c[1])] for c in hand.tolist()]


@pytest.mark.parametrize("history,b", [
    ([(1.0, 0.1, 7), (0.7, 0.2, 6)], 5),
    ([(0.8, 0.3, 3), (2.0, 0.05, 42)], 5),  # positions 0-2: 1 + 8 steps, 3-4: 0 + 9: the fewer steps are worse
    ([(1.2, 0.1, 9), (0.9, 0.1, 4), (1.2, 0.1, 11)], 4),  # A B A: runs of one position merge
    ([(1.0, 0.1, 3), (0.8, 0.2, 2)], 8),        # T < b: some positions have no step
])
def test_non_uniform_history_is_the_worst_of_all_positions(history, b):
    positions = [p for p in brute_positions(history, b) if p]
    # a coarser PLD grid on both sides (the comparison is of the same computation, not of the grid)
    truths = [pld_truth(p, 1e-5, interval=1e-3)[1] for p in positions]
    rdp = loaded(RDPAccountant(bands=b), history)
    pld = loaded(PLDAccountant(value_discretization_interval=1e-3, bands=b), history)
    for delta in (1e-5, 1e-2):
        assert rdp.get_epsilon(delta) == max(rdp_truth(p, delta) for p in positions)
        assert pld.get_epsilon(delta) == max(t.get_epsilon(delta) for t in truths)
    assert pld.get_delta(1.0) == max(t.get_delta(1.0) for t in truths)
    if history[0] == (0.8, 0.3, 3):  # neither position dominates: the one with fewer σ=2 steps is the worst
        with_a = [p for p in positions if len(p) == 2]
        without_a = [p for p in positions if len(p) == 1]
        assert with_a and without_a and without_a[0][0][2] > with_a[0][1][2]
        assert rdp.get_epsilon(1e-5) == rdp_truth(with_a[0], 1e-5) > rdp_truth(without_a[0], 1e-5)
    # the RDP curve reported bounds every position's, order by order
    for p in positions:
        one = dpa_rdp.RdpAccountant(orders=OPACUS_ORDERS, neighboring_relation=ADD_REMOVE)
        one.compose(event(p))
        assert np.all(rdp.rdp >= one.rdp * (1 - 1e-12))


def test_non_uniform_history_through_step_matches_loaded():
    b, history = 3, [(1.0, 0.1, 5), (0.8, 0.2, 4), (1.0, 0.1, 2)]
    acc = RDPAccountant(bands=b)
    for sigma, q, n in history:
        for _ in range(n):
            acc.step(noise_multiplier=sigma, sample_rate=q)
    assert acc.history == history
    assert acc.get_epsilon(1e-5) == loaded(RDPAccountant(bands=b), history).get_epsilon(1e-5)


# --------------------------------------------------------------------------- checkpoints, errors

def test_state_dict_round_trip_and_bands_mismatch_refused():
    for cls in (RDPAccountant, PLDAccountant):
        acc = loaded(cls(bands=3), [(1.0, 0.1, 10), (0.8, 0.2, 5)])
        state = acc.state_dict()
        assert state["config"] == {"bands": 3}
        fresh = cls(bands=3)
        fresh.load_state_dict(state)
        assert fresh.history == acc.history and fresh.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
        for other in (1, 2):
            with pytest.raises(ValueError, match="bands=3.*bands=%d" % other):
                cls(bands=other).load_state_dict(state)
        # a state from before bands existed is a bands=1 run: a banded accountant refuses it
        old = {"mechanism": acc.mechanism, "history": [(1.0, 0.1, 10)]}
        with pytest.raises(ValueError, match="bands=1"):
            cls(bands=3).load_state_dict(old)
        cls().load_state_dict(old)
        cls(bands=1).load_state_dict(dict(old, config={}))


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2", None, float("nan")])
def test_bad_bands_refused(bad):
    for make in (lambda: RDPAccountant(bands=bad), lambda: PLDAccountant(bands=bad),
                 lambda: make_accountant("rdp", bands=bad)):
        with pytest.raises(ValueError, match="bands"):
            make()
    with pytest.raises(ValueError, match="bands"):
        get_noise_multiplier(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.1, steps=10, bands=bad)


def test_zcdp_refuses_bands():
    assert ZCDPAccountant(bands=1).bands == 1
    for make in (lambda: ZCDPAccountant(bands=2), lambda: make_accountant("zcdp", bands=4)):
        with pytest.raises(ValueError, match="bands=.*zCDP"):
            make()
    with pytest.raises(ValueError, match="bands"):
        get_noise_multiplier(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.1, steps=10,
                             accountant="zcdp", bands=2)


# --------------------------------------------------------------------------- calibration

@pytest.mark.parametrize("accountant,T,b,q", [("rdp", 1000, 8, 0.05), ("rdp", 99, 10, 0.2),
                                              ("pld", 60, 4, 0.1)])
def test_calibration_inverse(accountant, T, b, q):
    target, delta, tol = 2.0, 1e-5, 0.01
    sigma = get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=q, steps=T,
                                 accountant=accountant, bands=b, epsilon_tolerance=tol)
    acc = loaded(make_accountant(accountant, bands=b), [(sigma, q, T)])
    eps = acc.get_epsilon(delta)
    assert target - tol <= eps <= target
    # the banded search sees, σ by σ, the ε of ⌈T/b⌉ DP-SGD steps: the same answer exactly
    assert sigma == get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=q,
                                         steps=math.ceil(T / b), accountant=accountant,
                                         epsilon_tolerance=tol)


def test_calibration_epochs_count_b_over_q_steps_per_epoch():
    q, b = 0.05, 8  # an epoch is N/B = b·m/B = b/q_g steps
    kw = dict(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, bands=b)
    assert get_noise_multiplier(epochs=3, **kw) == get_noise_multiplier(steps=int(3 * b / q), **kw)
    # b = 1 keeps the old epochs -> steps rule
    assert get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, epochs=3) == \
        get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, steps=int(3 / q))


# --------------------------------------------------------------------------- a published number

# jax_privacy (google-deepmind/jax_privacy, jax_privacy/accounting/analysis_test.py,
# DpsgdTrainingAccountantCycleLengthTest): cycle_length=64, num_samples=50_000·64, batch_size=1024,
# noise_multiplier=4, num_updates=10_000·64, delta=1e-5 give _EPSILON_RDP = 2.27535 (its
# RdpAccountantConfig orders) and _EPSILON_PLD = 2.09245 (PLD, value_discretization_interval 1e-4),
# asserted there with rtol=1e-5; test_uneven_multiples: num_samples=50_000·64+63 and
# num_updates=9_999·64+1 give the same 2.27535 (the group size is still 50_000, ⌈T/64⌉ = 10_000).
JAX_PRIVACY_ORDERS = np.concatenate((np.linspace(1.01, 8, num=50), np.arange(8, 64),
                                     np.linspace(65, 512, num=10, dtype=int)))
B, CYCLE, SIGMA = 1024, 64, 4.0


@pytest.mark.parametrize("n,T", [(50_000 * CYCLE, 10_000 * CYCLE),
                                 (50_000 * CYCLE + CYCLE - 1, 9_999 * CYCLE + 1)])
def test_published_jax_privacy_cycle_length_rdp(n, T):
    q_g = B / (n // CYCLE)
    acc = loaded(RDPAccountant(orders=JAX_PRIVACY_ORDERS, bands=CYCLE), [(SIGMA, q_g, T)])
    assert acc.get_epsilon(1e-5) == pytest.approx(2.27535, rel=1e-5)


def test_published_jax_privacy_cycle_length_pld():
    q_g = B / 50_000
    acc = loaded(PLDAccountant(bands=CYCLE), [(SIGMA, q_g, 10_000 * CYCLE)])
    assert acc.get_epsilon(1e-5) == pytest.approx(2.09245, rel=1e-5)


def test_a_position_without_guarantee_is_not_hidden_by_max():
    from bpclip_fast.accounting.poisson import _worst
    nan = float("nan")
    assert _worst([2.0, nan]) != _worst([2.0, nan]) and _worst([nan, 2.0]) != _worst([nan, 2.0])
    assert max([2.0, nan]) == 2.0  # what a plain max would have reported
    assert _worst([(1.0, 3.0), (nan, 2.0)], key=lambda ea: ea[0])[1] == 2.0
    assert _worst([1.0, 3.0, 2.0]) == 3.0
