"""The empirical audit's residual check: is the released noise the Gaussian the claim describes?

The auditor of :mod:`bpclip_fast.audit.empirical` is white-box: it knows every example of every
batch the loader drew and, because its canary model's gradients do not depend on the weights,
the noise-free release of that batch (through the real layers with the noise off,
:class:`bpclip_fast.audit.sensitivity.NoiseFree`). Subtracting it from an update leaves the noise
the step actually released. Under the claim — each layer ``l`` adds ``N(0, σ_l²Δ_l²)`` to every
coordinate, independently of every other coordinate, layer, step and draw — the residual divided
by the claimed std is i.i.d. ``N(0, 1)``. The check tests that directly:

* **std**: ``Σ r²`` over ``n`` coordinates is ``χ²(n)`` under the claim, which gives an interval for
  the ratio of the released std to the claimed one. Its upper end below 1 means *less noise than
  claimed* (a violation). With the thousands of coordinates of one step the interval is a few per
  cent wide: a noise 20% short is found where the ε lower bounds, which must resolve tails, cannot.
* **correlations**, each ``r·√n ≈ N(0, 1)`` under independence: between the layers (one draw used
  for every layer), between consecutive steps of a run (a draw reused across steps), and between
  the gradient the ``inplace-zero`` loop throws away and the one it releases (a redraw that reuses
  the discarded draw: whoever logged the first gradient could subtract the noise of the second).

The significance is :data:`SIGNIFICANCE` for the whole check, split over its tests (Bonferroni):
the check exists to find code that is clearly not the claimed mechanism, not to fluctuate. A std
significantly *above* the claim is reported, not failed (over-noising costs accuracy, not privacy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from scipy import stats as sps

SIGNIFICANCE = 1e-6


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
class NoiseCheck:
    """Accumulates whitened residuals ``(update − lr·share·Σ_batch c_i)/scale`` over steps and runs.

    ``expected(xb, vb)`` gives the noise-free update of a batch; ``layers`` the slices of the
    flattened update that belong to each clipped layer."""

    expected: callable
    scale: torch.Tensor
    layers: list
    sum_sq: float = 0.0
    n: int = 0
    pairs: dict = field(default_factory=dict)
    steps: _Pair = field(default_factory=_Pair)
    discarded: _Pair = field(default_factory=_Pair)
    _previous: torch.Tensor | None = None

    def new_run(self) -> None:
        self._previous = None

    def add(self, update: torch.Tensor, xb, vb, discarded: torch.Tensor | None = None) -> None:
        """One step: its update, its batch, and (``inplace-zero``) the update the discarded
        gradient would have made."""
        base = self.expected(xb, vb)
        r = (update - base) / self.scale
        self.sum_sq += float(r @ r)
        self.n += r.numel()
        parts = [r[s] for s in self.layers]
        for a in range(len(parts)):
            for b in range(a + 1, len(parts)):
                if parts[a].numel() == parts[b].numel():
                    self.pairs.setdefault((a, b), _Pair()).add(parts[a], parts[b])
        if self._previous is not None:
            self.steps.add(self._previous, r)
        self._previous = r
        if discarded is not None:
            self.discarded.add((discarded - base) / self.scale, r)

    def result(self) -> dict:
        """The std ratio with its interval, each correlation with its z, and the verdicts."""
        tests = {}
        for (a, b), pair in self.pairs.items():
            tests[f"layers {a}-{b}"] = pair.z()
        tests["consecutive steps"] = self.steps.z()
        tests["discarded vs released"] = self.discarded.z()
        tests = {k: v for k, v in tests.items() if v is not None}
        alpha = SIGNIFICANCE / (1 + len(tests))
        ratio = math.sqrt(self.sum_sq / self.n)
        lo = math.sqrt(sps.chi2.ppf(alpha / 2, self.n) / self.n)
        hi = math.sqrt(sps.chi2.ppf(1 - alpha / 2, self.n) / self.n)
        interval = (ratio / hi, ratio / lo)  # Σr²/n = ratio² · χ²(n)/n: invert the χ² quantiles
        limit = sps.norm.isf(alpha / 2)
        correlated = sorted(k for k, (_, z) in tests.items() if abs(z) > limit)
        under = interval[1] < 1.0
        return {"samples": self.n, "std_ratio": ratio, "std_interval": list(interval),
                "correlations": {k: r for k, (r, _) in tests.items()}, "correlated": correlated,
                "significance": SIGNIFICANCE, "under_noised": under, "over_noised": interval[0] > 1.0,
                "ok": not under and not correlated}
