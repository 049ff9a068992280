"""``clipping="backprop"``: each layer's input and upstream gradient clipped per example
(``input_clip``, ``grad_clip``), noise ``N(0, σ²Δ_l²)`` per layer (:mod:`bpclip_fast.nn`'s bounds)."""

from __future__ import annotations

import math

from .base import Mode, check_positive, request_positive


class Backprop(Mode):
    name = "backprop"
    threshold_attrs = ("input_clip", "grad_clip")

    def check_request(self, input_clip, grad_clip, max_grad_norm) -> None:
        if input_clip is None or grad_clip is None:
            raise TypeError("make_private: clipping='backprop' needs input_clip and grad_clip (or use "
                            "clipping='flat' with max_grad_norm, as in Opacus)")
        if max_grad_norm is not None:
            raise TypeError("make_private: max_grad_norm belongs to clipping='flat'/'per_layer'; backpropagation "
                            "clipping takes input_clip and grad_clip")
        request_positive(input_clip, "input_clip")
        request_positive(grad_clip, "grad_clip")

    def layer_bounds(self, kind: str, input_clip, grad_clip, max_grad_norm) -> tuple:
        if input_clip is None or grad_clip is None:
            raise TypeError(f"{kind}: clipping='backprop' needs input_clip and grad_clip (the per-example bounds "
                            "of the layer's input and upstream gradient)")
        if max_grad_norm is not None:  # it would be dropped: the layer clips its input and upstream gradient
            raise TypeError(f"{kind}: max_grad_norm applies to clipping='flat' or 'per_layer'; clipping='backprop' "
                            "clips each example's input (input_clip) and upstream gradient (grad_clip)")
        return check_positive(input_clip, "input_clip", kind), check_positive(grad_clip, "grad_clip", kind), None

    def conversion_settings(self, *, input_clip, grad_clip, norm, norm_method) -> dict:
        return dict(input_clip=input_clip, grad_clip=grad_clip, norm=norm)

    # The layers' L Gaussians are independent, so one step is a Gaussian of effective σ_eff = (Σ_l σ_l⁻²)^(-1/2);
    # with one σ for all, σ = σ_eff·√L.
    def sigma_factor(self, n_layers: int) -> float:
        return math.sqrt(n_layers)

    def effective_sigma(self, sigma: float, n_layers: int) -> float:
        from .. import accounting  # imported lazily: the accounting package is optional at import time

        return float(accounting.effective_noise_multiplier([sigma] * n_layers))

    def set_thresholds(self, layers, values, collector) -> None:
        for layer, cx, cg in zip(layers, values[0::2], values[1::2]):
            layer._bp_set_bounds(input_clip=cx, grad_clip=cg)
