"""Why the banded noise stores ``b−1`` rows instead of regenerating them: the MF error proxy, measured.

    python -m bench.mf_compare [--accountant rdp|pld]

Issue 27 asked for noise ``Σ_{j<b} m_j z_{t−j}`` regenerated from the Philox keys with no stored
rows: ``C⁻¹`` banded instead of ``C`` (``bpclip_fast/banded.py``'s docstring says why we did not).
This compares, for the issue's regimes (``SETTINGS``: digits and MNIST-1D as swept in
``docs/results.md``), the standard matrix-factorization error proxy

    RMSE = σ · sens(C) · ‖A C⁻¹‖_F / √T

(``A`` the workload, ``σ`` the noise multiplier of one unit-sensitivity release; the noise the
model sees is ``σ·sens·C⁻¹z``) for:

- **DP-SGD**: ``C = I``, Poisson sampling at ``B/n``, ``T`` subsampled Gaussians (our accountant);
- **BandMF (ours)**: ``C`` the b-banded square root (``banded.bsr_coefficients``, ``‖c‖₂ = 1``),
  cyclic Poisson sampling at ``B/(n // b)``, our accountant with ``bands=b``; sens = the largest
  column norm (1); ``b−1`` noise rows stored per parameter;
- **BISR, fixed batches**: ``C⁻¹ = M`` b-banded, ``m_j`` the first ``b`` coefficients of
  ``a(x)^{-1/2}`` (the banded inverse square root, Kalinin, McKenna, Upadhyay & Lampert 2025,
  "Back to square roots"); no amplification: the data are cut once into ``p = n // B`` fixed
  batches, batch ``t`` is batch ``t mod p`` (each example in exactly one batch per epoch, at the
  same position), so an example takes part at ``t_0, t_0 + p, …``; one Gaussian mechanism of
  sensitivity ``sens(C)`` (:func:`fixed_separation_sensitivity`). No stored rows; ``b`` draws per
  step regenerated from their keys.

The RMSE is invariant under ``C → αC`` (sens scales by ``α``, ``‖A C⁻¹‖`` by ``1/α``), so BISR's
``m_0 = 1`` needs no normalisation. All accountants are ours (:mod:`bpclip_fast.accounting`; the
same RDP or PLD for every row, so the comparison is like for like; a single Gaussian is
``steps=1`` at ``sample_rate=1``).
"""

from __future__ import annotations

import argparse
import functools
import math
import warnings

import numpy as np

from bpclip_fast.accounting import get_noise_multiplier
from bpclip_fast.banded import bsr_coefficients

#: (name, n, B, T): the regimes of docs/results.md's banded sweeps (expected batch 32, 20 epochs)
SETTINGS = (("digits", 1167, 32, 720), ("MNIST-1D", 3500, 32, 2180))
EPSILONS = (1.0, 3.0, 8.0)
DELTA = 1e-5
MOMENTA = (0.9, 0.0)
BANDS = (4, 16, 64)


def workload_series(T: int, beta: float) -> np.ndarray:
    """First column of ``A``: the coefficients of ``a(x) = 1/((1−x)(1−βx))``, ``Σ_{i≤j} β^i``
    (``1`` for SGD, ``β = 0``): the workload whose square root ``bsr_coefficients`` takes."""
    return np.cumsum(float(beta) ** np.arange(T, dtype=np.float64))


def power_series(T: int, beta: float, exponent: float) -> np.ndarray:
    """First ``T`` coefficients of ``a(x)^exponent = (1−x)^{−e}(1−βx)^{−e}``: the product of the
    binomial series ``(1−x)^{−e}`` (ratio ``(j−1+e)/j``) and its ``β``-scaled copy."""
    h = np.ones(T)
    for j in range(1, T):
        h[j] = h[j - 1] * (j - 1 + exponent) / j
    return np.convolve(h, h * float(beta) ** np.arange(T))[:T]


def series_inverse(c: np.ndarray, T: int) -> np.ndarray:
    """First ``T`` coefficients of ``1/c(x)``: the first column of ``C⁻¹`` for the lower-triangular
    Toeplitz ``C`` with first column ``c`` (forward substitution on the Toeplitz system)."""
    c = np.asarray(c, dtype=np.float64)
    if not c[0] > 0:
        raise ValueError("series_inverse: c_0 must be > 0")
    out = np.zeros(T)
    out[0] = 1.0 / c[0]
    for t in range(1, T):
        k = min(t, len(c) - 1)
        out[t] = -np.dot(c[1:k + 1], out[t - 1::-1][:k]) / c[0]
    return out


def toeplitz_frobenius(h: np.ndarray, T: int) -> float:
    """``‖H‖_F`` of the ``T×T`` lower-triangular Toeplitz matrix with first column ``h``: entry
    ``h_j`` sits on ``T − j`` rows."""
    h = np.asarray(h, dtype=np.float64)[:T]
    return math.sqrt(float(np.sum((T - np.arange(len(h))) * h * h)))


def toeplitz(h: np.ndarray, T: int) -> np.ndarray:
    """The dense ``T×T`` lower-triangular Toeplitz matrix with first column ``h`` (tests, brute force)."""
    col = np.zeros(T)
    h = np.asarray(h, dtype=np.float64)[:T]
    col[:len(h)] = h
    i, j = np.indices((T, T))
    return np.where(i >= j, col[np.clip(i - j, 0, T - 1)], 0.0)


def fixed_separation_sensitivity(c: np.ndarray, T: int, sep: int) -> float:
    """``sens(C)`` when an example takes part at ``t_0, t_0 + sep, …`` (all of them below ``T``),
    ``0 ≤ t_0 < sep``, with ``‖g_i‖ ≤ 1`` each: the largest ``‖Σ_i C e_{t_i} ⊗ g_i‖_F``.

    Needs ``c ≥ 0`` (refused otherwise). Proof: with ``C ≥ 0`` the Gram ``G_ij = ⟨Ce_{t_i}, Ce_{t_j}⟩``
    is ``≥ 0``, so ``Σ_ij G_ij⟨g_i, g_j⟩ ≤ Σ_ij G_ij``, attained by equal ``g_i``: the value is
    ``‖C u‖`` with ``u`` the pattern's indicator. ``C`` Toeplitz: the pattern from ``t_0`` is the
    earliest pattern of horizon ``T − t_0`` moved down by ``t_0``, i.e. its ``C u`` is the first
    ``T − t_0`` entries of the earliest pattern's, possibly with its last participations dropped;
    every term is ``≥ 0``, so the earliest pattern ``t_i = i·sep`` is the largest. (Monotone columns
    are not needed for fixed separation; they are for min-separated patterns, Kalinin & Lampert
    2024, which the tests check numerically as well.)"""
    c = np.concatenate([np.asarray(c, dtype=np.float64)[:T], np.zeros(max(0, T - len(c)))])
    if (c < 0).any():
        raise ValueError("fixed_separation_sensitivity: C has a negative entry; the earliest-pattern "
                         "formula needs C >= 0 (a non-negative Gram)")
    v = np.zeros(T)
    for start in range(0, T, int(sep)):
        v[start:] += c[:T - start]
    return float(np.linalg.norm(v))


@functools.lru_cache(maxsize=None)
def noise_multiplier(eps: float, delta: float, sample_rate: float, steps: int, bands: int, accountant: str) -> float:
    """Our accountant's calibration (cached: the momentum does not change it), its warnings about
    the σ it tries silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=sample_rate,
                                    steps=steps, accountant=accountant, bands=bands)


def gaussian_sigma(eps: float, delta: float, accountant: str) -> float:
    """The noise multiplier of one Gaussian mechanism of sensitivity 1 at ``(ε, δ)``."""
    return noise_multiplier(eps, delta, 1.0, 1, 1, accountant)


def rmse(sigma: float, sens: float, a_cinv: np.ndarray, T: int) -> float:
    """``σ·sens·‖A C⁻¹‖_F/√T``, ``a_cinv`` the first column of the Toeplitz ``A C⁻¹``."""
    return sigma * sens * toeplitz_frobenius(a_cinv, T) / math.sqrt(T)


def compare(n: int, B: int, T: int, beta: float, eps: float, delta: float = DELTA,
            bands=BANDS, accountant: str = "rdp") -> list:
    """One row per mechanism: dicts with mechanism, b, sigma, sens, rows (stored noise rows per
    parameter), draws (Philox draws per step), rmse; a BandMF ``b`` whose group rate ``B/(n//b)``
    exceeds 1 has ``sigma = rmse = None``."""
    a = workload_series(T, beta)
    rows = []
    sigma = noise_multiplier(eps, delta, B / n, T, 1, accountant)
    rows.append(dict(mechanism="DP-SGD", b=1, sigma=sigma, sens=1.0, rows=0, draws=1,
                     rmse=rmse(sigma, 1.0, a, T)))
    for b in bands:
        c = np.asarray(bsr_coefficients(b, beta))
        sens = float(np.linalg.norm(c))  # the largest column norm: a full column (the last b−1 are shorter)
        q = B / (n // b) if n // b else math.inf
        if q > 1:
            rows.append(dict(mechanism="BandMF (BSR)", b=b, sigma=None, sens=sens, rows=b - 1, draws=1, rmse=None))
            continue
        sigma = noise_multiplier(eps, delta, q, T, b, accountant)
        a_cinv = np.convolve(a, series_inverse(c, T))[:T]
        rows.append(dict(mechanism="BandMF (BSR)", b=b, sigma=sigma, sens=sens, rows=b - 1, draws=1,
                         rmse=rmse(sigma, sens, a_cinv, T)))
    sigma_g = gaussian_sigma(eps, delta, accountant)
    sep = n // B
    for b in bands:
        m = power_series(b, beta, -0.5)
        sens = fixed_separation_sensitivity(series_inverse(m, T), T, sep)
        a_cinv = np.convolve(a, m)[:T]
        rows.append(dict(mechanism="BISR, fixed batches", b=b, sigma=sigma_g, sens=sens, rows=0, draws=b,
                         rmse=rmse(sigma_g, sens, a_cinv, T)))
    return rows


def _fmt(v, spec):
    return "—" if v is None else format(v, spec)


def table(accountant: str = "rdp") -> str:
    """The markdown table over ``SETTINGS × MOMENTA``: one line per mechanism, the ε as columns."""
    head = ("| data (n, B, T) | β | mechanism | b | stored rows | draws/step | sens | "
            + " | ".join(f"σ (ε={e:g})" for e in EPSILONS) + " | "
            + " | ".join(f"RMSE (ε={e:g})" for e in EPSILONS) + " |")
    lines = [head, "|" + "---|" * (7 + 2 * len(EPSILONS))]
    for name, n, B, T in SETTINGS:
        for beta in MOMENTA:
            per_eps = [compare(n, B, T, beta, e, accountant=accountant) for e in EPSILONS]
            for i, r in enumerate(per_eps[0]):
                cells = [f"{name} ({n}, {B}, {T})", f"{beta:g}", r["mechanism"], str(r["b"]), str(r["rows"]),
                         str(r["draws"]), f"{r['sens']:.3g}"]
                cells += [_fmt(p[i]["sigma"], ".3g") for p in per_eps]
                cells += [_fmt(p[i]["rmse"], ".3g") for p in per_eps]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accountant", choices=("rdp", "pld"), default="rdp",
                        help="the same accountant for every mechanism (default rdp, as the sweeps)")
    args = parser.parse_args(argv)
    print(f"δ = {DELTA:g}; RMSE = σ·sens·‖A C⁻¹‖_F/√T; accountant {args.accountant}; "
          "BISR: fixed batches, separation n // B")
    print(table(args.accountant))


if __name__ == "__main__":
    main()
