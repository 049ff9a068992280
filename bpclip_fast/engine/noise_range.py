"""The noise std range, checked where it cannot depend on the data.

Every draw's std must be 0 or within the kernels' range (:func:`bpclip_fast._ops.noise_std_ok`:
``[2^-80, 1e30)``). Under the mean loss a layer's backward draws ``σ·Δ/d``, ``d`` the rows of the
sampled batch, so a std that left the range only for some ``d`` would make the backward fail on
some batch sizes and not others: an error that depends on the data, and a loop that caught it and
stepped would release noise alone for those batches and the clipped sum for the rest (review 39 F1).
``make_private`` therefore refuses a setting whose std could leave the range for any batch (and a
later ``set_max_input_shape`` takes no shape smaller than the one checked), and the layers' backward
refuses (charged, with a message that names no value) whatever still gets out of it.

The std a step can draw, per layer, is ``σΔ`` times:

* under ``loss_reduction="mean"``: ``1/d`` in the backward, ``d`` from 1 to at most ``N`` under
  Poisson sampling (the data set's size; a DDP rank's share is smaller) or the global batch ``B·W``
  for fixed batches (a rank's share of a shuffled global batch can exceed ``B``), and ``1/(B̄·W)`` for
  the fallback draw of a layer no backward reached (``W`` processes, each adding the same draw
  divided by ``W``);
* under ``"sum"``: 1 in the backward, ``1/W`` for the fallback draw;

and adaptive thresholds keep each threshold within ``10^6`` of its initial value, so ``Δ`` within
``10^(6k)`` for a mode of ``k`` thresholds per layer (backprop's ``Δ`` is their product); a factor 2
beyond that covers a checkpoint's thresholds at the clamp's edge and its log-space rounding. The
smallest std is computed as ``σΔ`` divided by the largest divisor, as the backward divides
(``σΔ/d``), so the two round alike at the edge.

Banded noise draws its rows at ``σΔ/(B̄·c₀)`` (:mod:`bpclip_fast.banded`), a std of no batch's
size: :func:`bpclip_fast.engine.correlated.check_row_std` refuses it at ``make_private`` when it
leaves the range (before, its op refused at the first step: review 40 F8).
"""

from __future__ import annotations

from .. import _ops
from .. import adaptive as _adaptive


def multipliers(mean_loss: bool, num_samples: int, batch_size: float, world_size: int, poisson: bool,
                thresholds_per_layer: int, adaptive: bool) -> tuple[float, float]:
    """``(divisor, factor)``: every std a step of this run draws for a layer lies in
    ``[σΔ/divisor, σΔ·factor]``."""
    factor = 2.0 * float(_adaptive._CLAMP) ** thresholds_per_layer if adaptive else 1.0
    w = max(int(world_size), 1)
    fallback = float(batch_size) * w if mean_loss else float(w)
    backward = (float(num_samples) if poisson else float(batch_size) * w) if mean_loss else 1.0  # a rank's share
    return factor * max(fallback, backward, 1.0), factor


def problem(name: str, sigma: float, delta: float, span: tuple[float, float], low_end: bool = True) -> str | None:
    """Why ``σ·Δ`` over ``span`` (:func:`multipliers`) leaves the kernels' range, or ``None``.
    ``low_end=False``: only the high end (a Δ that grew: its low end cannot have left the range)."""
    if sigma == 0:
        return None
    std = sigma * delta
    low, high = std / span[0], std * span[1]  # low as the backward divides: σΔ/d
    if (not low_end or _ops.MIN_NOISE_STD <= low) and high < _ops.MAX_NOISE_STD:
        return None
    return (f"{name}: its noise std σ·Δ = {sigma:g}·{delta:g} over the batch sizes, the fallback draw and the adaptive "
            f"thresholds' clamp this run allows would reach [{low:.3g}, {high:.3g}], outside the kernels' range "
            f"({_ops.NOISE_STD_RULE}); use a clipping norm and noise_multiplier whose product is not so small (or so "
            "large), or scale the data or the loss")
