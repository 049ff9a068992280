"""The clipped ``nn.Conv1d`` (flat and per_layer), its registration and its padding check.

A Conv1d is the Conv2d of kernel height 1 on inputs of height 1: input ``[B, C, L] -> [B, C, 1, L]``,
weight ``[O, C/G, k] -> [O, C/G, 1, k]`` (:data:`bpclip_fast.exact.HEIGHT_ONE`), stride, padding and
dilation ``(1, s)``, ``(0, p)``, ``(1, d)``. Every product ``g_{o,t} x_{c,t·s−p+j·d}`` of the Conv1d's
weight gradient is the Conv2d's at height 0, so the fused Conv2d norms and release (csrc/exact.cpp)
compute its exact per-example clipping, with their proofs unchanged. ``padding='same'`` with an odd
total ``d·(k−1)`` pads the extra zero on the right, as torch does, explicitly before the kernel:
zeros add no product.

Exact modes only: backpropagation clipping's Conv2d bound would hold with ``H = 1`` (the l15 proof
is for any geometry; l2's multiplicity along the height is 1), but its kernels take the weight as
the parameter itself (``autograd._ClippedConv2d``, the compiled backprop op), which a Conv1d's is
not; until they take the layout, ``clipping='backprop'`` is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import compiled, exact, modes, registry
from .base import _Clipped, _in_parameter_dtype


class Conv1d(_Clipped, nn.Conv1d):
    """``nn.Conv1d`` under exact per-example clipping (``flat``/``per_layer``), through the fused
    Conv2d kernels (module docstring). Zero padding only."""

    _weight_layout = exact.HEIGHT_ONE

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", *, clipping="backprop", max_grad_norm=None, clip_fn="clip", gamma=0.01,
                 norm_method="auto", device=None, dtype=None):
        if padding_mode != "zeros":
            raise ValueError(f"Conv1d: padding_mode={padding_mode!r} is not supported: only 'zeros' keeps every "
                             "input entry at most once in a patch; pad explicitly with torch.nn.functional.pad "
                             "before the layer instead")
        if not modes.strategy(clipping, "Conv1d").exact:
            raise ValueError("Conv1d: clipping='backprop' has no proved bound for a Conv1d's parameters here (its "
                             "kernels take a Conv2d's weight); use clipping='flat' or 'per_layer' (exact per-example "
                             "clipping: make_private(..., clipping='flat')), or freeze the Conv1d "
                             "(requires_grad_(False))")
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                         groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype)
        self._init_clipping(None, None, clip_fn, gamma, clipping, max_grad_norm, norm_method)
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

    def _shape_dependent(self, input_shape) -> bool:
        return False

    def sensitivity_for(self, input_shape=None) -> float:
        """The noise bound ``C`` (exact clipping: each example's gradient is clipped to it)."""
        return self.noise_bound

    @_in_parameter_dtype
    def forward(self, x):
        x = self._check_input(x)
        if x.dim() != 3:
            raise ValueError(f"{self.layer_name}: the input must be [B, C, L]; got shape {tuple(x.shape)}")
        if self._pad is not None:
            x = F.pad(x, self._pad)
        x = x.unsqueeze(2)
        if torch.compiler.is_compiling():  # opaque ops, no Python read per step (compiled.py)
            return compiled.exact_layer(x, self, self._geometry).squeeze(2)
        return exact.exact_layer(x, self, self._noise_sensitivity(x), self._geometry).squeeze(2)

    def extra_repr(self):
        return f"{super().extra_repr()}, {self._clip_repr()}"


def _convert_conv1d(layer: nn.Conv1d, **clipping) -> Conv1d:
    kw = {k: v for k, v in clipping.items() if k in ("clipping", "max_grad_norm", "clip_fn", "gamma", "norm_method")}
    return Conv1d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                  padding=layer.padding, dilation=layer.dilation, groups=layer.groups, bias=layer.bias is not None,
                  device="meta", dtype=layer.weight.dtype, **kw)


registry.register_layer(nn.Conv1d, Conv1d, convert=_convert_conv1d, modes=modes.EXACT,
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
