"""The clipped ``nn.Conv1d`` (backprop, flat and per_layer), its bounds, its registration and its
padding check.

A Conv1d is the Conv2d of kernel height 1 on inputs of height 1: input ``[B, C, L] -> [B, C, 1, L]``,
weight ``[O, C/G, k] -> [O, C/G, 1, k]`` (:data:`bpclip_fast.exact.HEIGHT_ONE`), stride, padding and
dilation ``(1, s)``, ``(0, p)``, ``(1, d)``. Every product ``g_{o,t} x_{c,t·s−p+j·d}`` of the Conv1d's
weight gradient is the Conv2d's at height 0, so the fused Conv2d norms and release (csrc/exact.cpp,
csrc/exact_release.cpp) compute its exact per-example clipping, with their proofs unchanged.
``padding='same'`` with an odd total ``d·(k−1)`` pads the extra zero on the right, as torch does,
explicitly before the kernel: zeros add no product.

Backpropagation clipping runs the Conv2d's autograd Function (``autograd._ClippedConv2d``) and
compiled op on that view: they receive the parameter itself, hand the ops ``exact.kernel_weight``'s
view of it and map the release back with ``exact._param_layout`` before it is recorded, so the
parameter's ``.grad`` is the very tensor the layer released (the step boundary's check).

Sensitivity bounds (backpropagation clipping)
---------------------------------------------
The Conv2d proofs (``layers/conv2d.py``) at ``H = 1``. What carries over unchanged: the clipped
input's norm (``‖x̃‖₂`` over ``[C, L]`` is its norm over ``[C, 1, L]``, the same entries) and the
clipped upstream gradient's (``l15(g̃) = √(Σ_o (Σ_t |g̃_ot|)²)`` sums over ``(h, w) = (0, t)`` the same
entries as over ``t``; l2 likewise), so the kernels clip exactly what the proofs assume. A patch
``P_t(x̃) = (x̃_{c, t·s−p+j·d})_{c, j}`` (zero outside ``[0, L)``) holds distinct entries of x̃ or zeros:
zero padding, and the extra right zero of ``'same'`` is a zero, not an entry; other padding modes
(which repeat entries) are refused.

*norm l15*: row ``o`` of ``[∇W, ∇b]`` is ``Σ_t g̃_ot [P_t(x̃); 1]`` with ``‖[P_t; 1]‖ ≤ √(C_x² + [bias])``,
so ``‖row_o‖ ≤ Σ_t |g̃_ot| √(C_x² + [bias])`` and, summing squares over ``o``,
``Δ = C_g √(C_x² + [bias])`` — nothing of the geometry enters, exactly as for Conv2d.

*norm l2*: ``Δ = C_g √(m C_x² + [bias]·HW_out)`` with, at height 1: ``HW_out = 1·L_out``, and ``m =
m_H·m_L`` where the height's multiplicity ``m_H`` is that of one input row, one output row and a
kernel of height 1 (stride 1, padding 0, dilation 1 along it): ``m_H = 1``. So
``Δ = C_g √(m_L C_x² + [bias]·L_out)``, ``L_out = ⌊(L + e + 2p − d(k−1) − 1)/s⌋ + 1`` (``e`` the extra
right zero of ``'same'``, 0 or 1) and ``m_L`` the most ``(t, j)`` pairs with ``t·s − p + j·d = i`` over
the input's own positions ``0 ≤ i < L`` (the padded zeros are no entries: ``Σ_e mult(e) x̃_e²`` runs
over entries only). ``sensitivity_for`` computes these with conv2d's ``_max_patch_multiplicity``;
``tests/test_backprop_conv1d.py`` checks it against ``bpclip_fast.reference.layer_sensitivity``
(an independent count) and every example's float64 contribution against it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import autograd, compiled, compiled_backprop, exact, modes, registry
from .base import _Clipped, _Public, _in_parameter_dtype
from .conv2d import CONV_NORMS, _max_patch_multiplicity


class Conv1d(_Public, _Clipped, nn.Conv1d):
    """``nn.Conv1d`` under backpropagation clipping (input L2, upstream gradient ``norm``: l15 or l2)
    or exact per-example clipping (``flat``/``per_layer``), through the fused Conv2d kernels at
    height 1 (module docstring). Zero padding only."""

    _bp_weight_layout = exact.HEIGHT_ONE

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", *, input_clip=None, grad_clip=None, norm="l15", clipping="backprop",
                 max_grad_norm=None, clip_fn="clip", gamma=0.01, norm_method="auto", device=None, dtype=None):
        if padding_mode != "zeros":
            raise ValueError(f"Conv1d: padding_mode={padding_mode!r} is not supported: only 'zeros' keeps every "
                             "input entry at most once in a patch; pad explicitly with torch.nn.functional.pad "
                             "before the layer instead")
        if norm not in CONV_NORMS:
            raise ValueError(f"Conv1d: norm must be one of {CONV_NORMS}, got {norm!r}")
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                         groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype)
        self.norm = norm
        self._bp_init_clipping(input_clip, grad_clip, clip_fn, gamma, clipping, max_grad_norm, norm_method)
        self._pad, p = self._resolve_padding()
        self._geometry = ([1, self.stride[0]], [0, p], [1, self.dilation[0]], self.groups)

    def _resolve_padding(self):
        """``(extra, p)``: zeros padded before the layer (``(left, right)`` or ``None``) and the
        symmetric padding the kernel applies."""
        if not isinstance(self.padding, str):
            return None, self.padding[0]
        if self.padding == "valid":
            return None, 0
        total = self.dilation[0] * (self.kernel_size[0] - 1)  # 'same' (stride 1: torch checks)
        left = total // 2
        return ((0, total - 2 * left) if total % 2 else None), left  # torch's split: the odd zero on the right

    def _bp_shape_dependent(self, input_shape) -> bool:
        return not self.exact and self.norm == "l2"

    def _bp_shape_rule(self) -> str:
        return "with norm='l2' Δ grows with the input's length"

    def _bp_layer_input(self, x):
        """The layer's own input ``[B, C, L]`` as a view of the kernels' ``[B, C, 1, L + e]`` (the shape
        Δ is taken from: compiled_backprop.backprop_forward)."""
        x = x.squeeze(2)
        return x if self._pad is None else x.narrow(2, 0, x.shape[2] - self._pad[1])

    def sensitivity_for(self, input_shape=None) -> float:
        """l15: ``C_g √(C_x² + [bias])``; l2: ``C_g √(m_L C_x² + [bias]·L_out)`` for an input ``[B, C, L]``
        (module docstring); the noise bound ``C`` under exact clipping."""
        if self.exact:
            return self._bp_noise_bound
        bias = 1 if self.bias is not None else 0
        if self.norm == "l15":
            return self._bp_grad_clip * math.sqrt(self._bp_input_clip ** 2 + bias)
        if input_shape is None:
            raise RuntimeError(f"{self.layer_name}: with norm='l2' the sensitivity depends on the input's length; "
                               "call sensitivity_for(input_shape) or run a forward pass first")
        length = int(input_shape[-1])
        (k,), (s,), (d,) = self.kernel_size, self.stride, self.dilation
        p = self._geometry[1][1]
        extra = 0 if self._pad is None else self._pad[1]
        out = (length + extra + 2 * p - d * (k - 1) - 1) // s + 1
        m = _max_patch_multiplicity(length, out, k, s, p, d)  # the height's multiplicity is 1
        return self._bp_grad_clip * math.sqrt(m * self._bp_input_clip ** 2 + bias * out)

    @_in_parameter_dtype
    def forward(self, x):
        x = self._bp_check_input(x)
        if x.dim() != 3:
            raise ValueError(f"{self.layer_name}: the input must be [B, C, L]; got shape {tuple(x.shape)}")
        compiling = torch.compiler.is_compiling()  # opaque ops, no Python read per step (compiled.py)
        sens = None if compiling else self._bp_noise_sensitivity(x)  # Δ of the layer's own input shape
        kx = (F.pad(x, self._pad) if self._pad is not None else x).unsqueeze(2)  # zeros: the norm is x's
        if not self.exact:
            padding = self._geometry[1]
            if compiling:
                return compiled_backprop.backprop_layer(kx, self, padding).squeeze(2)
            return autograd.clipped_conv2d(kx, self.weight, self.bias, self, sens, padding).squeeze(2)
        if compiling:
            return compiled.exact_layer(kx, self, self._geometry).squeeze(2)
        return exact.exact_layer(kx, self, sens, self._geometry).squeeze(2)

    def extra_repr(self):
        norm = "" if self.exact else f", norm={self.norm!r}"
        return f"{super().extra_repr()}{norm}, {self._bp_clip_repr()}"


def _convert_conv1d(layer: nn.Conv1d, **clipping) -> Conv1d:
    kw = {k: v for k, v in clipping.items()
          if k in ("clipping", "max_grad_norm", "input_clip", "grad_clip", "norm", "clip_fn", "gamma", "norm_method")}
    return Conv1d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                  padding=layer.padding, dilation=layer.dilation, groups=layer.groups, bias=layer.bias is not None,
                  device="meta", dtype=layer.weight.dtype, **kw)


registry.register_layer(nn.Conv1d, Conv1d, convert=_convert_conv1d, modes=modes.NAMES,
                        plain=lambda layer, x, p: nn.Conv1d._conv_forward(layer, x, p["weight"], p.get("bias")),
                        taps=lambda layer: layer.weight[0, 0].numel())


@registry.register_module_check(nn.Conv1d)
def _conv1d_padding_mode(module):
    # The exact type only: a subclass is not converted (registry.layer_type) and the generic exact
    # path, which computes its own per-example gradients, trains it with any padding mode.
    if type(module) is not nn.Conv1d or module.padding_mode == "zeros":
        return None
    return (f"padding_mode={module.padding_mode!r}; only 'zeros' keeps the sensitivity bound (pad explicitly "
            "with torch.nn.functional.pad before the layer instead)")
