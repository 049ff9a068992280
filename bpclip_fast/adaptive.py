"""Adaptive clipping thresholds (Andrew et al., 2021; DESIGN.md §6) for every clipping mode.

Each threshold ``C_k`` follows a target quantile ``γ`` of the norms it clips. Per step the engine
releases, beside the gradient, one noisy count per threshold

    b̃_k = Σ_{i in batch} (1[n_{k,i} ≤ C_k] − ½) + N(0, σ_b²),

and after the step sets ``C_k ← C_k · exp(−η (b̃_k/B̄ + ½ − γ))`` (``B̄`` the expected batch size, a
public constant): ``b̃_k/B̄ + ½`` estimates the fraction of examples the threshold left unclipped,
so ``C_k`` shrinks when more than ``γ`` are below it and grows otherwise. The norms ``n_{k,i}``:

* ``flat``: one threshold, ``n_i`` the norm of example ``i``'s whole gradient;
* ``per_layer``: one per layer, ``‖G_{l,i}‖``;
* ``backprop``: two per layer, the norms of example ``i``'s input and upstream gradient that
  ``input_clip`` and ``grad_clip`` bound (L2; Conv2d's gradient in the layer's ``conv_norm``).

Under a mean loss the layers compare ``n/d`` with ``C/d`` (``d`` the backward's rows), which is the
same indicator (``bpclip_fast.engine``: the clipping is invariant under a common scale).

One Gaussian mechanism, and the noise split
-------------------------------------------
*Claim.* With ``k`` counts, gradient noise of multiplier ``σ_Δ`` (on the gradient's sensitivity)
and count noise ``σ_b``, a step is one Gaussian mechanism of noise multiplier ``σ`` where

    σ⁻² = σ_Δ⁻² + k·(2σ_b)⁻²,

so the accountant is stepped with the nominal ``σ`` (the one the user gave or ``ε`` calibrated)
and the gradient gets ``σ_Δ = (σ⁻² − k(2σ_b)⁻²)^−½`` (it exists iff ``σ_b > √k·σ/2``; refused
otherwise). *Proof.* Under add/remove adjacency example ``i`` moves the gradient release by a
vector of norm at most ``Δ`` (every mode's sensitivity; backprop: ``(Σ_l Δ_l²)^½`` after the
per-layer rescaling of ``bpclip_fast.engine``, with ``σ`` there the effective multiplier ``σ/√L``)
and each count by exactly ``½`` (its term ``1[·] − ½`` appears or not); all these coordinates carry
independent Gaussian noise, of std ``σ_Δ·Δ`` and ``σ_b``. Dividing each coordinate by its noise
std gives a mechanism with unit noise whose sensitivity is ``(Δ²/(σ_Δ Δ)² + k·(½)²/σ_b²)^½ =
(σ_Δ⁻² + k(2σ_b)⁻²)^½ = σ⁻¹``: the Gaussian mechanism of multiplier ``σ``. Poisson subsampling
acts on the whole vector at once (one batch for the gradient and the counts), so the subsampled
step is the subsampled Gaussian of multiplier ``σ`` too. Under replace-one adjacency both
sensitivities double (``2Δ``, ``1``) and the ratio is the same. The thresholds of step ``t+1`` are
a function of the releases up to ``t`` (post-processing), and each step is a ``σ``-Gaussian
whatever its ``C_k``: adaptive composition of identical mechanisms, which RDP, PLD and zCDP all
cover. ∎  (``tests/test_adaptive.py`` checks the identity against ``dp_accounting``'s composition
of the separate Gaussians.)

The thresholds are clamped to ``[C_k⁰·10⁻⁶, C_k⁰·10⁶]`` around their initial values (a public
post-processing) so that no run of noisy counts can drive one to 0 or infinity.

Count noise default: ``σ_b = σ·√(2.5·k)``, which gives the counts a tenth of the step's
``σ⁻²`` (``σ_Δ = σ/√0.9``, 5.4% more gradient noise) whatever the batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Adaptive", "noise_split", "Thresholds"]

COUNT_SHARE = 0.1  # the default count noise spends this share of the step's σ⁻²
_CLAMP = 1e6       # thresholds stay within [C⁰/_CLAMP, C⁰·_CLAMP]


@dataclass(frozen=True)
class Adaptive:
    """Options of adaptive clipping thresholds (``make_private(..., adaptive=Adaptive(...))``).

    ``target_quantile``: the fraction ``γ`` of examples each threshold should leave unclipped.
    ``learning_rate``: ``η`` of the geometric update. ``count_noise``: ``σ_b``, the std of the noise
    on each count, in examples (``None``: ``σ·√(2.5·k)``, a tenth of the step's privacy; see the
    module docstring). The initial thresholds are the mode's own bounds (``max_grad_norm``, or
    ``input_clip``/``grad_clip``)."""

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise: float | None = None

    def __post_init__(self):
        if not 0.0 < float(self.target_quantile) < 1.0:
            raise ValueError(f"Adaptive: target_quantile must be in (0, 1), got {self.target_quantile!r}")
        if not (math.isfinite(float(self.learning_rate)) and float(self.learning_rate) > 0):
            raise ValueError(f"Adaptive: learning_rate must be positive and finite, got {self.learning_rate!r}")
        if self.count_noise is not None and not (math.isfinite(float(self.count_noise))
                                                 and float(self.count_noise) > 0):
            raise ValueError(f"Adaptive: count_noise must be positive and finite (or None for the default), got "
                             f"{self.count_noise!r}")


def noise_split(sigma: float, k: int, count_noise: float | None) -> tuple[float, float]:
    """``(σ_Δ, σ_b)``: the gradient's noise multiplier and the counts' noise std for a step of
    nominal multiplier ``sigma`` with ``k`` counts (module docstring). Raises where ``σ_Δ`` does not
    exist."""
    sigma = float(sigma)
    sigma_b = sigma * math.sqrt(k / (4.0 * COUNT_SHARE)) if count_noise is None else float(count_noise)
    rest = sigma ** -2 - k / (2.0 * sigma_b) ** 2
    if not rest > 0:
        raise ValueError(
            f"make_private: adaptive count_noise={sigma_b:g} is too small for noise_multiplier σ={sigma:g} "
            f"(effective) with {k} thresholds: the counts alone would spend more than the step's privacy "
            f"(σ_b must exceed √k·σ/2 = {math.sqrt(k) * sigma / 2:g}). Raise count_noise, or pass "
            "count_noise=None for the default (a tenth of the step's privacy)")
    return rest ** -0.5, sigma_b


class Thresholds:
    """The engine's adaptive thresholds: their names, values and update (module docstring); the
    engine reads the counts from the layers and writes the values back to them."""

    def __init__(self, options: Adaptive, names, initial, expected_batch: float, sigma_b: float):
        self.options = options
        self.names = list(names)
        self.initial = [float(c) for c in initial]
        self.values = list(self.initial)
        self.expected_batch = float(expected_batch)
        self.sigma_b = float(sigma_b)

    def proposed(self, noisy_counts) -> list[float]:
        """``C_k·exp(−η(b̃_k/B̄ + ½ − γ))``, clamped (in log space: no overflow whatever the counts);
        changes nothing (the engine computes it before the step's release, sets it after)."""
        eta, gamma = float(self.options.learning_rate), float(self.options.target_quantile)
        new = []
        for c, c0, b in zip(self.values, self.initial, noisy_counts):
            log_c = math.log(c) - eta * (float(b) / self.expected_batch + 0.5 - gamma)
            log_c = min(max(log_c, math.log(c0) - math.log(_CLAMP)), math.log(c0) + math.log(_CLAMP))
            new.append(math.exp(log_c))
        return new

    def within_range(self, values) -> bool:
        """Whether ``values`` lie within the clamp range (a checkpoint's thresholds must)."""
        return len(values) == len(self.initial) and all(
            math.isfinite(v) and c0 / _CLAMP * (1 - 1e-12) <= v <= c0 * _CLAMP * (1 + 1e-12)
            for v, c0 in zip(values, self.initial))

    def noisy(self, centered: torch.Tensor, seed: int, counter: int) -> list[int]:
        """``b̃_k = round(centered_k + N(0, σ_b²))`` with ``centered_k = Σ_{i in batch} (1[n_{k,i} ≤ C_k] − ½)``
        (float64, CPU; an example that did not reach a layer has gradient norm 0 there, so it counts
        as unclipped).

        The rounding is what makes the noise hide the count in floating point: the thresholds are a
        deterministic function of ``b̃`` and are published, so ``b̃`` is known to the last bit, and an
        unrounded ``c + w`` with ``w`` on a finite grid of floats can rule out ``c ± ½`` (the
        floating-point attack on the Laplace/Gaussian mechanism, Mironov 2012). Rounded to an
        integer, ``b̃`` is post-processing of ``c + w``; ``w`` is drawn in float64 (numpy's
        Philox4x64-10 keyed by the engine's seed and this step's ``counter``, its 53-bit normals), so
        each integer's probability is that of the exact Gaussian up to ~2⁻⁵⁰, and the mechanism is the
        Gaussian one followed by rounding."""
        rng = np.random.Generator(np.random.Philox(key=(int(seed) << 64) | int(counter)))
        noise = torch.from_numpy(rng.standard_normal(len(self.names)) * self.sigma_b)
        return torch.round(centered.to(torch.float64) + noise).to(torch.int64).tolist()
