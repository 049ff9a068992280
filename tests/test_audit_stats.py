"""bpclip_fast.audit.stats: the one-run bound, Clopper–Pearson, the many-run bound, power.

The soundness checks simulate mechanisms whose ε is known exactly (randomised response, the
Gaussian mechanism) and count how often the bound claims more than that ε."""

import dataclasses
import json
import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import binom, binomtest, norm

from bpclip_fast.audit import stats as S


def _tail(r, v, eps):
    """P[Binom(r, e^eps/(1+e^eps)) >= v], summed term by term."""
    p = math.exp(eps) / (1 + math.exp(eps))
    return sum(math.comb(r, j) * p ** j * (1 - p) ** (r - j) for j in range(v, r + 1))


# ---------------------------------------------------------------------------------------- p-value
@pytest.mark.parametrize("r,v,eps", [(50, 40, 0.5), (50, 50, 2.0), (30, 10, 1.0), (1, 1, 0.0), (40, 0, 3.0)])
def test_p_value_at_delta_0_is_the_binomial_tail(r, v, eps):
    assert S.one_run_p_value(100, r, v, eps, 0.0) == pytest.approx(_tail(r, v, eps), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("m,r,v,delta", [(1000, 100, 90, 1e-3), (200, 200, 150, 1e-4), (60, 60, 60, 1e-2)])
def test_p_value_delta_term_matches_the_theorem(m, r, v, delta):
    # f(v) + 2 m delta max_i (f(v-i) - f(v)) / i, from the term-by-term tail
    f = [_tail(r, k, 1.3) for k in range(v + 1)]
    want = min(1.0, f[v] + 2 * m * delta * max((f[v - i] - f[v]) / i for i in range(1, v + 1)))
    got = S.one_run_p_value(m, r, v, 1.3, delta)
    assert got == pytest.approx(want, rel=1e-9)
    assert got > S.one_run_p_value(m, r, v, 1.3, 0.0)          # the delta term only adds
    assert S.one_run_p_value(m, r, v, 1.3, 2 * delta) >= got


@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-3])
def test_p_value_increases_with_epsilon(delta):
    # a less private mechanism makes many right guesses more plausible: larger eps, weaker rejection
    ps = [S.one_run_p_value(1000, 500, 400, e, delta) for e in np.linspace(0, 3, 61)]
    assert all(b >= a for a, b in zip(ps, ps[1:]))
    assert ps[0] < 0.05 and ps[-1] == pytest.approx(1.0, abs=1e-3)


# ---------------------------------------------------------------------------------------- epsilon
@pytest.mark.parametrize("m,r,v,delta,alpha", [
    (1000, 500, 400, 0.0, 0.05), (1000, 500, 400, 1e-5, 0.05), (1000, 100, 100, 1e-5, 0.01),
    (10000, 1000, 700, 1e-6, 0.05 / 6), (100, 100, 100, 1e-2, 0.05), (1000, 1000, 540, 0.0, 0.05)])
def test_epsilon_inverts_the_p_value(m, r, v, delta, alpha):
    eps = S.one_run_epsilon(m, r, v, delta, alpha)
    assert eps > 0
    p = S.one_run_p_value(m, r, v, eps, delta)
    assert p <= alpha * (1 + 1e-9) and p == pytest.approx(alpha, rel=1e-6)
    assert S.one_run_p_value(m, r, v, eps - 1e-3, delta) < alpha     # below: rejected
    assert S.one_run_p_value(m, r, v, eps + 1e-3, delta) > alpha     # above: not rejected


def test_epsilon_edge_cases():
    assert S.one_run_epsilon(100, 0, 0, 1e-5, 0.05) == 0.0            # no guesses
    assert S.one_run_epsilon(100, 50, 0, 1e-5, 0.05) == 0.0           # none right
    assert S.one_run_epsilon(100, 10, 6, 0.0, 0.05) == 0.0            # eps = 0 not rejected
    assert S.one_run_p_value(100, 10, 6, 0.0, 0.0) > 0.05
    assert S.one_run_epsilon(10, 10, 10, 0.05, 0.05) == 0.0           # 2 m delta swamps it
    # all right, delta = 0: (e^eps/(1+e^eps))^r = alpha in closed form
    assert S.one_run_epsilon(100, 100, 100, 0.0, 0.05) == pytest.approx(math.log(0.05 ** 0.01 / (1 - 0.05 ** 0.01)))


# ---------------------------------------------------------------------------------------- one-run soundness
@pytest.mark.parametrize("eps0,delta", [(1.0, 0.0), (2.0, 0.0), (1.0, 1e-3)])
def test_one_run_bound_exact_false_claim_rate(eps0, delta):
    """An (eps0, delta)-DP mechanism: each canary's bit is published exactly w.p. delta, else by
    eps0-randomised response. Every guess is right independently w.p. q, so the chance that the bound
    exceeds eps0 is an exact binomial sum: at most alpha, and close to it at delta = 0 where the
    theorem is tight (randomised response is its worst case)."""
    r, alpha = 1000, 0.05
    q = delta + (1 - delta) * math.exp(eps0) / (1 + math.exp(eps0))
    lb = {}

    def bound(v):
        if v not in lb:
            lb[v] = S.one_run_epsilon(r, r, v, delta, alpha)
        return lb[v]

    lo, hi = 0, r                      # the bound grows with v: bisect for the first v claiming > eps0
    assert bound(hi) > eps0 >= bound(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if bound(mid) > eps0 else (mid, hi)
    seen = [lb[v] for v in sorted(lb)]
    assert seen == sorted(seen)
    false_claim = binom.sf(hi - 1, r, q)
    assert false_claim <= alpha
    if delta == 0:
        assert false_claim > 0.8 * alpha           # observed 0.045-0.050: the bound is tight


def test_one_run_audit_randomised_response_simulation():
    """200 one-run audits of eps0-randomised response (delta = 0), m = 1000, default grid.
    Observed (seed 0): 5/200 audits above eps0 = 1 (each time at k = 500); median bound 0.76,
    max 1.12; the power at m = 1000 is 4.64."""
    rng = np.random.default_rng(0)
    eps0, m, runs = 1.0, 1000, 200
    included = rng.random((runs, m)) < 0.5
    truthful = rng.random((runs, m)) < math.exp(eps0) / (1 + math.exp(eps0))
    scores = (included == truthful).astype(float)          # the published bit
    lbs = np.array([S.one_run_audit(s, i, delta=0.0).epsilon for s, i in zip(scores, included)])
    assert np.mean(lbs > eps0) <= 0.05 + 0.02
    assert np.median(lbs) > 0.6 * eps0                      # reasonably tight


# ---------------------------------------------------------------------------------------- one-run audit
def test_one_run_audit_rows_and_bonferroni():
    rng = np.random.default_rng(1)
    m = 500
    included = rng.random(m) < 0.5
    scores = included + rng.normal(0, 1.5, m)
    res = S.one_run_audit(scores, included, delta=1e-5, confidence=0.9)
    ks = [row.guesses for row in res.table]
    assert ks == list(S.default_guess_counts(m)) == [5, 10, 25, 50, 100, 250]
    assert res.alpha_per_count == pytest.approx(0.1 / len(ks))
    order = sorted(range(m), key=lambda i: (scores[i], i))
    for row in res.table:
        k = row.guesses
        top, bottom = order[m - (k - k // 2):], order[:k // 2]
        assert row.correct == sum(included[i] for i in top) + sum(not included[i] for i in bottom)
        assert row.epsilon == S.one_run_epsilon(m, k, row.correct, 1e-5, res.alpha_per_count)
    assert res.epsilon == max(row.epsilon for row in res.table) <= res.power
    assert (res.guesses, res.correct) in [(row.guesses, row.correct) for row in res.table]
    d = res.to_dict()
    assert json.loads(json.dumps(d)) == d and len(d["table"]) == len(ks)
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.epsilon = 9.0


def test_one_run_ties_go_by_index():
    # equal scores: "in" on the highest indices, "out" on the lowest, whatever the membership
    included = np.array([0, 0, 1, 1, 0, 1, 1, 0, 1, 1], bool)
    res = S.one_run_audit(np.zeros(10), included, delta=0.0, guess_counts=[4])
    assert res.table[0].correct == included[-2:].sum() + (~included[:2]).sum()


def test_one_run_power_is_reached_by_perfect_separation():
    rng = np.random.default_rng(2)
    for m in (200, 1000):
        included = rng.random(m) < 0.5
        res = S.one_run_audit(10.0 * included + rng.random(m), included, delta=1e-5)
        assert res.epsilon == res.power == S.one_run_power(m, delta=1e-5)
        assert all(row.correct == row.guesses for row in res.table)
    powers = [S.one_run_power(m, delta=1e-5) for m in (100, 1000, 10000)]
    assert powers[0] < powers[1] < powers[2]
    assert S.one_run_power(1000, delta=0.0, confidence=0.99) < S.one_run_power(1000, delta=0.0)


def test_one_run_m_larger_than_scored():
    # abstentions on unscored canaries: the grid comes from m and is clipped to the scores there are
    included = np.arange(40) % 2 == 0
    res = S.one_run_audit(included.astype(float), included, m=1000, delta=1e-6)
    assert [row.guesses for row in res.table] == [10, 20, 40]
    assert res.m == 1000 and res.power == S.one_run_power(1000, delta=1e-6, guess_counts=[10, 20, 40])


# ---------------------------------------------------------------------------------------- Clopper–Pearson
@pytest.mark.parametrize("k,n,alpha", [(0, 10, 0.05), (3, 10, 0.05), (10, 10, 0.05), (17, 200, 0.01), (1, 1, 0.2)])
def test_clopper_pearson_against_scipy(k, n, alpha):
    ub, lb = S.clopper_pearson_upper(k, n, alpha), S.clopper_pearson_lower(k, n, alpha)
    assert ub == pytest.approx(binomtest(k, n, alternative="less").proportion_ci(1 - alpha, "exact").high, abs=1e-12)
    assert lb == pytest.approx(binomtest(k, n, alternative="greater").proportion_ci(1 - alpha, "exact").low, abs=1e-12)
    if k < n:
        assert binom.cdf(k, n, ub) == pytest.approx(alpha, rel=1e-8)   # the defining tail
    if k > 0:
        assert binom.sf(k - 1, n, lb) == pytest.approx(alpha, rel=1e-8)


def test_clopper_pearson_coverage_exact():
    # P[rate > upper(K)] for K ~ Binom(n, rate), summed exactly: <= alpha for every rate
    n, alpha = 200, 0.05
    ubs = np.array([S.clopper_pearson_upper(k, n, alpha) for k in range(n + 1)])
    for rate in (0.001, 0.02, 0.1, 0.37, 0.5):
        assert binom.pmf(np.flatnonzero(ubs < rate), n, rate).sum() <= alpha


# ---------------------------------------------------------------------------------------- many runs
def _gdp_epsilon(mu, delta):
    """eps(delta) of mu-GDP, from delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    f = lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta
    return brentq(f, 0.0, 100.0)


def test_many_run_gaussian_soundness():
    """200 audits of the Gaussian mechanism (mu = 1, 1000 runs each side, delta = 0.1, true eps 1.16).
    Observed (seed 3): 0/200 above the true eps; median bound 0.61, max 1.11. (At delta = 1e-5,
    true eps 4.38, the median bound is 1.12: 500 evaluation runs a side cannot see that far into
    the tails.)"""
    rng = np.random.default_rng(3)
    mu, delta, n, audits = 1.0, 0.1, 1000, 200
    true_eps = _gdp_epsilon(mu, delta)
    lbs = np.array([S.many_run_audit(rng.normal(mu, 1, n), rng.normal(0, 1, n), delta=delta, rng=rng).epsilon
                    for _ in range(audits)])
    assert np.mean(lbs > true_eps) <= 0.05 + 0.02
    assert np.median(lbs) > 0.4 * true_eps


def test_many_run_randomised_response_soundness():
    """One canary under eps0-randomised response: the score is the published bit, and the threshold
    test at 1/2 meets eps0 exactly in the population, so here the bound is nearly tight and a wrong
    union bound or level would show. 500 audits, 2000 runs a side, eps0 = 2, delta = 0.
    Observed (seed 6): 1.8% above eps0; median bound 1.85."""
    rng = np.random.default_rng(6)
    eps0, n = 2.0, 2000
    p0 = math.exp(eps0) / (1 + math.exp(eps0))
    lbs = np.array([S.many_run_audit((rng.random(n) < p0) * 1.0, (rng.random(n) >= p0) * 1.0, delta=0.0,
                                     rng=rng).epsilon for _ in range(500)])
    assert np.mean(lbs > eps0) <= 0.05 + 0.015
    assert np.median(lbs) > 0.85 * eps0


def test_many_run_power_and_separation():
    rng = np.random.default_rng(4)
    res = S.many_run_audit(10 + rng.random(300), rng.random(200), delta=1e-5, rng=rng)
    assert res.false_positives == res.false_negatives == 0
    assert res.epsilon == res.power == S.many_run_power(300, 200, delta=1e-5)
    assert 1 < res.threshold < 10 and (res.n_eval_in, res.n_eval_out) == (150, 100)
    # clearly separated Gaussians (mu = 8): close to the power
    eps = [S.many_run_audit(rng.normal(8, 1, 400), rng.normal(0, 1, 400), delta=1e-5, rng=rng).epsilon
           for _ in range(10)]
    assert min(eps) >= 0.9 * S.many_run_power(400, 400, delta=1e-5)
    powers = [S.many_run_power(n, n, delta=1e-5) for n in (20, 200, 2000)]
    assert powers[0] < powers[1] < powers[2]
    d = res.to_dict()
    assert json.loads(json.dumps(d)) == d


def test_many_run_power_closed_form():
    # zero errors on e runs: the CP upper bound at alpha/2 is 1 - (alpha/2)^(1/e)
    for n_in, n_out, delta, conf, split in [(300, 200, 1e-5, 0.95, 0.5), (1000, 1000, 0.0, 0.99, 0.3)]:
        e_in, e_out = n_in - math.floor(split * n_in), n_out - math.floor(split * n_out)
        fpr, fnr = 1 - ((1 - conf) / 2) ** (1 / e_out), 1 - ((1 - conf) / 2) ** (1 / e_in)
        want = max(math.log((1 - delta - fnr) / fpr), math.log((1 - delta - fpr) / fnr))
        assert S.many_run_power(n_in, n_out, delta=delta, confidence=conf, split=split) == pytest.approx(want)


def test_many_run_threshold_is_not_tuned_on_the_evaluated_runs():
    """No signal (the same distribution in and out, true eps = 0) and 200 candidate thresholds. At a
    low confidence (0.5) the Clopper-Pearson margins are thin, so a threshold tuned on the runs it
    is evaluated on finds a lucky one: any positive bound is a false claim, allowed w.p. <= 0.5.
    Observed (seed 8, 400 audits): 6.5% positive with the split; 72% when tuned on all the runs."""
    rng = np.random.default_rng(8)
    lbs = [S.many_run_audit(rng.normal(0, 1, 100), rng.normal(0, 1, 100), delta=0.0, confidence=0.5,
                            rng=rng).epsilon for _ in range(400)]
    assert np.mean(np.array(lbs) > 0) <= 0.5


def test_many_run_no_signal_and_reproducible():
    rng = np.random.default_rng(5)
    a, b = rng.normal(0, 1, 500), rng.normal(0, 1, 500)
    r1 = S.many_run_audit(a, b, delta=1e-5, rng=7)
    assert r1 == S.many_run_audit(a, b, delta=1e-5, rng=7)
    assert r1.epsilon < 0.5
    # the orientation is the caller's: "out" runs scoring higher certify nothing
    r2 = S.many_run_audit(rng.random(200), 10 + rng.random(200), delta=1e-5, rng=0)
    assert r2.epsilon == 0.0 and r2.direction == "none"
    # which inequality gives the bound: a rare, certain "in" signal bounds through 1 - FNR vs FPR,
    # a rare, certain "out" signal through 1 - FPR vs FNR
    hi = np.where(rng.random(2000) < 0.5, 5.0, 0.0)
    r3 = S.many_run_audit(hi, np.zeros(2000), delta=0.0, rng=0)
    r4 = S.many_run_audit(np.zeros(2000), -hi, delta=0.0, rng=0)
    assert (r3.direction, r4.direction) == ("tpr/fpr", "tnr/fnr") and r3.epsilon > 0.5 and r4.epsilon > 0.5


# ---------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("call,match", [
    (lambda: S.one_run_p_value(10, 11, 5, 1.0, 0.0), "guesses"),
    (lambda: S.one_run_p_value(10, 5, 6, 1.0, 0.0), "correct"),
    (lambda: S.one_run_p_value(10, 5, 3, -1.0, 0.0), "epsilon"),
    (lambda: S.one_run_p_value(10, 5, 3, 1.0, 1.0), "delta"),
    (lambda: S.one_run_p_value(10, 5, 3, 1.0, -0.1), "delta"),
    (lambda: S.one_run_p_value(10, 5.5, 3, 1.0, 0.0), "guesses"),
    (lambda: S.one_run_epsilon(10, 5, 3, 0.0, 0.0), "alpha"),
    (lambda: S.one_run_audit([1.0, 2.0], [True], delta=0.0), "included"),
    (lambda: S.one_run_audit([1.0, np.nan], [True, False], delta=0.0), "scores"),
    (lambda: S.one_run_audit([1.0, 2.0], [2, 0], delta=0.0), "included"),
    (lambda: S.one_run_audit([1.0, 2.0], [True, False], delta=0.0, confidence=1.0), "confidence"),
    (lambda: S.one_run_audit([1.0, 2.0], [True, False], delta=0.0, confidence=0.0), "confidence"),
    (lambda: S.one_run_audit([1.0, 2.0], [True, False], m=1, delta=0.0), "m"),
    (lambda: S.one_run_audit([1.0, 2.0], [True, False], delta=0.0, guess_counts=[3]), "guess_counts"),
    (lambda: S.one_run_power(100, delta=0.0, guess_counts=[0]), "guess_counts"),
    (lambda: S.many_run_audit([1.0, 2.0], [1.0, np.inf], delta=0.0), "scores_out"),
    (lambda: S.many_run_audit([], [1.0, 2.0], delta=0.0), "scores_in"),
    (lambda: S.many_run_audit([1.0], [1.0, 2.0], delta=0.0), "scores_in"),
    (lambda: S.many_run_audit([1.0, 2.0], [1.0, 2.0], delta=0.0, split=1.0), "split"),
    (lambda: S.many_run_audit([1.0, 2.0], [1.0, 2.0], delta=0.0, confidence=2), "confidence"),
    (lambda: S.many_run_power(10, 10, delta=1.5), "delta"),
    (lambda: S.clopper_pearson_upper(5, 4, 0.05), "k"),
    (lambda: S.clopper_pearson_lower(1, 4, 1.0), "alpha"),
])
def test_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()
