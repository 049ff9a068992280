"""Construction by name, and the noise multiplier that meets a privacy budget."""

from __future__ import annotations

import math
import warnings

from .base import Accountant, PrivacyBudgetError, _is_real, check_sample_rate, check_steps
from .cyclic import check_bands
from .poisson import PLDAccountant, RDPAccountant
from .zcdp import ZCDPAccountant

__all__ = ["ACCOUNTANTS", "make_accountant", "default_accountant", "get_noise_multiplier", "MAX_SIGMA"]

ACCOUNTANTS = {"rdp": RDPAccountant, "pld": PLDAccountant, "zcdp": ZCDPAccountant}

#: the largest noise multiplier :func:`get_noise_multiplier` tries (Opacus uses the same bound)
MAX_SIGMA = 1e6


def make_accountant(name: str, **kw) -> Accountant:
    """A new accountant: ``"rdp"`` / ``"pld"`` (Poisson sampling) or ``"zcdp"`` (shuffled disjoint
    batches). ``kw`` go to the constructor (e.g. ``adjacency=`` for zcdp,
    ``value_discretization_interval=`` for pld, ``orders=`` for rdp, ``bands=`` for rdp/pld: amplified
    BandMF with cyclic Poisson sampling; zcdp refuses ``bands > 1``)."""
    if name not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {name!r}: choose one of {sorted(ACCOUNTANTS)} "
                         "('rdp' or 'pld' with Poisson sampling, 'zcdp' with shuffled disjoint batches)")
    return ACCOUNTANTS[name](**kw)


def default_accountant(sampling: str) -> str:
    """The first accountant of :data:`ACCOUNTANTS` that analyses ``sampling`` (each accountant class
    says which in its ``sampling`` attribute): ``"rdp"`` for Poisson, ``"zcdp"`` for shuffled batches."""
    for name, cls in ACCOUNTANTS.items():
        if cls.sampling == sampling:
            return name
    raise ValueError(f"no accountant analyses sampling {sampling!r}; choose one of "
                     f"{sorted({cls.sampling for cls in ACCOUNTANTS.values()})}")


def get_noise_multiplier(*, target_epsilon: float, target_delta: float, sample_rate: float,
                         epochs: float | None = None, steps: int | None = None,
                         accountant: str = "rdp", epsilon_tolerance: float = 0.01, bands: int = 1,
                         events=(), **accountant_kw) -> float:
    """The smallest effective noise multiplier σ whose ε(target_delta) is at most ``target_epsilon``.

    ``steps`` steps at ``sample_rate``, or ``epochs`` epochs, i.e. ``int(epochs / sample_rate)``
    steps (truncated, as Opacus does); give exactly one. ``accountant`` and ``accountant_kw`` are
    passed to :func:`make_accountant` (e.g. ``accountant="zcdp", adjacency="replace_one"``).
    The result is the *effective* multiplier of a whole step: for ``L`` layers with a uniform
    per-layer multiplier, use ``σ·sqrt(L)`` per layer (:func:`effective_noise_multiplier`).

    ``bands = b > 1`` (amplified BandMF, cyclic Poisson sampling; :mod:`.cyclic`): ``sample_rate``
    is the rate within a group, ``q_g = B/(N // b)``, and the accountant is built with ``bands=b``,
    so ``steps`` steps are charged as ``⌈steps/b⌉`` subsampled Gaussians at ``q_g``. An epoch
    (``B·steps = N``) is then ``b/q_g`` steps: ``epochs`` gives ``int(epochs·b/q_g)`` steps.

    ``events``: one-off mechanisms composed with the steps, ``[(noise_multiplier, sample_rate), ...]``
    (:meth:`Accountant.add_event`; a private PCA of the inputs is ``[(σ_p, 1.0)]``): every ε the search
    evaluates includes them, so the σ returned keeps the steps *and* the events within the target.

    Search. ε(σ) is decreasing in σ. Starting at σ = 1 (for PLD: at the RDP solution, with
    steps of 10%, since each PLD evaluation costs up to a second), σ is doubled (up to
    :data:`MAX_SIGMA`) or halved (down to the accountant's ``search_sigma_min``) until the target is bracketed by
    ``σ_lo`` (ε > target) and ``σ_hi`` (ε ≤ target); the bracket is then narrowed by a safeguarded
    secant step on ``(log σ, log ε)`` (bisection in ``log σ`` when that stalls) until
    ``target − ε(σ_hi) <= epsilon_tolerance``. ``σ_hi`` is returned: its ε has been computed and
    meets the target, and any σ below ``σ_lo`` (ε > target was computed there) does not.
    If even ``search_sigma_min`` meets the target, that value is returned with a warning.

    Raises:
        PrivacyBudgetError (a ValueError): ``target_epsilon <= 0``, ``target_delta`` not in
            (0, 1), ``epsilon_tolerance`` not > 0, or a target that no σ <= MAX_SIGMA reaches
            (e.g. ε below the accountant's floor at this δ: the RDP conversion cannot go below
            about ``log(1/δ)/(α_max − 1)``).
        ValueError: bad ``sample_rate``, ``epochs``/``steps`` or accountant name.
    """
    if not _is_real(target_epsilon) or not math.isfinite(target_epsilon) or target_epsilon <= 0:
        raise PrivacyBudgetError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}; "
                                 "no noise multiplier gives epsilon <= 0 with delta < 1")
    if not _is_real(target_delta) or not 0 < target_delta < 1:
        raise PrivacyBudgetError(f"target_delta must be a number with 0 < target_delta < 1 "
                                 f"(typically below 1/dataset size), got {target_delta!r}")
    if not _is_real(epsilon_tolerance) or not epsilon_tolerance > 0:
        raise PrivacyBudgetError(f"epsilon_tolerance must be a number > 0, got {epsilon_tolerance!r}")
    sample_rate = check_sample_rate(sample_rate)
    bands = check_bands(bands)
    if (epochs is None) == (steps is None):
        raise ValueError("get_noise_multiplier needs exactly one of epochs= or steps=")
    if steps is None:
        if not _is_real(epochs) or not epochs > 0:
            raise ValueError(f"epochs must be a number > 0, got {epochs!r}")
        steps = int(epochs * bands / sample_rate)
        if steps < 1:
            raise ValueError(f"epochs={epochs!r} at sample_rate={sample_rate!r} is less than one step")
    steps = check_steps(steps, "steps", 1)
    if bands != 1:  # b = 1 builds the accountant exactly as before (zcdp included)
        accountant_kw["bands"] = bands
    template = make_accountant(accountant, **accountant_kw)
    cls = type(template)
    events = [tuple(e) for e in events]
    for sigma_e, q_e in events:
        template.add_event(sigma_e, q_e)  # checks them
    if events:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            floor = template.get_epsilon(target_delta)
        if not floor < target_epsilon:
            raise PrivacyBudgetError(
                f"the one-off events {events} alone spend epsilon={floor:.4g} at target_delta={target_delta}, "
                f"not below target_epsilon={target_epsilon}: no training noise can meet it; raise their noise "
                "multiplier (e.g. --pca-noise) or target_epsilon")

    cache: dict = {}
    # An accountant's warnings about a σ the search only tries say nothing about the answer: keep
    # them per σ and repeat those of the σ returned (see _answer).
    notes: dict = {}

    def eps(sigma: float) -> float:
        if sigma not in cache:
            acc = cls(**accountant_kw)
            acc._append(sigma, sample_rate, steps)
            for sigma_e, q_e in events:
                acc.add_event(sigma_e, q_e)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                e = acc.get_epsilon(target_delta)
            notes[sigma] = caught
            cache[sigma] = e if e == e else math.inf  # NaN -> inf (no guarantee)
        return cache[sigma]

    def _answer(sigma: float) -> float:
        for w in notes.get(sigma, ()):
            warnings.warn(w.message, w.category, stacklevel=3)
        return sigma

    sigma_min = template.search_sigma_min
    start, factor = 1.0, 2.0
    if accountant == "pld":
        # warm start: the RDP solution is cheap and usually within ~10% of the PLD one
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                start = get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                             sample_rate=sample_rate, steps=steps, accountant="rdp",
                                             epsilon_tolerance=epsilon_tolerance, bands=bands, events=events)
            start, factor = max(start, sigma_min), 1.1
        except PrivacyBudgetError:  # RDP's conversion has a floor that PLD may go below
            pass
    if eps(start) <= target_epsilon:
        hi, lo = start, None
        while lo is None:
            s = max(hi / factor, sigma_min)
            if eps(s) > target_epsilon:
                lo = s
            elif s == sigma_min:
                warnings.warn(f"target_epsilon={target_epsilon} is met even at noise_multiplier="
                              f"{sigma_min} (the smallest the search tries for {accountant!r}); "
                              "returning it", stacklevel=2)
                return _answer(sigma_min)
            else:
                hi = s
            factor = min(2.0, factor * factor)
    else:
        lo, hi = start, None
        while hi is None:
            s = min(lo * factor, MAX_SIGMA)
            if eps(s) <= target_epsilon:
                hi = s
            elif s == MAX_SIGMA:
                raise PrivacyBudgetError(
                    f"target_epsilon={target_epsilon} at target_delta={target_delta} cannot be reached "
                    f"with the {accountant!r} accountant for {steps} steps at sample_rate={sample_rate}, "
                    f"even with noise_multiplier={MAX_SIGMA:g} (epsilon={eps(s):.4g}): raise "
                    "target_epsilon or target_delta, or train for fewer steps / a smaller sample_rate")
            else:
                lo = s
            factor = min(2.0, factor * factor)

    # invariant: eps(lo) > target >= eps(hi), lo < hi
    bisect_next = False
    for _ in range(200):
        e_hi = eps(hi)
        if target_epsilon - e_hi <= epsilon_tolerance:
            break
        if hi - lo <= 1e-12 * hi:
            break
        e_lo = eps(lo)
        llo, lhi = math.log(lo), math.log(hi)
        t = 0.5 * (llo + lhi)
        if not bisect_next and math.isfinite(e_lo) and e_hi > 0:
            # secant on (log sigma, log eps) aimed at target - tolerance/2, kept inside the
            # middle 90% of the bracket
            a, b = math.log(e_lo), math.log(e_hi)
            aim = target_epsilon - 0.5 * epsilon_tolerance
            if a > b and aim > 0:
                t_sec = llo + (a - math.log(aim)) * (lhi - llo) / (a - b)
                t = min(max(t_sec, llo + 0.05 * (lhi - llo)), lhi - 0.05 * (lhi - llo))
        s = math.exp(t)
        old_width = lhi - llo
        if eps(s) <= target_epsilon:
            hi = s
        else:
            lo = s
        # bisect next time if the secant step removed less than half of the bracket
        bisect_next = (math.log(hi) - math.log(lo)) > 0.5 * old_width
    return _answer(hi)
