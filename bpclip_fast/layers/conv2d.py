"""The clipped ``nn.Conv2d`` (backprop, flat and per_layer), its bounds, its registration and the
padding check.

Sensitivity bounds (backpropagation clipping)
---------------------------------------------
Every clipped layer bounds the Frobenius norm of one example's contribution to ``[∇W, ∇b]``. With
clipped input ``x̃`` (``‖x̃‖₂ ≤ C_x`` over all non-batch dims) and clipped upstream gradient ``g̃``:

*Conv2d, norm l15* (``l15(g̃) = √(Σ_c (Σ_hw |g̃_chw|)²) ≤ C_g``), zero padding, any stride,
dilation and groups. Row ``c`` of ``[∇W, ∇b]`` is ``Σ_hw g̃_chw [P_hw(x̃); 1]`` where the patch
``P_hw(x̃)`` holds distinct entries of ``x̃`` (of one channel group) or zeros, so
``‖[P_hw; 1]‖ ≤ √(C_x² + [bias])`` and the triangle inequality gives
``‖row_c‖ ≤ Σ_hw |g̃_chw| √(C_x² + [bias])``; summing squares over ``c``:
``Δ = C_g √(C_x² + [bias])``. Attained when the output is 1×1 (the kernel covers the input).
Other padding modes can repeat an entry inside a patch, so they are refused.

*Conv2d, norm l2* (``‖g̃‖₂ ≤ C_g``). Per group ``j``, ``∇W_j = G_j P_jᵀ`` with ``P_j`` the
im2col matrix (a column per output position); ``‖G_j P_jᵀ‖_F ≤ ‖G_j‖_F ‖P_j‖₂`` and
``‖[P_j; 1ᵀ]‖₂² ≤ ‖P_j‖_F² + HW_out = Σ_e mult(e) x̃_e² + HW_out ≤ m‖x̃_j‖² + HW_out`` where
``mult(e)`` counts the (output position, kernel offset) pairs that read entry ``e`` and ``m`` is
its maximum. Summing over groups, ``Δ = C_g √(m C_x² + [bias]·HW_out)``.

The three clip functions (clip, global, normalize) all keep the clipped norm ``≤ C``, so the
bounds hold for each. ``tests/test_sensitivity.py`` checks every bound against exact per-example
gradients from ``torch.func`` and its attainment.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from .. import autograd, compiled, compiled_backprop, exact, registry
from .base import _Clipped, _Public, _in_parameter_dtype

CONV_NORMS = ("l15", "l2")


@functools.lru_cache(maxsize=256)
def _max_patch_multiplicity(size: int, out: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """The most (output position, kernel offset) pairs that read one input position, along one dim."""
    counts = [0] * size
    for o in range(out):
        for k in range(kernel):
            i = o * stride - padding + k * dilation
            if 0 <= i < size:
                counts[i] += 1
    return max(counts, default=0)


class Conv2d(_Public, _Clipped, nn.Conv2d):
    """``nn.Conv2d`` whose inputs (L2) and upstream gradients (``norm``: l15 or l2) are clipped per example.

    Zero padding only: other padding modes can repeat an input entry inside one patch, which the
    l15 bound does not allow for.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, *, input_clip=None, grad_clip=None, norm="l15", clip_fn="clip", gamma=0.01,
                 padding_mode="zeros", clipping="backprop", max_grad_norm=None, norm_method="auto", device=None,
                 dtype=None):
        if padding_mode != "zeros":
            raise ValueError(f"Conv2d: padding_mode={padding_mode!r} is not supported: only 'zeros' keeps every "
                             "input entry at most once in a patch, which the sensitivity bound needs")
        if norm not in CONV_NORMS:
            raise ValueError(f"Conv2d: norm must be one of {CONV_NORMS}, got {norm!r}")
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                         groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype)
        self.norm = norm
        self._bp_init_clipping(input_clip, grad_clip, clip_fn, gamma, clipping, max_grad_norm, norm_method)
        self._explicit_padding = self._resolve_padding()

    def _resolve_padding(self):
        if not isinstance(self.padding, str):
            return tuple(self.padding)
        if self.padding == "valid":
            return (0, 0)
        pads = []
        for k, d in zip(self.kernel_size, self.dilation):
            total = d * (k - 1)
            if total % 2:
                raise ValueError(f"Conv2d: padding='same' with kernel {self.kernel_size} and dilation "
                                 f"{self.dilation} needs asymmetric padding; pass explicit padding instead")
            pads.append(total // 2)
        return tuple(pads)

    def _out_hw(self, h, w):
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel_size, self.stride, self._explicit_padding, self.dilation
        return (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1

    def _bp_shape_dependent(self, input_shape) -> bool:
        return not self.exact and self.norm == "l2"

    def _bp_shape_rule(self) -> str:
        return "with norm='l2' Δ grows with the input's height and width"

    def sensitivity_for(self, input_shape=None) -> float:
        """l15: ``C_g √(C_x² + [bias])``; l2: ``C_g √(m C_x² + [bias]·HW_out)`` (module docstring); the
        noise bound ``C`` under exact clipping."""
        if self.exact:
            return self._bp_noise_bound
        bias = 1 if self.bias is not None else 0
        if self.norm == "l15":
            return self._bp_grad_clip * math.sqrt(self._bp_input_clip ** 2 + bias)
        if input_shape is None:
            raise RuntimeError(f"{self.layer_name}: with norm='l2' the sensitivity depends on the input's height "
                               "and width; call sensitivity_for(input_shape) or run a forward pass first")
        h, w = input_shape[-2], input_shape[-1]
        oh, ow = self._out_hw(h, w)
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel_size, self.stride, self._explicit_padding, self.dilation
        m = _max_patch_multiplicity(h, oh, kh, sh, ph, dh) * _max_patch_multiplicity(w, ow, kw, sw, pw, dw)
        return self._bp_grad_clip * math.sqrt(m * self._bp_input_clip ** 2 + bias * oh * ow)

    @_in_parameter_dtype
    def forward(self, x):
        x = self._bp_check_input(x)
        if x.dim() != 4:
            raise ValueError(f"{self.layer_name}: the input must be [B, C, H, W]; got shape {tuple(x.shape)}")
        if self.exact:
            geometry = (list(self.stride), list(self._explicit_padding), list(self.dilation), self.groups)
            if torch.compiler.is_compiling():  # opaque ops, no Python read per step (compiled.py)
                return compiled.exact_layer(x, self, geometry)
            return exact.exact_layer(x, self, self._bp_noise_sensitivity(x), geometry)
        if torch.compiler.is_compiling():
            return compiled_backprop.backprop_layer(x, self, self._explicit_padding)
        sens = self._bp_noise_sensitivity(x)
        return autograd.clipped_conv2d(x, self.weight, self.bias, self, sens, self._explicit_padding)

    def extra_repr(self):
        norm = "" if self.exact else f", norm={self.norm!r}"
        return f"{super().extra_repr()}{norm}, {self._bp_clip_repr()}"


def _convert_conv2d(layer: nn.Conv2d, **clipping) -> Conv2d:
    return Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                  padding=layer.padding, dilation=layer.dilation, groups=layer.groups, bias=layer.bias is not None,
                  device="meta", dtype=layer.weight.dtype, **clipping)


registry.register_layer(nn.Conv2d, Conv2d, convert=_convert_conv2d,
                        plain=lambda layer, x, p: nn.Conv2d._conv_forward(layer, x, p["weight"], p.get("bias")),
                        taps=lambda layer: layer.weight[0, 0].numel())


@registry.register_module_check(nn.Conv2d)
def _conv_padding_mode(module):
    if module.padding_mode == "zeros":
        return None
    return (f"padding_mode={module.padding_mode!r}; only 'zeros' keeps the sensitivity bound (pad explicitly "
            "with torch.nn.functional.pad before the layer instead)")
