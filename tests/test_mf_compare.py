"""bench.mf_compare: the sensitivity against brute force, the error proxy against dense float64."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.linalg import solve_triangular

from bench import mf_compare as mf
from bpclip_fast.banded import bsr_coefficients

U = np.finfo(np.float64).eps / 2  # unit roundoff


def _gamma(k):
    return k * U / (1 - k * U)


def _bisr_column(b, beta, T):
    return mf.series_inverse(mf.power_series(b, beta, -0.5), T)


def _pattern_bounds(C, pattern):
    """The sup over ``‖g_i‖ ≤ 1`` of ``‖Σ_i C e_{t_i} ⊗ g_i‖_F`` lies in ``[lower, upper]``:
    ``lower`` from scalar ``g_i = ±1`` (attainable), ``upper = sqrt(Σ_ij |G_ij|)`` (any unit vectors),
    ``G`` the Gram of the pattern's columns. No sign condition on ``C`` is assumed."""
    cols = C[:, list(pattern)]
    G = cols.T @ cols
    upper = math.sqrt(float(np.abs(G).sum()))
    lower = max(np.linalg.norm(cols @ np.array(s)) for s in itertools.product((1.0, -1.0), repeat=len(pattern)))
    return lower, upper


def _fixed_patterns(T, sep):
    return [tuple(range(t0, T, sep)) for t0 in range(sep)]


def _min_separated_patterns(T, sep):
    """Every non-empty subset of ``range(T)`` whose gaps are all ``>= sep``."""
    out = []

    def grow(p):
        if p:
            out.append(tuple(p))
        for t in range((p[-1] + sep) if p else 0, T):
            grow(p + [t])

    grow([])
    return out


T_SMALL, SEP = 12, 3
STRATEGIES = ([("bisr", b, beta) for b in (2, 4, 16) for beta in (0.0, 0.9)]
              + [("bsr", b, beta) for b in (3, 4) for beta in (0.0, 0.9)])


def _column(kind, b, beta, T):
    if kind == "bisr":
        return _bisr_column(b, beta, T)
    return np.asarray(bsr_coefficients(b, beta))


# The relative error of a 12-term Gram sum and one norm in float64: far below 1e-12.
REL = 4 * _gamma(T_SMALL * T_SMALL)


@pytest.mark.parametrize("kind,b,beta", STRATEGIES)
def test_fixed_separation_sensitivity_is_the_brute_force_maximum(kind, b, beta):
    c = _column(kind, b, beta, T_SMALL)
    C = mf.toeplitz(c, T_SMALL)
    sens = mf.fixed_separation_sensitivity(c, T_SMALL, SEP)
    bounds = [_pattern_bounds(C, p) for p in _fixed_patterns(T_SMALL, SEP)]
    assert max(up for _, up in bounds) <= sens * (1 + REL)  # no pattern, no g_i above it
    assert sens <= bounds[0][0] * (1 + REL)  # attained, by the earliest pattern with equal g_i


@pytest.mark.parametrize("kind,b,beta", STRATEGIES)
def test_earliest_pattern_also_dominates_min_separated_patterns(kind, b, beta):
    """The stronger claim (Kalinin & Lampert 2024, non-negative non-increasing columns): any
    participation with gaps >= sep, any number of times, is below the earliest fixed pattern."""
    c = _column(kind, b, beta, T_SMALL)
    assert (c >= 0).all() and (np.diff(c) <= 0).all()  # the claim's conditions hold for this C
    C = mf.toeplitz(c, T_SMALL)
    sens = mf.fixed_separation_sensitivity(c, T_SMALL, SEP)
    worst = max(_pattern_bounds(C, p)[1] for p in _min_separated_patterns(T_SMALL, SEP) if len(p) <= 4)
    assert worst <= sens * (1 + REL)


def test_brute_force_finds_a_larger_min_separated_pattern_when_columns_increase():
    """The check above can fail: with a non-monotone (still non-negative) column, a pattern of gap
    4 lines the bumps up and beats the earliest gap-3 pattern (at least 3 against sqrt 7); the fixed-
    separation formula stays right (only shifts of the one pattern exist there)."""
    c = np.array([1.0, 0, 0, 0, 1.0])
    C = mf.toeplitz(c, T_SMALL)
    sens = mf.fixed_separation_sensitivity(c, T_SMALL, SEP)
    assert sens == pytest.approx(math.sqrt(7), rel=REL)
    worst = max(_pattern_bounds(C, p)[1] for p in _min_separated_patterns(T_SMALL, SEP) if len(p) <= 4)
    assert worst >= 3.0 > sens * (1 + REL)  # e.g. 0, 4, 8: ‖(1, …, 2, …, 2, …)‖ = 3
    assert max(_pattern_bounds(C, p)[1] for p in _fixed_patterns(T_SMALL, SEP)) <= sens * (1 + REL)


def test_sensitivity_refuses_a_negative_strategy():
    with pytest.raises(ValueError, match="negative entry"):
        mf.fixed_separation_sensitivity(np.array([1.0, -0.5, 0.25]), 6, 2)


@pytest.mark.parametrize("b", mf.BANDS)
@pytest.mark.parametrize("beta", mf.MOMENTA)
def test_bisr_strategies_of_the_table_meet_the_conditions(b, beta):
    """C ≥ 0 exactly: m_0 = 1 and m_j ≤ 0 for j ≥ 1, so c_t = Σ_j |m_j| c_{t−j} ≥ 0 (a renewal
    sequence); non-increasing checked on the float64 columns at the largest T of the table."""
    m = mf.power_series(b, beta, -0.5)
    assert m[0] == 1.0 and (m[1:] <= 0).all()
    c = mf.series_inverse(m, max(T for *_, T in mf.SETTINGS))
    assert (c >= 0).all() and (np.diff(c) <= 0).all()


@pytest.mark.parametrize("beta", mf.MOMENTA)
def test_rmse_of_the_identity_is_sigma_times_the_workload_norm(beta):
    T, sigma = 300, 2.5
    A = mf.toeplitz(mf.workload_series(T, beta), T)
    # A's entries are β^(t−s)-sums ≤ 1/(1−β); ‖A‖_F by numpy's norm and by the Toeplitz formula
    # are two float64 sums of T² positive terms: relative error ≤ 2γ_{T²} between them.
    expected = sigma * np.linalg.norm(A) / math.sqrt(T)
    got = mf.rmse(sigma, 1.0, mf.workload_series(T, beta), T)
    assert got == pytest.approx(expected, rel=4 * _gamma(T * T))
    if beta == 0:  # ‖ones‖_F² = T(T+1)/2 exactly
        assert got == pytest.approx(sigma * math.sqrt((T + 1) / 2), rel=4 * _gamma(T * T))
    row = mf.compare(1167, 32, T, beta, 3.0, bands=())[0]
    assert row["mechanism"] == "DP-SGD" and row["sens"] == 1.0
    assert row["rmse"] == pytest.approx(row["sigma"] * np.linalg.norm(A) / math.sqrt(T), rel=4 * _gamma(T * T))


@pytest.mark.parametrize("beta", mf.MOMENTA)
def test_rmse_is_invariant_under_scaling_the_strategy(beta):
    T, sep, b, alpha = 200, 7, 8, 3.7
    a = mf.workload_series(T, beta)
    m = mf.power_series(b, beta, -0.5)
    base = mf.fixed_separation_sensitivity(mf.series_inverse(m, T), T, sep) * mf.toeplitz_frobenius(
        np.convolve(a, m)[:T], T)
    scaled = mf.fixed_separation_sensitivity(mf.series_inverse(m / alpha, T), T, sep) * mf.toeplitz_frobenius(
        np.convolve(a, m / alpha)[:T], T)
    assert scaled == pytest.approx(base, rel=16 * _gamma(T * b))


@pytest.mark.parametrize("b", (4, 16, 64))
@pytest.mark.parametrize("beta", mf.MOMENTA)
def test_bsr_error_term_three_ways(b, beta):
    """‖A C⁻¹‖_F for BSR's C at the digits horizon: by solving X C = A (scipy), by A·inv(C) with
    inv(C) from solves, and by the module's series. Tolerance, first order (Higham Thm 8.5: a
    triangular solve is backward stable with |ΔC| ≤ γ_T|C|): solve ‖γ_T |X||C||C⁻¹|‖_F; inverse
    ‖γ_T |A||C⁻¹||C||C⁻¹|‖_F + ‖γ_T |A||C⁻¹|‖_F; series (the same forward substitution, then a
    convolution and the Toeplitz sum) the inverse's bound again plus γ_{2T}‖X‖_F; ×2 for the
    second-order terms."""
    T = 720
    c = np.asarray(bsr_coefficients(b, beta))
    C = mf.toeplitz(c, T)
    A = mf.toeplitz(mf.workload_series(T, beta), T)
    X1 = solve_triangular(C.T, A.T, lower=False).T
    Cinv = solve_triangular(C, np.eye(T), lower=True)
    X2 = A @ Cinv
    x3 = mf.toeplitz_frobenius(np.convolve(mf.workload_series(T, beta), mf.series_inverse(c, T))[:T], T)
    aC, aCi, aA = np.abs(C), np.abs(Cinv), np.abs(A)
    g = _gamma(T)
    e1 = g * np.linalg.norm(np.abs(X1) @ aC @ aCi)
    e2 = g * np.linalg.norm(aA @ aCi @ aC @ aCi) + g * np.linalg.norm(aA @ aCi)
    e3 = e2 + _gamma(2 * T) * np.linalg.norm(X1)
    n1, n2 = np.linalg.norm(X1), np.linalg.norm(X2)
    assert abs(n1 - n2) <= 2 * (e1 + e2)
    assert abs(x3 - n1) <= 2 * (e1 + e3)
    assert e1 + e3 < 1e-6 * n1  # the tolerance is a real test, not a blanket


@pytest.mark.parametrize("beta", mf.MOMENTA)
def test_workload_is_the_square_of_the_engines_strategy(beta):
    """The workload is the one whose square root the engine's ``bsr_coefficients`` takes:
    ``c(x)² = a(x)`` for the unnormalised series, and ``bsr_coefficients`` is its normalised head.
    Coefficients ≤ 1/(1−β) ≤ 10, sums of ≤ T products: tolerance γ_T·10·T relative."""
    T = 64
    half = mf.power_series(T, beta, 0.5)
    a = mf.workload_series(T, beta)
    np.testing.assert_allclose(np.convolve(half, half)[:T], a, rtol=10 * T * _gamma(T), atol=0)
    np.testing.assert_allclose(np.asarray(bsr_coefficients(T, beta)), half / np.linalg.norm(half),
                               rtol=10 * T * _gamma(T), atol=0)
    inv_half = mf.power_series(T, beta, -0.5)  # BISR's series is the inverse square root
    np.testing.assert_allclose(np.convolve(inv_half, half)[:T], np.eye(T)[0], rtol=0, atol=10 * T * _gamma(T))
