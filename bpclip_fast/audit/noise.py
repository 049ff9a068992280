"""The empirical audit's residual check: is the released noise the Gaussian the claim describes?

The auditor of :mod:`bpclip_fast.audit.empirical` is white-box: it knows every example of every
batch the loader drew and, because its canary model's gradients do not depend on the weights,
the noise-free release of that batch (through the real layers with the noise off,
:class:`bpclip_fast.audit.noise_free.NoiseFree`). Subtracting it from the released gradient
leaves the noise the step actually released (the gradient read after ``step()``, which must be
the one the parameters moved by: :meth:`NoiseCheck.applied`). Under the claim — each layer ``l`` adds
``N(0, σ_l²Δ_l²)`` to every coordinate, independently of every other coordinate, parameter, step
and draw — the residual divided by the claimed std is i.i.d. ``N(0, 1)``. The check tests that:

* **std**, pooled and per parameter: ``Σ r²`` over ``n`` coordinates is ``χ²(n)``, which gives an
  interval for the released std over the claimed one. An upper end below 1 means *less noise than
  claimed* (a violation). With the thousands of coordinates of one step the pooled interval is a
  few per cent wide: a noise 20% short is found where the ε lower bounds, which must resolve
  tails, cannot; per parameter, a bias left without noise.
* **shape**: the residuals' counts in 100 bins equiprobable under ``N(0, 1)``, a χ² goodness-of-fit
  test (once 500 residuals are in). The claim is a Gaussian: noise of the right std but bounded
  support (uniform: the two neighbouring worlds then have outputs the other cannot produce, an
  unbounded ε) or the wrong tails (Laplace) is not what the accountant analysed.
* **correlations**, each ``r·√n ≈ N(0, 1)`` under independence: between the first coordinates of
  every two parameters of a step (a Philox key used twice — layers sharing a draw, a bias reusing
  its weight's — makes the streams equal from their first element), between neighbouring
  coordinates of one parameter (one draw broadcast over a row), between steps 1, 2 and 3 apart in
  a run (a draw reused across steps).

**Correlated noise** (``make_private(noise="banded", bands=b)``, :mod:`bpclip_fast.banded`): the
claim is no longer i.i.d. residuals but ``c_0 w_t = σΔ z_t − Σ_{1≤j<b} c_j w_{t−j}`` with the
engine's ``band_coefficients`` ``c``, rows ``t`` the batch indices and zeros before the block's
first row. So the check *whitens* by the known correlation: with ``r_t`` the residual of row ``t``
over the claimed std, ``y_t = Σ_{j<b, t−j ≥ start} c_j r_{t−j}`` is ``z_t`` exactly under the claim
(``start``: the run's first row, where the engine's block starts), i.i.d. ``N(0, 1)``, and every test
below runs on ``y``. Coefficients other than the claimed ones in the recursion (a sign flipped, a
band dropped) leave ``y_t = Σ_j (c_j − c'_j) w_{t−j}/σΔ + …``: correlated across steps (the lag
tests) and off in std. ``b = 1``: ``y = r``, the independent check unchanged.

The significance is :data:`SIGNIFICANCE` for the whole check, split over its tests (Bonferroni):
the check exists to find code that is clearly not the claimed mechanism, not to fluctuate. A std
significantly *above* the claim is reported, not failed (over-noising costs accuracy, not privacy).
Every test assumes independent coordinates under the claim, which correct code gives; a bug that
correlates coordinates in a way no test above looks at is detected only by chance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from scipy import stats as sps

SIGNIFICANCE = 1e-6
_BINS = 100
_LAGS = (1, 2, 3)
_EDGES = torch.tensor(sps.norm.ppf([i / _BINS for i in range(1, _BINS)]), dtype=torch.float64)


@dataclass
class _Pair:
    """Running sums for the correlation of two residual vectors of equal length."""

    sab: float = 0.0
    saa: float = 0.0
    sbb: float = 0.0
    n: int = 0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.sab += float(a @ b)
        self.saa += float(a @ a)
        self.sbb += float(b @ b)
        self.n += a.numel()

    def z(self) -> tuple[float, float] | None:
        """``(correlation, r·√n)``, or None before any data."""
        if self.n == 0 or self.saa == 0 or self.sbb == 0:
            return None
        r = self.sab / math.sqrt(self.saa * self.sbb)
        return r, r * math.sqrt(self.n)


@dataclass
class SumOfSquares:
    """Running ``Σ r²`` and ``n`` of one group of whitened coordinates (also the sensitivity audit's
    per-layer noise rows)."""

    sum_sq: float = 0.0
    n: int = 0

    def add(self, r: torch.Tensor) -> None:
        self.sum_sq += float(r @ r)
        self.n += r.numel()

    def interval(self, alpha: float) -> tuple[float, float, float]:
        """``(ratio, lo, hi)``: ``Σr²/n = s²·χ²(n)/n``, so inverting the χ² quantiles bounds ``s``."""
        ratio = math.sqrt(self.sum_sq / self.n)
        return (ratio, ratio / math.sqrt(sps.chi2.ppf(1 - alpha / 2, self.n) / self.n),
                ratio / math.sqrt(sps.chi2.ppf(alpha / 2, self.n) / self.n))


@dataclass
class NoiseCheck:
    """Accumulates whitened residuals ``(update − expected(batch))/scale`` over steps and runs.

    ``expected(xb, vb)`` gives the noise-free update of a batch; ``params`` is ``[(name, slice)]``,
    the coordinates of each parameter in the flattened update; ``coefficients``: the claimed band
    ``(c_0, …, c_{b−1})`` the residuals are whitened by (module docstring; ``(1.0,)``: independent
    noise, no whitening). Each run (:meth:`new_run`) starts the band afresh, as the engine's block."""

    expected: callable
    scale: torch.Tensor
    params: list
    coefficients: tuple = (1.0,)
    pooled: SumOfSquares = field(default_factory=SumOfSquares)
    per_param: dict = field(default_factory=dict)
    pairs: dict = field(default_factory=dict)
    counts: torch.Tensor = field(default_factory=lambda: torch.zeros(_BINS, dtype=torch.float64))
    misapplied: int = 0
    _history: list = field(default_factory=list)
    _raw: list = field(default_factory=list)   # the run's last b−1 residuals before whitening, newest last

    def new_run(self) -> None:
        self._history = []
        self._raw = []

    def _whiten(self, r: torch.Tensor) -> torch.Tensor:
        """``y_t = Σ_{j<b} c_j r_{t−j}`` over the rows of this run (the block starts at its first)."""
        c = self.coefficients
        if len(c) == 1:
            return r
        y = c[0] * r
        for j, past in enumerate(reversed(self._raw), start=1):
            y = y + c[j] * past
        self._raw = (self._raw + [r])[-(len(c) - 1):]
        return y

    def _pair(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        self.pairs.setdefault(name, _Pair()).add(a, b)

    def applied(self, before: torch.Tensor, after: torch.Tensor, released: torch.Tensor, eps: float) -> None:
        """Counts the coordinates where the parameters moved by other than ``released`` (SGD's
        ``θ − lr·g`` in a float of unit roundoff ``eps`` errs by at most ``eps·(|θ'| + |lr·g|)``):
        the gradient scored must be the one applied (a noise added to ``.grad`` after the update
        would otherwise be scored but never released)."""
        slack = 2 * eps * (before.abs() + after.abs() + released.abs())
        self.misapplied += int(((before - after) - released).abs().gt(slack).sum())

    def add(self, update: torch.Tensor, xb, vb) -> None:
        """One step: its update and its batch."""
        base = self.expected(xb, vb)
        r = self._whiten((update - base) / self.scale)
        self.pooled.add(r)
        self.counts += torch.bincount(torch.bucketize(r, _EDGES), minlength=_BINS).double()
        parts = [(name, r[s]) for name, s in self.params]
        for i, (name, part) in enumerate(parts):
            self.per_param.setdefault(name, SumOfSquares()).add(part)
            if part.numel() > 1:
                self._pair(f"neighbouring coordinates of {name}", part[:-1], part[1:])
            for other, second in parts[i + 1:]:
                k = min(part.numel(), second.numel())
                self._pair(f"{name} and {other}", part[:k], second[:k])
        for lag in _LAGS:
            if len(self._history) >= lag:
                self._pair(f"steps {lag} apart", self._history[-lag], r)
        self._history = (self._history + [r])[-max(_LAGS):]

    def result(self) -> dict:
        """The std ratios with their intervals, the shape test, each correlation, and the verdicts."""
        corr = {k: v for k, v in ((k, p.z()) for k, p in self.pairs.items()) if v is not None}
        n = self.pooled.n
        shape = n >= 5 * _BINS
        alpha = SIGNIFICANCE / (1 + len(self.per_param) + len(corr) + shape)
        ratio, lo, hi = self.pooled.interval(alpha)
        per_param = {name: sq.interval(alpha) for name, sq in self.per_param.items()}
        under = sorted(name for name, (_, _, top) in per_param.items() if top < 1.0)
        if hi < 1.0:
            under.insert(0, "all")
        limit = sps.norm.isf(alpha / 2)
        correlated = sorted(k for k, (_, z) in corr.items() if abs(z) > limit)
        shape_p = float(sps.chi2.sf(float(((self.counts - n / _BINS) ** 2).sum() / (n / _BINS)), _BINS - 1)) \
            if shape else None
        not_gaussian = shape_p is not None and shape_p < alpha
        return {"samples": n, "std_ratio": ratio, "std_interval": [lo, hi], "misapplied": self.misapplied,
                "per_parameter": {k: {"std_ratio": v[0], "interval": [v[1], v[2]]} for k, v in per_param.items()},
                "shape_p_value": shape_p, "correlations": {k: r for k, (r, _) in corr.items()},
                "significance": SIGNIFICANCE, "under_noised": under, "correlated": correlated,
                "not_gaussian": not_gaussian, "over_noised": lo > 1.0,
                "ok": not under and not correlated and not not_gaussian and not self.misapplied}
