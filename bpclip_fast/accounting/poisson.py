"""Accountants for Poisson sampling (add/remove one example): RDP and PLD, both via dp_accounting.

Each step is one **Poisson-subsampled Gaussian mechanism** with the step's effective noise
multiplier ``σ_eff`` (see :func:`~bpclip_fast.accounting.effective_noise_multiplier`): every
example joins the batch independently with probability ``q = sample_rate``, one example moves
the whitened concatenation of all layers' gradient sums by at most ``1/σ_eff`` under
add/remove adjacency, and noise ``N(0, I)`` is added. The history
``[(σ, q, n), ...]`` is the dp_accounting event ::

    ComposedDpEvent([SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), n), ...])

(:meth:`PoissonAccountant.dp_event`), and Google's ``dp_accounting`` does all the privacy
arithmetic: we do not re-derive the subsampled-Gaussian RDP or the privacy-loss distribution.

``bands = b > 1`` (amplified BandMF with cyclic Poisson sampling, :mod:`.cyclic`): ``q`` is the rate
within the step's group, ``q_g = B/(N // b)``; step ``k`` of the history is at cyclic position
``k mod b``, each position is composed on its own, and ε (δ) is the worst over the positions: for a
history of ``T`` steps at one ``(σ, q_g)``, ``⌈T/b⌉`` subsampled Gaussians. ``b = 1`` gives exactly
the events above.

One-off events (:meth:`~.base.Accountant.add_event`, ``[(σ_e, q_e), ...]``: a private PCA of the
inputs, say) are composed once into the event of every cyclic position: ``GaussianDpEvent(σ_e)``
(``q_e = 1``) or ``PoissonSampledDpEvent(q_e, GaussianDpEvent(σ_e))``. Every example takes part in
them whatever its group, so each position pays for all of them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings

import numpy as np
from dp_accounting import dp_event as _ev
from dp_accounting import NeighboringRelation as _Rel
from dp_accounting.pld import pld_privacy_accountant as _pld
from dp_accounting.rdp import rdp_privacy_accountant as _rdp

from .base import Accountant, check_delta
from .cyclic import check_bands, dominating_history, worst_positions

__all__ = ["RDPAccountant", "PLDAccountant", "OPACUS_RDP_ORDERS"]

#: Opacus' ``RDPAccountant.DEFAULT_ALPHAS`` (1.1, 1.2, ..., 10.9, 12, 13, ..., 63). Using the same
#: orders and the same RDP → (ε, δ) conversion makes our ε equal Opacus' up to the numerics of
#: the two libraries' subsampled-Gaussian RDP: typically ~1e-5 relative, up to ~6e-4 where
#: dp_accounting's fractional-order series is slightly conservative (ours is then the larger);
#: see RDPAccountant for large q.
OPACUS_RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def _worst(values: list, key=lambda v: v):
    """The largest of the cyclic positions' values; a NaN (no guarantee) wins, where ``max`` could drop it."""
    for v in values:
        if key(v) != key(v):
            return v
    return max(values, key=key)


@contextlib.contextmanager
def _quiet_absl():
    """dp_accounting logs through absl (the ``absl`` Python logger); we report its one warning
    that matters (orders left out) ourselves, once, instead of once per order and σ."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class PoissonAccountant(Accountant):
    """Shared part of the RDP and PLD accountants (Poisson sampling, add/remove adjacency)."""

    sampling = "poisson"

    def __init__(self, bands: int = 1) -> None:
        super().__init__()
        self.bands = check_bands(bands)

    def _config(self) -> dict:
        return {"bands": self.bands}

    def load_state_dict(self, d: dict) -> None:
        """As :meth:`Accountant.load_state_dict`; a state saved before ``bands`` existed is ``bands=1``,
        so it is refused by a banded accountant (its steps were charged at the full-data rate)."""
        if isinstance(d, dict) and isinstance(d.get("config", {}), dict):
            saved = d.get("config", {}).get("bands", 1)
            if saved != self.bands:
                raise ValueError(f"state_dict was saved with bands={saved!r} but this accountant has "
                                 f"bands={self.bands!r}; construct it with the same bands (the cyclic "
                                 "groups of the run being resumed)")
        super().load_state_dict(d)

    def _positions(self) -> list:
        """The histories of the cyclic positions that can be the worst (``[history]`` for ``bands=1``).

        The one-off events are the same for every position, so they do not change which positions
        dominate (a position that composes a subset of another's steps, plus the same events, is
        still dominated)."""
        return worst_positions(self.history, self.bands)

    def _spends(self) -> bool:
        """Whether anything has been charged (steps or one-off events)."""
        return bool(self.history) or bool(self.events)

    @staticmethod
    def _one_off(sigma: float, q: float) -> _ev.DpEvent:
        gaussian = _ev.GaussianDpEvent(sigma)
        return gaussian if q == 1.0 else _ev.PoissonSampledDpEvent(q, gaussian)

    def _event(self, history) -> _ev.DpEvent:
        """One position's steps and every one-off event, as one composed dp_accounting event."""
        return _ev.ComposedDpEvent(
            [_ev.SelfComposedDpEvent(_ev.PoissonSampledDpEvent(q, _ev.GaussianDpEvent(sigma)), n)
             for sigma, q, n in history] + [self._one_off(sigma, q) for sigma, q in self.events])

    def dp_event(self) -> _ev.DpEvent:
        """The history as one dp_accounting event (what the accountant composes).

        ``bands > 1``: the event of a position that dominates every cyclic position (each run with
        the largest count any position has, :func:`~.cyclic.dominating_history`): the worst
        position's event for a history of one ``(σ, q)``, an upper bound otherwise."""
        return self._event(dominating_history(self.history, self.bands))


class RDPAccountant(PoissonAccountant):
    """Rényi-DP accountant of Poisson-subsampled Gaussian steps (Abadi et al. 2016; Mironov 2017).

    The RDP of one step at each order ``α`` is dp_accounting's ``RdpAccountant`` applied to
    ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` (the bound of Mironov, Talwar & Zhang 2019,
    "Rényi Differential Privacy of the Sampled Gaussian Mechanism", computed exactly for integer
    and fractional orders). RDP composes additively, so the history's RDP is
    ``Σ_entries n · RDP_step(σ, q)``; the per-step vector is cached per ``(σ, q)``.

    Args:
        orders: the RDP orders ``α`` over which the conversion is optimised. Default: Opacus'
            orders (:data:`OPACUS_RDP_ORDERS`), so that ε matches Opacus' ``RDPAccountant``.
        conversion: the default RDP → (ε, δ) conversion of :meth:`get_epsilon`:

            * ``"improved"`` (default; what Opacus and dp_accounting use):
              ``ε = min_α RDP(α) + log(1 − 1/α) − (log δ + log α)/(α − 1)``
              (Balle et al. 2020, "Hypothesis testing interpretations and Rényi differential
              privacy", Thm. 21; Canonne, Kamath & Steinke 2020, Prop. 12). Computed by
              ``dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon``, which also returns
              ε = 0 when ``δ² ≥ 1 − exp(−RDP(α))`` (a valid KL/Pinsker-type bound) and clips ε
              at 0; Opacus does neither, which only matters for ε ≈ 0.
            * ``"basic"``: ``ε = min_α RDP(α) + log(1/δ)/(α − 1)`` (Mironov 2017, "Rényi
              Differential Privacy", Prop. 3). Always larger; offered for comparison with older
              papers.

    Orders left out: for moderate ``q`` with small ``σ`` (q=0.09 with σ=1; every q ≳ 0.3),
    dp_accounting's series for fractional orders below 2 may not converge; it then leaves those
    orders out (RDP = ∞ there). ε remains a valid upper bound, and is the ε of all the orders
    when a lower bound of the RDP there (:meth:`_rdp_floor`) cannot beat the orders evaluated;
    only otherwise (then it can be above Opacus', by 2% at q=0.5, σ=2, 100 steps) does a
    ``RuntimeWarning`` say so. The PLD accountant has no such issue.
    """

    mechanism = "rdp"
    CONVERSIONS = ("improved", "basic")

    def __init__(self, orders=None, conversion: str = "improved", bands: int = 1) -> None:
        super().__init__(bands)
        orders = OPACUS_RDP_ORDERS if orders is None else tuple(float(a) for a in orders)
        if not orders or any(not (a > 1 and math.isfinite(a)) for a in orders):
            raise ValueError(f"orders must be a non-empty list of finite RDP orders > 1, got {orders!r}")
        self.orders = tuple(orders)
        self.conversion = self._check_conversion(conversion)
        self._step_cache: dict = {}

    def _check_conversion(self, conversion):
        if conversion not in self.CONVERSIONS:
            raise ValueError(f"conversion must be one of {self.CONVERSIONS}, got {conversion!r}")
        return conversion

    def __repr__(self) -> str:
        return (f"RDPAccountant({len(self.orders)} orders in [{min(self.orders)}, {max(self.orders)}], "
                f"conversion={self.conversion!r}, bands={self.bands}) with {len(self)} steps")

    def _step_rdp(self, sigma: float, q: float) -> np.ndarray:
        key = (sigma, q)
        if key not in self._step_cache:
            acc = _rdp.RdpAccountant(orders=list(self.orders),
                                     neighboring_relation=_Rel.ADD_OR_REMOVE_ONE)
            with _quiet_absl():
                acc.compose(_ev.PoissonSampledDpEvent(q, _ev.GaussianDpEvent(sigma)))
            self._step_cache[key] = acc.rdp
        return self._step_cache[key]

    def _history_rdp(self, history) -> np.ndarray:
        """RDP of one position's steps plus every one-off event (``q = 1``: the Gaussian's
        ``α/(2σ²)``, which dp_accounting returns for a sampling probability of 1)."""
        total = np.zeros(len(self.orders))
        for sigma, q, n in history:
            total = total + n * self._step_rdp(sigma, q)
        for sigma, q in self.events:
            total = total + self._step_rdp(sigma, q)
        return total

    @property
    def rdp(self) -> np.ndarray:
        """The RDP of all steps so far at each of :attr:`orders` (additive composition).

        ``bands > 1``: the largest over the cyclic positions at each order, an RDP curve every
        example meets; ε (:meth:`get_privacy_spent`) converts each position's curve on its own,
        which can only be smaller than converting this one."""
        return np.max([self._history_rdp(h) for h in self._positions()], axis=0)

    def _rdp_floor(self, history=None) -> float:
        """A lower bound on the history's RDP at every order ``α > 1``, from closed forms only.

        One step's RDP at ``α`` is the Rényi divergence ``D_α`` between the subsampled Gaussian
        ``(1−q)·N(0, σ²) + q·N(1, σ²)`` and ``N(0, σ²)`` (Mironov, Talwar & Zhang 2019; the add/
        remove RDP is at least this one direction). ``D_α`` is non-decreasing in ``α``, so
        ``D_α ≥ D_1 = KL ≥ 2·TV²`` (Pinsker, in nats), and the total variation of the two is
        ``q·TV(N(0, σ²), N(1, σ²)) = q·erf(1/(2√2·σ))`` (the mixture's common part cancels).
        Composition adds: ``Σ_entries n · 2·(q·erf(1/(2√2σ)))²``.
        """
        history = self.history if history is None else history
        history = list(history) + [(sigma, q, 1) for sigma, q in self.events]  # same bound, q = 1 included
        return sum(n * 2.0 * (q * math.erf(1.0 / (2.0 * math.sqrt(2.0) * sigma))) ** 2
                   for sigma, q, n in history)

    @staticmethod
    def _convert(orders: np.ndarray, rdp: np.ndarray, delta: float, conversion: str):
        if conversion == "improved":
            return _rdp.compute_epsilon(orders, rdp, delta)
        eps_all = rdp + math.log(1 / delta) / (orders - 1)
        i = int(np.argmin(eps_all))
        return max(0.0, eps_all[i]), orders[i]

    def get_privacy_spent(self, delta: float, conversion: str | None = None) -> tuple[float, float]:
        """``(ε, optimal order α)`` at ``delta`` (Opacus' ``get_privacy_spent``); with ``bands > 1``
        those of the worst cyclic position."""
        delta = check_delta(delta)
        conversion = self._check_conversion(self.conversion if conversion is None else conversion)
        if not self._spends():
            return 0.0, float("nan")
        return _worst([self._spent(h, delta, conversion) for h in self._positions()], key=lambda ea: ea[0])

    def _spent(self, history, delta: float, conversion: str) -> tuple[float, float]:
        rdp = self._history_rdp(history)
        orders = np.asarray(self.orders)
        eps, alpha = self._convert(orders, rdp, delta, conversion)
        left_out = np.isinf(rdp)
        if left_out.any() and not left_out.all():
            # Orders dp_accounting could not evaluate are ∞ here, so ε is an upper bound in any
            # case. It is also the ε of all the orders (and worth no warning) when even a lower
            # bound on the RDP at each left-out order, put through the same conversion (which is
            # non-decreasing in the RDP), gives no smaller ε than the orders that were evaluated.
            floor = np.full(int(left_out.sum()), self._rdp_floor(history))
            eps_floor, _ = self._convert(orders[left_out], floor, delta, conversion)
            if eps_floor < eps:
                warnings.warn(
                    "dp_accounting could not evaluate the subsampled-Gaussian RDP at some fractional "
                    "orders below 2 (its series does not converge for this sample rate and noise "
                    "multiplier) and one of them may be the best order here: epsilon stays a valid "
                    "upper bound but can be a few percent above Opacus'. The PLD accountant "
                    "(accountant='pld') is tighter.", RuntimeWarning, stacklevel=5)
        return float(eps), float(alpha)

    def get_epsilon(self, delta: float, conversion: str | None = None) -> float:
        """ε at ``delta`` of all steps so far (see the class docstring for ``conversion``)."""
        return self.get_privacy_spent(delta, conversion)[0]


class PLDAccountant(PoissonAccountant):
    """Privacy-loss-distribution accountant of Poisson-subsampled Gaussian steps.

    The history's event (:meth:`dp_event`) is composed by dp_accounting's ``PLDAccountant``
    (Koskela et al. 2020; Meiser & Mohammadi 2018; Doroshenko et al. 2022, "Connect the Dots"),
    with add/remove adjacency (the PLD is the worse of the add and the remove directions), and
    ε is read off the composed PLD (``get_epsilon_for_delta``). This is the tightest of our
    numbers for Poisson sampling; on the DESIGN.md vectors it is about 8% below RDP.

    Discretisation (``value_discretization_interval``, default ``1e-4``, dp_accounting's default):
    the privacy loss is discretised on a grid of that spacing with the *pessimistic* connect-the-
    dots construction, and the tail mass beyond ``exp(-50)`` is moved to an infinite loss, so the
    reported ε is an upper bound on the true ε of the mechanism. On the DESIGN.md vectors ``1e-4``
    agrees with a ten times finer grid to 1e-6 to 1.4e-4 relative while costing 0.05-1 s per
    evaluation on one core (more for small σ); a grid of ``1e-3`` is 3-10x faster but up to 1.4%
    looser (q=0.01, σ=4, 10000 steps). The composed PLD of the last history is cached, as is ε
    per δ.
    """

    mechanism = "pld"
    #: PLD of tiny multipliers is slow (the privacy-loss range grows like 1/σ²): the search in
    #: :func:`get_noise_multiplier` does not go below this.
    search_sigma_min = 0.1

    def __init__(self, value_discretization_interval: float = 1e-4, bands: int = 1) -> None:
        super().__init__(bands)
        v = value_discretization_interval
        if not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 0.1:
            raise ValueError("value_discretization_interval must be a number in (0, 0.1] "
                             f"(the spacing of the privacy-loss grid), got {v!r}")
        self.value_discretization_interval = float(v)
        self._cache_key = None
        self._cache_acc = None
        self._cache_eps: dict = {}

    def _composed(self) -> list:
        """One composed dp_accounting PLD per cyclic position that can be the worst (one for ``bands=1``)."""
        key = (tuple(self.history), tuple(self.events))
        if key != self._cache_key:
            accs = []
            for history in self._positions():
                acc = _pld.PLDAccountant(neighboring_relation=_Rel.ADD_OR_REMOVE_ONE,
                                         value_discretization_interval=self.value_discretization_interval)
                acc.compose(self._event(history))
                accs.append(acc)
            self._cache_key, self._cache_acc, self._cache_eps = key, accs, {}
        return self._cache_acc

    def get_epsilon(self, delta: float) -> float:
        """ε at ``delta`` of all steps so far (``bands > 1``: of the worst cyclic position)."""
        delta = check_delta(delta)
        if not self._spends():
            return 0.0
        accs = self._composed()
        if delta not in self._cache_eps:
            self._cache_eps[delta] = _worst([float(acc.get_epsilon(delta)) for acc in accs])
        return self._cache_eps[delta]

    def get_delta(self, epsilon: float) -> float:
        """δ at ``epsilon`` of all steps so far (the privacy profile; ``bands > 1``: the worst position's)."""
        if not isinstance(epsilon, (int, float)) or not epsilon >= 0:
            raise ValueError(f"epsilon must be a number >= 0, got {epsilon!r}")
        if not self._spends():
            return 0.0
        return _worst([float(acc.get_delta(epsilon)) for acc in self._composed()])

    def _with_steps(self, noise_multiplier, sample_rate, num_steps):
        other = super()._with_steps(noise_multiplier, sample_rate, num_steps)
        # the copy must not share (and overwrite) this accountant's cache
        other._cache_key, other._cache_acc, other._cache_eps = None, None, {}
        return other
