"""The accountant interface shared by the zCDP, RDP and PLD accountants.

The surface follows Opacus' ``IAccountant`` (``step``, ``get_epsilon``, ``history``,
``state_dict``/``load_state_dict``) so that code written for Opacus keeps working, with two
differences that matter for backpropagation clipping:

* ``noise_multiplier`` passed to :meth:`Accountant.step` is the **effective** noise multiplier of
  the whole step, ``σ_eff = (Σ_l σ_l⁻²)^(-1/2)`` (:func:`effective_noise_multiplier`), not the
  per-layer one: a step releases every layer's noisy gradient, and those releases together form
  one Gaussian mechanism (see the function's docstring).
* ``len(accountant)`` is the number of steps taken (Opacus returns the number of history
  entries).
"""

from __future__ import annotations

import abc
import copy
import math
from numbers import Real
from typing import Iterable


class PrivacyBudgetError(ValueError):
    """No noise multiplier (or no further step) can meet the requested privacy budget."""


# --------------------------------------------------------------------------- argument checks

def _is_real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def check_noise_multiplier(noise_multiplier, name: str = "noise_multiplier") -> float:
    """``noise_multiplier`` as a float; it must be a finite number > 0."""
    if not _is_real(noise_multiplier) or not math.isfinite(noise_multiplier) or noise_multiplier <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {noise_multiplier!r}")
    return float(noise_multiplier)


def check_sample_rate(sample_rate, name: str = "sample_rate") -> float:
    """``sample_rate`` as a float; it must satisfy 0 < sample_rate <= 1."""
    if not _is_real(sample_rate) or not math.isfinite(sample_rate) or not 0 < sample_rate <= 1:
        raise ValueError(f"{name} must be a number with 0 < {name} <= 1 (batch_size / dataset size), "
                         f"got {sample_rate!r}")
    return float(sample_rate)


def check_delta(delta, name: str = "delta") -> float:
    """``delta`` as a float; it must satisfy 0 < delta < 1."""
    if not _is_real(delta) or not math.isfinite(delta) or not 0 < delta < 1:
        raise ValueError(f"{name} must be a number with 0 < {name} < 1 (typically well below "
                         f"1/dataset size), got {delta!r}")
    return float(delta)


def check_steps(num_steps, name: str = "num_steps", minimum: int = 1) -> int:
    """``num_steps`` as an int; it must be an integer >= ``minimum``."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) and not (
            _is_real(num_steps) and float(num_steps).is_integer()):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {num_steps!r}")
    if int(num_steps) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {num_steps!r}")
    return int(num_steps)


# --------------------------------------------------------------------------- sigma_eff

def effective_noise_multiplier(sigmas: Iterable[float]) -> float:
    """The noise multiplier of one step that adds Gaussian noise to several layers.

    ``σ_eff = (Σ_l σ_l⁻²)^(-1/2)``; for ``L`` layers with the same ``σ`` this is ``σ/√L``.

    Derivation. Layer ``l`` releases ``S_l + N(0, (σ_l Δ_l)² I)`` where ``S_l`` is the sum of the
    examples' clipped contributions and one example moves ``S_l`` by a vector ``v_l`` with
    ``‖v_l‖ ≤ Δ_l`` (add/remove; ``2Δ_l`` for replace-one, which the zCDP accountant accounts
    for). Dividing layer ``l``'s release by ``σ_l Δ_l`` (a bijection, so no change in privacy)
    turns the step into ``S' + N(0, I)`` on the concatenation of all layers, in which one example
    moves ``S'`` by ``(v_l / (σ_l Δ_l))_l`` of norm at most ``(Σ_l σ_l⁻²)^(1/2) = 1/σ_eff``. That is
    one Gaussian mechanism with noise multiplier ``σ_eff``, and the bound is attained (the
    example may move every layer by its full bound at once). All layers see the *same* sampled
    batch, so under Poisson sampling the step is one subsampled Gaussian with ``σ_eff``; treating
    the layers as ``L`` separately subsampled mechanisms would use the amplification by
    subsampling ``L`` times and is unsound.
    """
    total = 0.0
    count = 0
    for i, s in enumerate(sigmas):
        s = check_noise_multiplier(s, name=f"sigmas[{i}]")
        total += s ** -2
        count += 1
    if count == 0:
        raise ValueError("sigmas must contain at least one noise multiplier (one per noisy layer)")
    return total ** -0.5


# --------------------------------------------------------------------------- the interface

class Accountant(abc.ABC):
    """Privacy accountant of a sequence of noisy steps.

    Attributes:
        mechanism: ``"rdp"``, ``"pld"`` or ``"zcdp"``.
        sampling: ``"poisson"`` (each example joins each batch independently with probability
            ``sample_rate``; RDP, PLD) or ``"shuffle"`` (disjoint batches of a data-independent
            shuffle, one pass per epoch; zCDP).
        history: list of ``(noise_multiplier, sample_rate, num_steps)``; consecutive steps with
            equal ``(noise_multiplier, sample_rate)`` are merged into one entry (as in Opacus).
        events: list of ``(noise_multiplier, sample_rate)``: one-off mechanisms on the same data set
            that every example takes part in (:meth:`add_event`; e.g. a private PCA of the inputs).
            They are not steps: ``len()`` does not count them, and with ``bands > 1`` every cyclic
            position composes all of them (a one-off event in the step history would land on one
            position only and under-count the others).
    """

    mechanism: str = ""
    sampling: str = ""
    #: the smallest noise multiplier :func:`get_noise_multiplier` evaluates
    search_sigma_min: float = 1e-2

    def __init__(self) -> None:
        self.history: list = []
        self.events: list = []

    # ---- one-off events
    def add_event(self, noise_multiplier: float, sample_rate: float = 1.0) -> None:
        """Charge one Gaussian mechanism, applied once to the whole data set, on top of the steps.

        The mechanism releases ``f(D) + N(0, σ²Δ²I)`` where one example moves ``f(D)`` by at most
        ``Δ`` in L2 under this accountant's adjacency (``sample_rate < 1``: of a Poisson sample of
        the data set at that rate; RDP/PLD only). Composition is adaptive, so the steps may depend
        on its output (a PCA projection fixed before training). Every example is in it, so it is
        composed into every cyclic position (``bands > 1``) and into every zCDP charge; it is not a
        step (``len(accountant)`` is unchanged).
        """
        self.events.append((check_noise_multiplier(noise_multiplier), self._check_event_rate(sample_rate)))

    def _check_event_rate(self, sample_rate) -> float:
        return check_sample_rate(sample_rate)

    # ---- steps
    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one step with the given *effective* noise multiplier and sample rate."""
        self._append(check_noise_multiplier(noise_multiplier), check_sample_rate(sample_rate), 1)

    def _append(self, noise_multiplier: float, sample_rate: float, num_steps: int) -> None:
        if self.history:
            last_sigma, last_q, last_n = self.history[-1]
            if last_sigma == noise_multiplier and last_q == sample_rate:
                self.history[-1] = (last_sigma, last_q, last_n + num_steps)
                return
        self.history.append((noise_multiplier, sample_rate, num_steps))

    def __len__(self) -> int:
        """The number of steps taken (not the number of history entries)."""
        return sum(n for _, _, n in self.history)

    # ---- epsilon
    @abc.abstractmethod
    def get_epsilon(self, delta: float) -> float:
        """The ε of the (ε, δ)-DP guarantee of all steps taken so far, at ``delta``."""

    def epsilon_after(self, delta: float, *, noise_multiplier: float, sample_rate: float,
                      num_steps: int = 1, **kwargs) -> float:
        """ε at ``delta`` if ``num_steps`` more steps were taken; the accountant is not changed.

        For a budget that must never be overrun (check before the step, not after).
        """
        return self._with_steps(noise_multiplier, sample_rate, num_steps).get_epsilon(delta, **kwargs)

    def max_steps(self, target_epsilon: float, delta: float, *, noise_multiplier: float,
                  sample_rate: float, limit: int = 10 ** 7, **kwargs) -> int:
        """The largest ``k <= limit`` such that ``k`` more steps keep ε(delta) ≤ ``target_epsilon``.

        Exponential search then bisection on ``k``; every returned ``k`` has been evaluated and
        meets the target (``0`` if even the next step would exceed it). ε is non-decreasing in
        the number of steps (composition), so this is the exact largest ``k``; with PLD's
        discretisation it is a ``k`` that meets the target, possibly one less than the largest.
        Costs about ``2·log2(k)`` epsilon evaluations: precompute it once per run rather than
        calling :meth:`epsilon_after` every step with the PLD accountant.
        """
        check_delta(delta)
        if not _is_real(target_epsilon) or not target_epsilon > 0:
            raise ValueError(f"target_epsilon must be a number > 0, got {target_epsilon!r}")
        limit = check_steps(limit, "limit", 1)

        def ok(k: int) -> bool:
            return k == 0 or self.epsilon_after(delta, noise_multiplier=noise_multiplier,
                                                sample_rate=sample_rate, num_steps=k,
                                                **kwargs) <= target_epsilon

        if not self.get_epsilon(delta, **kwargs) <= target_epsilon:
            return 0
        lo, hi = 0, 1
        while ok(hi):
            lo = hi
            if hi >= limit:
                return limit
            hi = min(2 * hi, limit)
        while hi - lo > 1:  # ok(lo), not ok(hi)
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _with_steps(self, noise_multiplier, sample_rate, num_steps) -> "Accountant":
        other = copy.copy(self)
        other.history = list(self.history)
        other.events = list(self.events)
        other._append(check_noise_multiplier(noise_multiplier), check_sample_rate(sample_rate),
                      check_steps(num_steps, "num_steps", 1))
        return other

    # ---- checkpoints
    def _config(self) -> dict:
        """Constructor arguments that describe the run being accounted (saved in the state_dict
        and required to match on load); settings that only change the numerics (RDP orders, PLD
        grid, default conversion) are not part of it."""
        return {}

    def state_dict(self) -> dict:
        """Everything the guarantee depends on: mechanism, configuration and history."""
        return {"mechanism": self.mechanism, "config": dict(self._config()),
                "history": [tuple(h) for h in self.history], "events": [tuple(e) for e in self.events]}

    def load_state_dict(self, d: dict) -> None:
        """Restore from :meth:`state_dict`; refuses a state of another mechanism or configuration."""
        if not isinstance(d, dict) or "history" not in d or "mechanism" not in d:
            raise ValueError("state_dict must be a dict with the keys 'mechanism' and 'history' "
                             "(as returned by Accountant.state_dict())")
        if d["mechanism"] != self.mechanism:
            raise ValueError(f"cannot load the state of a {d['mechanism']!r} accountant into a "
                             f"{self.mechanism!r} accountant")
        config = d.get("config", {})
        mine = self._config()
        for key, value in config.items():
            if key in mine and mine[key] != value:
                raise ValueError(f"state_dict was saved with {key}={value!r} but this accountant has "
                                 f"{key}={mine[key]!r}; construct it with the same {key}")
        history = []
        for i, entry in enumerate(d["history"]):
            try:
                sigma, q, n = entry
            except (TypeError, ValueError):
                raise ValueError(f"state_dict['history'][{i}] must be (noise_multiplier, sample_rate, "
                                 f"num_steps), got {entry!r}") from None
            history.append((check_noise_multiplier(sigma, f"history[{i}] noise_multiplier"),
                            check_sample_rate(q, f"history[{i}] sample_rate"),
                            check_steps(n, f"history[{i}] num_steps", 1)))
        events = []
        for i, entry in enumerate(d.get("events", ())):  # a state saved before events existed has none
            try:
                sigma, q = entry
            except (TypeError, ValueError):
                raise ValueError(f"state_dict['events'][{i}] must be (noise_multiplier, sample_rate), "
                                 f"got {entry!r}") from None
            events.append((check_noise_multiplier(sigma, f"events[{i}] noise_multiplier"),
                           self._check_event_rate(q)))
        self.history = []
        for sigma, q, n in history:
            self._append(sigma, q, n)
        self.events = events

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        extra = f" and {len(self.events)} one-off event(s)" if self.events else ""
        return f"{type(self).__name__}({cfg}) with {len(self)} steps{extra}"
