"""``clipping="per_layer"``: each layer's exact per-example gradient clipped to its own ``C_l``;
every layer's noise is scaled to ``C = (Σ_l C_l²)^½`` over all the model's layers."""

from __future__ import annotations

import math

from .base import ExactMode, check_positive, request_positive


def noise_bound(thresholds) -> float:
    """``(Σ_l C_l²)^½`` rounded up: ``math.hypot`` errs by under one ulp (Python ≥ 3.10) and neither
    underflows nor overflows, and one step up makes it an upper bound on the exact root. (The plain
    ``√(Σ C_l²)`` in double was 0 for thresholds below ~1e-154, so those layers drew no noise, and
    could fall an ulp below the root.)"""
    return math.nextafter(math.hypot(*thresholds), math.inf)


class PerLayer(ExactMode):
    name = "per_layer"

    def check_max_grad_norm(self, max_grad_norm) -> None:
        if isinstance(max_grad_norm, (list, tuple)):  # one C_l per layer (their count is checked at conversion)
            for c in max_grad_norm:
                request_positive(c, "max_grad_norm")
        else:
            request_positive(max_grad_norm, "max_grad_norm")

    def layer_thresholds(self, max_grad_norm, count: int) -> list:
        """A list of ``C_l`` (one per layer, in ``named_modules`` order), or a scalar ``C`` split as ``C/√L``."""
        if not isinstance(max_grad_norm, (list, tuple)):
            value = check_positive(max_grad_norm, "max_grad_norm", "convert_model")
            return [value / math.sqrt(max(count, 1))] * count
        if len(max_grad_norm) != count:
            raise ValueError(f"convert_model: max_grad_norm has {len(max_grad_norm)} thresholds but the model has "
                             f"{count} layers to clip (one per trainable layer of a registered type, in named_modules "
                             "order)")
        return [check_positive(c, "max_grad_norm", "convert_model") for c in max_grad_norm]

    def settle(self, module, layers, max_grad_norm, clip_fn: str, gamma: float) -> None:
        # An example's whole gradient has norm ≤ (Σ_l C_l²)^½: each layer's noise is scaled to that.
        total = noise_bound([layer._bp_max_grad_norm for layer in layers])
        for layer in layers:
            layer._bp_noise_bound = total

    def set_thresholds(self, layers, values, collector) -> None:
        total = noise_bound(values)
        for layer, c in zip(layers, values):
            layer._bp_set_bounds(max_grad_norm=c, noise_bound=total)
