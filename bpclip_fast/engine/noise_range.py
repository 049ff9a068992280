"""The noise std range, checked where it cannot depend on the data.

Every draw's std must be 0 or within the kernels' range (:func:`bpclip_fast._ops.noise_std_ok`:
``[2^-80, 1e30)``). A layer's backward draws ``σ·Δ/d`` under the mean loss, ``d`` the rows of the
sampled batch, so a std that leaves the range only for some ``d`` would make the backward fail on
some batch sizes and not others: an error that depends on the data, and a loop that caught it and
stepped would release noise alone for those batches and the clipped sum for the rest (review 39 F1).
``make_private`` therefore refuses a setting whose std could leave the range for any batch, and the
layers' backward refuses (charged, with a message that names no value) whatever still gets out of it.

Over one run ``d`` ranges over ``1 .. N`` (``N`` the data set's size: a Poisson batch is at most all
of it; a DDP rank's shard too), the fallback draw of a layer no backward reached is ``σ·Δ/(B̄·W)``,
and adaptive thresholds keep each threshold within a factor ``10^6`` of its initial value, so ``Δ``
within ``10^(6k)`` for a mode of ``k`` thresholds per layer (backprop's ``Δ`` is their product). Every
std a step can draw lies in ``[σΔ/(F·max(N, B̄)·W), σΔ·F]`` with ``F`` that factor, and it is checked
at both ends.
"""

from __future__ import annotations

from .. import _ops
from .. import adaptive as _adaptive


def problems(layers, sensitivities, sigma: float, num_samples: int, expected_batch: float, world_size: int,
             thresholds_per_layer: int, adaptive: bool) -> list:
    """The layers whose noise std could leave the kernels' range in some step: ``[message]``."""
    if sigma == 0:
        return []
    factor = float(_adaptive._CLAMP) ** thresholds_per_layer if adaptive else 1.0
    rows = max(float(num_samples), float(expected_batch), 1.0) * max(int(world_size), 1)
    out = []
    for layer, delta in zip(layers, sensitivities):
        low, high = sigma * delta / factor / rows, sigma * delta * factor
        if low < _ops.MIN_NOISE_STD or high >= _ops.MAX_NOISE_STD:
            out.append(f"{layer.layer_name}: its noise std σ·Δ/d = {sigma:g}·{delta:g}/d would range over "
                       f"[{low:.3g}, {high:.3g}] over the batches this run can sample (d up to {rows:g} rows"
                       + (", the adaptive thresholds' clamp" if adaptive else "") + f"), outside the kernels' "
                       f"range ({_ops.NOISE_STD_RULE}); scale the data or the loss so that the clipping norm "
                       "is not so small (or so large)")
    return out


def out_of_range(std: float) -> bool:
    """Whether a draw's std is outside the kernels' range (0 is no draw)."""
    return not _ops.noise_std_ok(std)
