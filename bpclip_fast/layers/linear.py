"""The clipped ``nn.Linear`` (backprop, flat and per_layer), its bound and its registration.

Sensitivity bound (backpropagation clipping)
--------------------------------------------
Every clipped layer bounds the Frobenius norm of one example's contribution to ``[∇W, ∇b]``. With
clipped input ``x̃`` (``‖x̃‖₂ ≤ C_x`` over all non-batch dims) and clipped upstream gradient ``g̃``:

*Linear*, input ``[B, *, in]`` with ``T`` positions in ``*`` (T = 1 for 2-D input),
``‖g̃‖₂ ≤ C_g`` over all non-batch dims. ``∇W = Σ_t g̃_t x̃_tᵀ`` so, by the triangle and
Cauchy–Schwarz inequalities, ``‖∇W‖ ≤ Σ_t ‖g̃_t‖‖x̃_t‖ ≤ ‖g̃‖‖x̃‖ ≤ C_g C_x``; ``∇b = Σ_t g̃_t`` so
``‖∇b‖ ≤ √T ‖g̃‖ ≤ √T C_g``. Hence ``Δ = C_g √(C_x² + T·[bias])``. Attained: all ``x̃_t`` equal
(norm ``C_x/√T``) and all ``g̃_t`` equal (norm ``C_g/√T``, one direction).

The three clip functions (clip, global, normalize) all keep the clipped norm ``≤ C``, so the
bounds hold for each. ``tests/test_sensitivity.py`` checks every bound against exact per-example
gradients from ``torch.func`` and its attainment.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import autograd, compiled, compiled_backprop, exact, registry
from .base import _Clipped, _Public, _in_parameter_dtype


class Linear(_Public, _Clipped, nn.Linear):
    """``nn.Linear`` whose inputs and upstream gradients are clipped per example (L2 norms).

    Input ``[B, *, in_features]``; each example's norm is taken over all its non-batch dims.
    """

    def __init__(self, in_features, out_features, bias=True, *, input_clip=None, grad_clip=None, clip_fn="clip",
                 gamma=0.01, clipping="backprop", max_grad_norm=None, norm_method="auto", device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._bp_init_clipping(input_clip, grad_clip, clip_fn, gamma, clipping, max_grad_norm, norm_method)

    def _bp_shape_dependent(self, input_shape) -> bool:
        return not self.exact and self.bias is not None and (input_shape is None or len(input_shape) > 2)

    def _bp_shape_rule(self) -> str:
        return "a biased Linear's Δ grows with the positions T of a [B, T, in] input"

    def sensitivity_for(self, input_shape=None) -> float:
        """``C_g √(C_x² + T·[bias])``, T the positions between batch and feature dims (module docstring);
        the noise bound ``C`` under exact clipping."""
        if self.exact:
            return self._bp_noise_bound
        tokens = 1 if input_shape is None else math.prod(input_shape[1:-1])
        bias = 1 if self.bias is not None else 0
        return self._bp_grad_clip * math.sqrt(self._bp_input_clip ** 2 + tokens * bias)

    @_in_parameter_dtype
    def forward(self, x):
        x = self._bp_check_input(x)
        if x.dim() < 2:
            raise ValueError(f"{self.layer_name}: the input needs a batch dimension, [B, *, {self.in_features}]; "
                             f"got shape {tuple(x.shape)}")
        if torch.compiler.is_compiling():  # opaque ops, no Python read per step (compiled.py)
            return compiled.exact_layer(x, self) if self.exact else compiled_backprop.backprop_layer(x, self)
        sens = self._bp_noise_sensitivity(x)
        if self.exact:
            return exact.exact_layer(x, self, sens)
        return autograd.clipped_linear(x, self.weight, self.bias, self, sens)

    def extra_repr(self):
        return f"{super().extra_repr()}, {self._bp_clip_repr()}"


def _convert_linear(layer: nn.Linear, **clipping) -> Linear:
    clipping.pop("norm", None)
    return Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta",
                  dtype=layer.weight.dtype, **clipping)


registry.register_layer(nn.Linear, Linear, convert=_convert_linear,
                        plain=lambda layer, x, p: F.linear(x, p["weight"], p.get("bias")))
