"""zCDP accountant for the paper's setting: disjoint batches of a data-independent shuffle.

Stevens et al. (2022) train with fixed-size disjoint batches: at every epoch the data set is put
in an order that does not depend on the data, and cut into consecutive batches, so **each
example is in exactly one batch per epoch**. There is no amplification by sampling; instead
the steps of one epoch compose in *parallel* (an example influences one of them), and epochs
(and layers, already folded into ``σ_eff``) compose *sequentially*. Zero-concentrated DP (Bun &
Steinke 2016) composes by adding ρ, and the Gaussian mechanism with L2 sensitivity ``s`` and noise
std ``σ`` is ``s²/(2σ²)``-zCDP (BS16, Prop. 1.6).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

from .base import Accountant, check_delta, check_steps
from .cyclic import check_bands

__all__ = ["ZCDPAccountant", "bun_steinke_epsilon", "cks_epsilon", "gaussian_epsilon",
           "gaussian_delta", "zcdp_epsilon", "ZCDP_CONVERSIONS"]

ZCDP_CONVERSIONS = ("gaussian", "cks", "bun_steinke")


def _check_rho(rho) -> float:
    if not isinstance(rho, (int, float, np.floating)) or not math.isfinite(rho) or rho < 0:
        raise ValueError(f"rho must be a finite number >= 0, got {rho!r}")
    return float(rho)


# --------------------------------------------------------------------------- conversions

def bun_steinke_epsilon(rho: float, delta: float) -> float:
    """``ε = ρ + 2·sqrt(ρ·log(1/δ))``: ρ-zCDP implies (ε, δ)-DP (Bun & Steinke 2016, Prop. 1.3).

    Derivation: ρ-zCDP is RDP ``ρα`` at every order ``α > 1``; the basic RDP conversion gives
    ``ε = ρα + log(1/δ)/(α−1)``, minimised at ``α = 1 + sqrt(log(1/δ)/ρ)``.
    """
    rho, delta = _check_rho(rho), check_delta(delta)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def _cks_objective(alpha: float, rho: float, log_inv_delta: float) -> float:
    return alpha * rho + (log_inv_delta + (alpha - 1.0) * math.log1p(-1.0 / alpha)
                          - math.log(alpha)) / (alpha - 1.0)


def cks_epsilon(rho: float, delta: float) -> float:
    """The Canonne–Kamath–Steinke conversion of ρ-zCDP to (ε, δ)-DP.

    Canonne, Kamath & Steinke 2020, "The Discrete Gaussian for Differential Privacy",
    Prop. 12 / Cor. 13 (arXiv:2004.00010): an (α, τ)-RDP mechanism is (ε, δ)-DP for
    ``δ = exp((α−1)(τ−ε))/(α−1) · (1 − 1/α)^α``; a ρ-zCDP mechanism has ``τ = αρ`` at every
    ``α > 1``. Solving for ε (take logs: ``log δ = (α−1)(αρ−ε) − log(α−1) + α·log(1−1/α)``) and
    using ``α·log(1−1/α) − log(α−1) = (α−1)·log(1−1/α) − log α`` gives ::

        ε = inf_{α>1}  αρ + [ log(1/δ) + (α−1)·log(1 − 1/α) − log α ] / (α − 1)

    which is the RDP conversion dp_accounting and Opacus use, applied to the zCDP curve. Every
    ``α`` gives a valid ε; we minimise over ``α = 1 + e^t`` on a grid of ``t`` (including the
    Bun–Steinke optimum, so the result is never above :func:`bun_steinke_epsilon`) and refine
    with bounded Brent. For ρ=1, δ=1e-5: 7.077.
    """
    rho, delta = _check_rho(rho), check_delta(delta)
    if rho == 0.0:
        return 0.0
    lid = math.log(1.0 / delta)

    def g(t: float) -> float:
        return _cks_objective(1.0 + math.exp(t), rho, lid)

    ts = list(np.linspace(-15.0, 30.0, 451)) + [0.5 * math.log(lid / rho)]  # last: Bun–Steinke α
    vals = [g(t) for t in ts]
    i = int(np.argmin(vals))
    best = vals[i]
    # refine within one grid spacing (0.1) of the best point
    res = optimize.minimize_scalar(g, bounds=(ts[i] - 0.1, ts[i] + 0.1), method="bounded",
                                   options={"xatol": 1e-10})
    if res.fun < best:
        best = float(res.fun)
    return max(0.0, best)


def gaussian_delta(mu: float, epsilon: float) -> float:
    """The privacy profile of the Gaussian mechanism with ``μ = sensitivity/std``.

    ``δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)`` (Balle & Wang 2018, "Improving the Gaussian
    mechanism for differential privacy", Thm. 8): the exact hockey-stick divergence between
    ``N(0, 1)`` and ``N(μ, 1)``, i.e. the smallest δ for which the mechanism is (ε, δ)-DP. It is
    also the exact profile of μ-GDP (Dong, Roth & Su 2022, Cor. 2.13). Computed in log space.
    """
    if mu == 0.0:
        return 0.0
    log_a = special.log_ndtr(mu / 2.0 - epsilon / mu)
    log_b = epsilon + special.log_ndtr(-epsilon / mu - mu / 2.0)
    if log_b >= log_a:
        return 0.0
    return float(math.exp(log_a) * -math.expm1(log_b - log_a))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest ε with ``gaussian_delta(mu, ε) <= delta`` (Balle & Wang 2018).

    ``δ(ε)`` is decreasing in ε; we bracket the root in ``[0, ε_BS]`` (the Bun–Steinke ε of
    ``ρ = μ²/2`` satisfies it, and is doubled if rounding says otherwise) and solve
    ``log δ(ε) = log δ`` with Brent's method; the returned ε is then checked to satisfy
    ``δ(ε) <= delta`` and nudged up if the last bits disagree, so it is never below the root.
    """
    delta = check_delta(delta)
    if not math.isfinite(mu) or mu < 0:
        raise ValueError(f"mu must be a finite number >= 0, got {mu!r}")
    if mu == 0.0 or gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    log_delta = math.log(delta)
    hi = max(bun_steinke_epsilon(mu * mu / 2.0, delta), 1e-12)
    while gaussian_delta(mu, hi) > delta:
        hi *= 2.0

    def f(eps: float) -> float:
        d = gaussian_delta(mu, eps)
        return (math.log(d) if d > 0 else -1e300) - log_delta

    eps = optimize.brentq(f, 0.0, hi, xtol=1e-13, rtol=4 * np.finfo(float).eps, maxiter=500)
    step = max(abs(eps), 1.0) * 1e-15
    while gaussian_delta(mu, eps) > delta:
        eps += step
        step *= 2.0
    return float(eps)


def zcdp_epsilon(rho: float, delta: float, conversion: str = "gaussian") -> float:
    """ε at ``delta`` of ``rho``-zCDP with the named conversion (see :class:`ZCDPAccountant`).

    ``"gaussian"`` is valid only when the ρ comes from (adaptively composed, un-subsampled)
    Gaussian mechanisms, as in :class:`ZCDPAccountant`; it is ``gaussian_epsilon(sqrt(2ρ), δ)``.
    """
    rho = _check_rho(rho)
    if conversion == "gaussian":
        return gaussian_epsilon(math.sqrt(2.0 * rho), delta)
    if conversion == "cks":
        return cks_epsilon(rho, delta)
    if conversion == "bun_steinke":
        return bun_steinke_epsilon(rho, delta)
    raise ValueError(f"conversion must be one of {ZCDP_CONVERSIONS}, got {conversion!r}")


# --------------------------------------------------------------------------- accountant

def _segment_charge(runs, k: int, aligned: bool) -> tuple[float, int]:
    """Total ρ of one segment of steps, and the number of epochs (groups) it is cut into.

    ``runs``: ``[(ρ_step, n), ...]`` in step order; ``k``: steps per group. Group ``g`` holds steps
    ``g·k .. g·k + k − 1``; ``M_g`` is the largest per-step ρ in it. Aligned epochs (exactly ``k``
    steps each, starting with the segment): charge ``Σ_g M_g``. Unaligned epochs (each of ``k``
    or ``k+1`` steps): charge ``Σ_g max(M_g, M_{g+1})`` (see :class:`ZCDPAccountant`).
    """
    total_steps = sum(n for _, n in runs)
    groups = -(-total_steps // k)
    m = np.zeros(groups + 1)
    pos = 0
    for rho, n in runs:
        g0, g1 = pos // k, (pos + n - 1) // k
        np.maximum(m[g0:g1 + 1], rho, out=m[g0:g1 + 1])
        pos += n
    if aligned:
        return float(m[:groups].sum()), groups
    return float(np.maximum(m[:groups], m[1:groups + 1]).sum()), groups


class ZCDPAccountant(Accountant):
    """zCDP accountant of shuffled disjoint batches (the paper's setting), with three conversions.

    **Per step.** A step is one Gaussian mechanism on the concatenation of all layers with
    effective noise multiplier ``σ_eff`` (:func:`effective_noise_multiplier`). Under
    ``adjacency="replace_one"`` (one example replaced by another; the paper's relation) the
    replaced example moves layer ``l``'s gradient sum by up to ``2Δ_l``, so the step is
    ``ρ_step = Σ_l (2Δ_l)²/(2σ_l²Δ_l²) = 2/σ_eff²``-zCDP (``2L/σ²`` for a uniform ``σ``). Under
    ``adjacency="add_remove"`` the move is at most ``Δ_l`` and ``ρ_step = 1/(2σ_eff²)``, a factor 4
    smaller. With a data-independent shuffle and fixed-size batches, "add/remove" must be read
    as the *zero-out* relation (Kairouz et al. 2021): the example's slot in its batch is emptied
    and every other batch is unchanged. A loader that re-packs fixed-size batches after a removal
    changes other batches too, which this relation does not cover; ``replace_one`` needs no such
    convention.

    **Per epoch.** An epoch is one pass in which every example is in exactly one batch, at a
    position that does not depend on the data. Two neighbouring data sets differ in one
    example, so in each epoch only the step whose batch holds it has different output
    distributions (parallel composition; later steps may depend on it adaptively, which zCDP
    composition allows). An epoch therefore costs the largest ``ρ_step`` of its steps, and a
    partial epoch (training stopped mid-pass) costs like a full one. Epochs compose sequentially:
    ``ρ = Σ_epochs max_{steps in the epoch} ρ_step``.

    **Which steps form an epoch.** ``sample_rate`` is ``batch_size / N``, so an epoch has
    ``1/sample_rate`` steps when that is an integer, and otherwise ``⌈N/B⌉`` steps (last batch
    smaller) or ``⌊N/B⌋`` (last batch dropped). The accountant cuts the steps, from the first
    step and anew whenever ``sample_rate`` changes (a new data set/loader starts a new epoch),
    into groups of ``k`` consecutive steps:

    * ``steps_per_epoch`` given: ``k = steps_per_epoch``; the loader's epochs are exactly these
      groups (``sample_rate`` is then ignored for grouping). Charge ``Σ_g M_g`` with ``M_g`` the
      largest ``ρ_step`` of group ``g``.
    * ``1/sample_rate`` an integer ``n`` (within 1e-9 relative): ``k = n``, the same charge.
    * otherwise ``k = ⌊1/sample_rate⌋`` and the true epochs have ``k`` or ``k+1`` steps, so they
      need not line up with the groups. Every epoch starts in a different group ``g`` (epochs
      have ``>= k`` steps) and lies inside groups ``g`` and ``g+1`` (``<= k+1`` steps), so
      ``Σ_epochs max ρ <= Σ_g max(M_g, M_{g+1})``, which is what we charge. With a constant σ
      this is ``⌈T/k⌉·ρ_step`` for ``T`` steps: at most one epoch more than the loader ran
      (e.g. N=60000, B=256, 14100 steps = 60 epochs of 235 are charged as 61); pass
      ``steps_per_epoch`` to remove that slack.

    **Conversions to (ε, δ)** (``conversion`` of :meth:`get_epsilon`; the constructor's
    ``conversion`` is the default):

    * ``"gaussian"`` (default, the tightest): ``ε`` solving ``δ = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)``
      with ``μ = sqrt(2ρ)`` (Balle & Wang 2018). Sound here because every charged ρ comes from a
      Gaussian mechanism that is not subsampled: the adaptive composition of Gaussian mechanisms
      with ``μ_i = sqrt(2ρ_i)`` is exactly ``sqrt(Σ μ_i²)``-GDP (Dong, Roth & Su 2022, Cor. 3.3),
      i.e. the whole run is no more revealing than one Gaussian mechanism with ``μ = sqrt(2ρ)``,
      whose exact (ε, δ) curve is the formula above. (It is *not* valid for an arbitrary ρ-zCDP
      mechanism.)
    * ``"cks"``: :func:`cks_epsilon` (Canonne, Kamath & Steinke 2020), valid for any ρ-zCDP.
    * ``"bun_steinke"``: ``ρ + 2·sqrt(ρ·log(1/δ))`` (Bun & Steinke 2016), valid for any ρ-zCDP.

    They satisfy gaussian ≤ cks ≤ bun_steinke; for ρ=1, δ=1e-5: 6.573, 7.077, 7.786.

    **The paper's convention.** The paper's code computed ``ρ_step = 1/(2σ_eff²)`` (sensitivity
    ``Δ_l``) even for replace-one and converted with Bun–Steinke: :meth:`paper_epsilon` returns
    that figure (same epoch grouping), labelled as unsound for replace-one: it understates ρ by
    4x. It is for comparison with published numbers only.
    """

    mechanism = "zcdp"
    sampling = "shuffle"
    ADJACENCIES = ("replace_one", "add_remove")
    CONVERSIONS = ZCDP_CONVERSIONS

    def __init__(self, adjacency: str = "replace_one", conversion: str = "gaussian",
                 steps_per_epoch: int | None = None, bands: int = 1) -> None:
        super().__init__()
        # Correlated (BandMF) noise is analysed only for cyclic Poisson sampling (accounting/cyclic.py);
        # the parallel composition of shuffled epochs here says nothing about C⁻¹z noise.
        if check_bands(bands) != 1:
            raise ValueError(f"bands={bands!r}: the zCDP accountant analyses independent noise on shuffled "
                             "disjoint batches only; correlated (banded) noise needs cyclic Poisson sampling "
                             "and accountant='rdp' or 'pld'")
        self.bands = 1
        if adjacency not in self.ADJACENCIES:
            raise ValueError(f"adjacency must be one of {self.ADJACENCIES}, got {adjacency!r}")
        self.adjacency = adjacency
        self.conversion = self._check_conversion(conversion)
        self.steps_per_epoch = (None if steps_per_epoch is None
                                else check_steps(steps_per_epoch, "steps_per_epoch", 1))

    def _check_event_rate(self, sample_rate) -> float:
        # No amplification by subsampling is analysed here, and the "gaussian" conversion holds only
        # for un-subsampled Gaussians: a one-off event is on the whole data set.
        if sample_rate != 1.0 and sample_rate != 1:
            raise ValueError(f"sample_rate={sample_rate!r}: the zCDP accountant charges one-off events on the whole "
                             "data set only (sample_rate=1); a subsampled event needs accountant='rdp' or 'pld'")
        return 1.0

    def _check_conversion(self, conversion):
        if conversion not in self.CONVERSIONS:
            raise ValueError(f"conversion must be one of {self.CONVERSIONS}, got {conversion!r}")
        return conversion

    def _config(self) -> dict:
        return {"adjacency": self.adjacency, "steps_per_epoch": self.steps_per_epoch}

    # ---- rho
    def rho_per_step(self, noise_multiplier: float) -> float:
        """``2/σ_eff²`` (replace_one) or ``1/(2σ_eff²)`` (add_remove): one step's zCDP ρ."""
        s2 = float(noise_multiplier) ** 2
        return 2.0 / s2 if self.adjacency == "replace_one" else 0.5 / s2

    def _epoch_length(self, sample_rate: float) -> tuple[int, bool]:
        if self.steps_per_epoch is not None:
            return self.steps_per_epoch, True
        r = 1.0 / sample_rate
        n = round(r)
        if n >= 1 and abs(r - n) <= 1e-9 * r:
            return int(n), True
        return max(1, math.floor(r)), False

    def _segments(self):
        h = self.history
        i = 0
        while i < len(h):
            j = i + 1
            if self.steps_per_epoch is not None:
                j = len(h)
            else:
                while j < len(h) and h[j][1] == h[i][1]:
                    j += 1
            yield h[i][1], h[i:j]
            i = j

    def _charge(self, rho_of_sigma) -> tuple[float, int]:
        rho, epochs = 0.0, 0
        for q, entries in self._segments():
            k, aligned = self._epoch_length(q)
            r, g = _segment_charge([(rho_of_sigma(s), n) for s, _, n in entries], k, aligned)
            rho, epochs = rho + r, epochs + g
        return rho, epochs

    @property
    def rho(self) -> float:
        """The total zCDP ρ of all steps so far and of the one-off events (sound, for :attr:`adjacency`).

        A one-off event (:meth:`add_event`) is a Gaussian mechanism of multiplier ``σ_e`` on the whole
        data set, charged like a step's Gaussian: ``ρ_step(σ_e)`` (``1/(2σ_e²)`` add/remove; ``2/σ_e²``
        replace-one, from the triangle inequality ``‖f(D) − f(D')‖ ≤ 2Δ``), added to every epoch sum
        (sequential composition; the steps may depend on its output)."""
        return self._charge(self.rho_per_step)[0] + sum(self.rho_per_step(s) for s, _ in self.events)

    @property
    def epochs(self) -> int:
        """The number of epochs (groups of steps) charged so far; partial epochs count as one."""
        return self._charge(self.rho_per_step)[1]

    @property
    def paper_rho(self) -> float:
        """ρ as the paper's code computed it: ``1/(2σ_eff²)`` per epoch, whatever the adjacency (and
        ``1/(2σ_e²)`` per one-off event)."""
        return self._charge(lambda s: 0.5 / float(s) ** 2)[0] + sum(0.5 / s ** 2 for s, _ in self.events)

    # ---- epsilon
    def get_epsilon(self, delta: float, conversion: str | None = None) -> float:
        """ε at ``delta``; ``conversion`` in ``("gaussian", "cks", "bun_steinke")``, default the
        constructor's (``"gaussian"``, the exact and tightest; see the class docstring)."""
        delta = check_delta(delta)
        conversion = self._check_conversion(self.conversion if conversion is None else conversion)
        return zcdp_epsilon(self.rho, delta, conversion)

    def epsilons(self, delta: float) -> dict:
        """``{"gaussian": ε, "cks": ε, "bun_steinke": ε}`` at ``delta`` (all sound)."""
        delta = check_delta(delta)
        rho = self.rho
        return {c: zcdp_epsilon(rho, delta, c) for c in self.CONVERSIONS}

    def paper_epsilon(self, delta: float) -> float:
        """The ε the paper's code would print: Bun–Steinke of :attr:`paper_rho`.

        **Not a sound guarantee for replace-one adjacency** (the paper's relation): a replaced
        example moves a layer's sum by up to ``2Δ_l``, not ``Δ_l``, so the true ρ is 4x
        :attr:`paper_rho`. Report :meth:`get_epsilon` as the guarantee; this is only for comparing
        with the paper's published figures. (For ``adjacency="add_remove"`` it coincides with
        ``get_epsilon(delta, "bun_steinke")``.)
        """
        return bun_steinke_epsilon(self.paper_rho, check_delta(delta))

    def describe(self, delta: float) -> str:
        """A labelled multi-line summary: the sound ε (three conversions) and the paper's figure."""
        e = self.epsilons(delta)
        label = ("NOT a sound bound for replace-one" if self.adjacency == "replace_one"
                 else "same as Bun-Steinke for add/remove")
        lines = [f"zCDP ({self.adjacency}, shuffled disjoint batches): {len(self)} steps, "
                 f"{self.epochs} epochs, rho = {self.rho:.6g}",
                 f"  epsilon at delta={delta:g}: {e['gaussian']:.4f} (exact Gaussian), "
                 f"{e['cks']:.4f} (Canonne-Kamath-Steinke), {e['bun_steinke']:.4f} (Bun-Steinke)",
                 f"  paper's convention (sensitivity Delta, not 2*Delta; Bun-Steinke; "
                 f"{label}): "
                 f"{self.paper_epsilon(delta):.4f}"]
        return "\n".join(lines)
