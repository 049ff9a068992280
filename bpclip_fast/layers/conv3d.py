"""The clipped ``nn.Conv3d`` (flat and per_layer), through the fused Linear path over its patches.

No fused op has a third spatial dimension, but a convolution of one group is a Linear over its
output positions: with ``P(x) [B, T, d]`` the patches of the padded input (``T = D'·H'·W'`` output
positions, ``d = C·kd·kh·kw`` in the order ``(c, i, j, k)`` of ``weight.view(O, -1)``), the output at
position ``t`` is ``W P(x)[b, t] + bias``. So the forward builds ``P(x)`` (``F.pad`` then
``Tensor.unfold`` along each spatial dim, every ``dilation``-th entry of a window, copied into
``[B, T, d]``) and runs :func:`bpclip_fast.exact.exact_layer` on it with the weight viewed as ``[O, d]``
(:data:`bpclip_fast.exact.FLATTENED`): the per-example norms, clipping, noise and release are the
Linear's, proofs unchanged — example ``i``'s gradient of ``[W, b]`` is ``Σ_t g_{i,t} [P(x)_{i,t}; 1]ᵀ``
whatever built its patches, and each example's contribution is clipped to ``C`` by its exact norm.
The release is viewed back in the parameter's shape (the same entries, each once), so ``.grad`` is
the very tensor the layer released. The input gradient is autograd's through ``unfold``, the pad and
the copy, from ``∇P = g·W`` (the unclipped upstream gradient, as every exact layer).

Padding modes: exact clipping bounds each example's contribution by its own clipped norm, not by
how often a patch repeats an input entry, so ``'reflect'``, ``'replicate'`` and ``'circular'`` are
padded by ``F.pad`` with that mode exactly as torch's Conv3d does (``_reversed_padding_repeated_twice``,
``'same'``'s odd extra zero on the right included). ``groups > 1`` is no single Linear over the
patches (a block-diagonal weight whose off-diagonal gradient would not be zero): such an instance is
left to the generic exact path (``not_fused``), which trained every Conv3d before.

Cost: ``P(x)`` holds ``kd·kh·kw`` times the padded input's entries (per example, saved for the
backward), the price of reusing the Linear kernels. Exact modes only: backpropagation clipping's
Linear kernels take the weight as the parameter itself (``autograd._ClippedLinear``), which a
Conv3d's is not, and its proofs bound an input entry's multiplicity in a patch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import compiled, exact, modes, registry
from .base import _Clipped, _Public, _ExactOnly, _in_parameter_dtype


class Conv3d(_Public, _ExactOnly, _Clipped, nn.Conv3d):
    """``nn.Conv3d`` (one group) under exact per-example clipping (``flat``/``per_layer``), through the
    fused Linear kernels on its patches (module docstring). Input ``[B, C, D, H, W]``."""

    _bp_weight_layout = exact.FLATTENED

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", *, clipping="backprop", max_grad_norm=None, clip_fn="clip",
                 gamma=0.01, norm_method="auto", device=None, dtype=None):
        if not modes.strategy(clipping, "Conv3d").exact:
            raise ValueError("Conv3d: clipping='backprop' has no proved bound for a Conv3d's parameters here (no "
                             "fused op takes a third spatial dimension); use clipping='flat' or 'per_layer' (exact "
                             "per-example clipping: make_private(..., clipping='flat')), or freeze the Conv3d "
                             "(requires_grad_(False))")
        if groups != 1:
            raise ValueError(f"Conv3d: groups={groups} is not fused (the patches' Linear has one weight for all "
                             "channels); convert_model leaves an nn.Conv3d with groups > 1 to the generic exact path")
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                         groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype)
        self._bp_init_clipping(None, None, clip_fn, gamma, clipping, max_grad_norm, norm_method)

    @_in_parameter_dtype
    def forward(self, x):
        x = self._bp_check_input(x)
        if x.dim() != 5:
            raise ValueError(f"{self.layer_name}: the input must be [B, C, D, H, W]; got shape {tuple(x.shape)}")
        if self.groups != 1:  # changed after conversion: the patches' one Linear would ignore it
            raise ValueError(f"{self.layer_name}: groups={self.groups} was set after conversion, and the fused Conv3d "
                             "is one Linear over all channels; set groups on the nn.Conv3d before convert_model/"
                             "make_private (a grouped Conv3d is trained by the generic exact path)")
        patches, spatial = _patches(self, x)
        if torch.compiler.is_compiling():  # opaque ops, no Python read per step (compiled.py)
            out = compiled.exact_layer(patches, self)
        else:
            out = exact.exact_layer(patches, self, self._bp_noise_sensitivity(x))
        # [B, T, O] -> [B, O, D', H', W'], contiguous as torch's own output (a .view after it works)
        return out.unflatten(1, spatial).permute(0, 4, 1, 2, 3).contiguous()

    def extra_repr(self):
        return f"{super().extra_repr()}, {self._bp_clip_repr()}"


def _padded(layer: nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    """``x`` padded as torch's Conv3d pads it (every padding mode, ``'same'``'s asymmetric split)."""
    pad = layer._reversed_padding_repeated_twice
    if not any(pad):
        return x
    return F.pad(x, pad, mode="constant" if layer.padding_mode == "zeros" else layer.padding_mode)


def _patches(layer: nn.Conv3d, x: torch.Tensor):
    """``(P [B, D'·H'·W', C·kd·kh·kw], (D', H', W'))``: the patches in ``weight.view(O, -1)``'s order."""
    p = _padded(layer, x)
    for dim, (k, s, d) in enumerate(zip(layer.kernel_size, layer.stride, layer.dilation), start=2):
        p = p.unfold(dim, d * (k - 1) + 1, s)  # the window's span; adds it as the last dim
        if d != 1:
            p = p[..., ::d]
    # [B, C, D', H', W', kd, kh, kw] -> [B, D', H', W', C, kd, kh, kw]
    b, c, do, ho, wo = p.shape[:5]  # d spelled out: -1 is ambiguous for an empty batch
    p = p.permute(0, 2, 3, 4, 1, 5, 6, 7).reshape(b, do * ho * wo, c * math.prod(layer.kernel_size))
    return p, (do, ho, wo)


def _not_fused(layer: nn.Conv3d) -> str | None:
    return f"groups={layer.groups} (no single Linear over the patches)" if layer.groups != 1 else None


def _convert_conv3d(layer: nn.Conv3d, **clipping) -> Conv3d:
    kw = {k: v for k, v in clipping.items() if k in ("clipping", "max_grad_norm", "clip_fn", "gamma", "norm_method")}
    return Conv3d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                  padding=layer.padding, dilation=layer.dilation, groups=layer.groups, bias=layer.bias is not None,
                  padding_mode=layer.padding_mode, device="meta", dtype=layer.weight.dtype, **kw)


def _multiplier_norm(layer, x) -> float:
    """The padded input's norm: a patch holds each of its entries at most once per kernel offset, so
    the patches' Frobenius norm is at most ``√taps`` times it (the probes' tolerance; zero padding: ``‖x‖``)."""
    return float(_padded(layer, x.double()).norm())


registry.register_layer(nn.Conv3d, Conv3d, convert=_convert_conv3d, modes=modes.EXACT,
                        plain=lambda layer, x, p: nn.Conv3d._conv_forward(layer, x, p["weight"], p.get("bias")),
                        taps=lambda layer: layer.weight[0, 0].numel(), multiplier_norm=_multiplier_norm,
                        not_fused=_not_fused)
