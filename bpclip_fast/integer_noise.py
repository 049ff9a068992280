"""The integer release (``make_private(integer_noise=True)``; docs/design.md, "Integer noise").

Floating-point Gaussian noise added in floating point can be inverted bit for bit (the README's
"Floating-point noise"). Here each layer's gradient is released through integers instead:

1. The buffer the layer's backward returns holds its clipped sum ``S`` in the gradient's units (for
   ``loss_reduction="mean"``, ``S/B̄``; the op multiplies by ``multiplier = B̄``).
2. It is put on the grid ``γ = 2^e``, ``e = ⌊log₂Δ⌋ − g``, ``g = ⌈log₂√D⌉ + GUARD_BITS`` for the
   ``D`` coordinates of the model's clipped layers, clamped to ``±2⁵²`` and rounded to an integer
   ``k`` by a Philox word that does not depend on the data (``integer_release_``).
3. ``Y ~ N_ℤ(0, s²)``, ``s = ⌈σΔ/γ⌉``, is drawn exactly with integer arithmetic
   (``discrete_gaussian_``), and ``γ(k + Y)/multiplier`` is written in the gradient's dtype: a fixed
   function of the integer ``k + Y`` (post-processing).

**Proof of the charge** (``EFFECTIVE_FACTOR``). Fix the rounding words (they are the same for any
two data sets). For neighbours ``D, D'`` whose sums differ by at most ``Δ`` in l2 (the clipping's
bound; the float rounding of the sums themselves is outside this argument, as for the float noise),
the grid values differ by at most ``Δ/γ`` plus the double rounding of ``x·multiplier``, at most
``2⁻⁵³|a| ≤ ½(1 + 2⁻⁵²)`` per coordinate for each data set (the clamp bounds ``|a|``); the rounding
moves each coordinate by less than 1 more (``k = ⌊a − v⌋ + 1``). Over the ``D`` coordinates
(Minkowski): ``‖k − k'‖₂ ≤ Δ/γ + (2 + 2⁻⁵²)√D``. Since ``γ ≤ Δ·2^-g`` and ``√D ≤ 2^(g − 14)``,
``‖k − k'‖₂ ≤ (Δ/γ)(1 + 2⁻¹³ + 2⁻⁶⁶)``. The noise is ``s ≥ σΔ/γ`` per coordinate, so the integer
mechanism has the noise multiplier of a Gaussian mechanism with ``σ/(1 + 2⁻¹³ + 2⁻⁶⁶) >
σ/EFFECTIVE_FACTOR``; the same holds per layer under backpropagation clipping (each layer's own
``Δ_l``, the rounding of its ``d_l ≤ D`` coordinates) and jointly under flat and per_layer (one Δ,
one grid). The accountant is charged with ``σ_eff/EFFECTIVE_FACTOR``.

**Why a Gaussian accountant holds for the discrete Gaussian.** Poisson sampling at rate ``q``
gives the pairs ``M = (1−q)P₀ + qP_μ`` against ``P₀``, ``P_μ = N_ℤ^D(μ, s²)`` with ``μ = k' − k`` an
integer vector (for fixed rounding words and batch; the mixture over them only lowers the
divergences, by the joint convexity of ``exp((λ−1)D_λ)``), and RDP must bound both directions.

1. ``D_λ(M ‖ P₀)`` at integer orders ``λ`` is exactly the continuous sampled Gaussian's: it is
   ``log Σ_j C(λ,j)(1−q)^(λ−j) q^j E_{P₀}[(P_μ/P₀)^j] / (λ−1)``, and
   ``E_{P₀}[(P_μ/P₀)^j] = exp(j(j−1)‖μ‖²/(2s²))`` because ``Σ_y exp(−‖y − jμ‖²/(2s²))`` over ``ℤ^D``
   equals the normaliser (``jμ`` is an integer vector); the expression grows with ``‖μ‖``, so
   ``‖μ‖ ≤ Δ_k`` gives the continuous Gaussian's at ``s/Δ_k ≥ σ/EFFECTIVE_FACTOR``. Hence integer
   orders only (``INTEGER_ORDERS``; dp-accounting's integer-order formula is this sum).
2. ``D_λ(P₀ ‖ M) ≤ D_λ(M ‖ P₀)`` for every ``q`` and ``λ ≥ 1`` (review 46 gave this short proof).
   The involution ``σ(y) = μ − y`` maps ``P₀`` to ``P_μ``, so the likelihood ratio ``ℓ = P_μ/P₀``
   satisfies ``ℓ(σy) = 1/ℓ(y)`` and ``P₀(σy) = ℓ(y)P₀(y)``. With ``A = E_{P₀}[(1−q+qℓ)^λ]`` and
   ``B = E_{P₀}[(1−q+qℓ)^(1−λ)]`` (the two directions' ``exp((λ−1)D_λ)``), summing each orbit
   ``{y, σy}`` together gives ``A − B = Σ P₀(y)·G(ℓ(y))`` over one point per orbit, where
   ``G(x) = h(u) + x·h(v)``, ``h(t) = t^λ − t^(1−λ)``, ``u = 1 − q + qx``, ``v = 1 − q + q/x`` (a
   fixed point has ``ℓ = 1`` and ``G(1) = 0``). ``G(1/x) = G(x)/x``, so take ``x ≥ 1``. From
   ``h(1/t) = −h(t)/t`` and ``u − 1 = x(1 − v)``: ``G = (u − 1)·(r(u) − r(1/v))`` with
   ``r(t) = h(t)/(t − 1)``. ``h`` is convex on ``[1, ∞)`` (``h'' = λ(λ−1)(t^(λ−2) − t^(−λ−1)) ≥ 0``
   there) with ``h(1) = 0``, so ``r`` does not decrease there; and
   ``uv = (1−q)² + q(1−q)(x + 1/x) + q² ≥ 1``, so ``u ≥ 1/v ≥ 1``: ``G ≥ 0``, ``A ≥ B``. (Checked
   numerically over a grid in ``tests/test_integer_noise.py``.)

The PLD accountant is refused (no dominance proof for the discrete pair); zCDP holds as is
(Canonne, Kamath and Steinke 2020: ``ρ = ‖μ‖²/(2s²)`` for integer shifts; no sampling there).
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import torch

from . import _ops

GUARD_BITS = 14
#: The noise multiplier charged is ``σ/EFFECTIVE_FACTOR`` (module docstring: the bound is 1 + 2⁻¹³ + 2⁻⁶⁶).
EFFECTIVE_FACTOR = 1.0 + 2.0 ** -12
#: The RDP orders of the integer release (integer orders only: module docstring).
INTEGER_ORDERS = tuple(range(2, 257))
MAX_SIGMA_UNITS = 1 << 52
MAX_GRID_EXP = 1000


def grid_bits(coordinates: int) -> int:
    """``g = ⌈log₂√D⌉ + GUARD_BITS``: the smallest ``b`` with ``4^b ≥ D``, plus the guard."""
    d = max(int(coordinates), 1)
    log2_ceil = (d - 1).bit_length()  # ⌈log₂ D⌉
    return (log2_ceil + 1) // 2 + GUARD_BITS


def grid_exp(delta: float, bits: int) -> int:
    """``⌊log₂Δ⌋ − bits`` (exact: frexp)."""
    _, e = math.frexp(float(delta))
    return e - 1 - int(bits)


@functools.lru_cache(maxsize=256)
def sigma_units(noise_multiplier: float, delta: float, exp: int) -> int:
    """``⌈σΔ/2^exp⌉`` in exact rational arithmetic (never below ``σΔ/γ``)."""
    value = Fraction(noise_multiplier) * Fraction(delta) / Fraction(2) ** exp
    return math.ceil(value)


def problem(name: str, noise_multiplier: float, delta: float, bits: int) -> str | None:
    """Why ``Δ`` cannot be released on the grid (``None`` when it can)."""
    if not (math.isfinite(delta) and delta > 0):
        return f"{name}: its sensitivity {delta!r} is not a positive finite number"
    e = grid_exp(delta, bits)
    if abs(e) > MAX_GRID_EXP:
        return f"{name}: the grid 2^{e} of its sensitivity {delta:g} is outside 2^±{MAX_GRID_EXP}"
    if sigma_units(float(noise_multiplier), float(delta), e) > MAX_SIGMA_UNITS:
        return (f"{name}: noise_multiplier {noise_multiplier:g} is too large for the integer release "
                f"(σΔ/γ above 2^52; at most 2^{51 - bits})")
    return None


class Due:
    """One draw to release: the layer's key, the grid and the noise in grid units."""

    __slots__ = ("seed", "offset", "exp", "sigma", "multiplier")

    def __init__(self, seed, offset, noise_multiplier, delta, bits, multiplier):
        self.seed, self.offset = int(seed), int(offset)
        self.exp = grid_exp(delta, bits)
        self.sigma = sigma_units(float(noise_multiplier), float(delta), self.exp)
        self.multiplier = float(multiplier)


def release(params, grads, due: Due) -> None:
    """Releases the layer's gradients in place: ``grads[j]`` (``None``: not released) of
    ``params[j]``, the layer's parameters in their fixed order, element positions counted over all
    of them (a frozen parameter keeps its positions)."""
    first = 0
    for p, g in zip(params, grads):
        if g is not None:
            _ops.integer_release_(g, due.seed, due.offset, first, due.multiplier, due.exp, due.sigma,
                                  1.0 / due.multiplier)
        first += p.numel() if p is not None else 0


def release_into(params, due: Due) -> None:
    """The fallback: every trainable parameter's ``.grad`` (zeros where it has none) released, at the
    positions :func:`release` gives it."""
    for p in params:
        if p is not None and p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    release(params, [p.grad if p is not None and p.requires_grad else None for p in params], due)
