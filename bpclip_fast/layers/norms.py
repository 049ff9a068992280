"""Clipped normalisation layers (affine ``nn.LayerNorm``, ``nn.GroupNorm``), exact modes only: each
example's gradients of the affine parameters are instantiated and released through
:class:`bpclip_fast.examples.DenseExamples`, whose docstring proves the bound."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import examples, modes, registry
from .base import _ExampleLayer, _exact_kwargs, _sqrt_numel


class LayerNorm(_ExampleLayer, nn.LayerNorm):
    """``nn.LayerNorm`` (affine) under exact per-example clipping (``flat``/``per_layer``). Example
    ``i``'s gradients are ``Σ_t g_t ⊙ x̂_t`` and ``Σ_t g_t`` over its positions ``t``."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, *, clipping="backprop",
                 max_grad_norm=None, clip_fn="clip", gamma=0.01, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias, device=device,
                         dtype=dtype)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _check_input(self, x):
        x = super()._check_input(x)
        k = len(self.normalized_shape)
        if x.dim() <= k or tuple(x.shape[-k:]) != tuple(self.normalized_shape):
            raise ValueError(f"{self.layer_name}: the input must be [B, *, {', '.join(map(str, self.normalized_shape))}] "
                             f"(a batch dimension, then the normalized shape); got {tuple(x.shape)}")
        return x

    def _forward(self, x, weight, bias, keep):
        if not keep:
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps), ()
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, list(self.normalized_shape), weight, bias, self.eps)
        return out, (x, mean, rstd)

    def _examples(self, saved, g, mask):
        x, mean, rstd = saved
        return examples.DenseExamples(*examples.affine_example_grads(g, x, mean, rstd, 1, True, self.weight.shape,
                                                               self.bias is not None), self.weight.dtype)


class GroupNorm(_ExampleLayer, nn.GroupNorm):
    """``nn.GroupNorm`` (affine) under exact per-example clipping. Example ``i``'s gradients are
    ``Σ_s g_{c,s} x̂_{c,s}`` and ``Σ_s g_{c,s}`` per channel ``c`` over its positions ``s``."""

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, *, clipping="backprop", max_grad_norm=None,
                 clip_fn="clip", gamma=0.01, device=None, dtype=None):
        super().__init__(num_groups, num_channels, eps=eps, affine=affine, device=device, dtype=dtype)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _check_input(self, x):
        x = super()._check_input(x)
        if x.dim() < 2 or x.shape[1] != self.num_channels:
            raise ValueError(f"{self.layer_name}: the input must be [B, {self.num_channels}, *]; got {tuple(x.shape)}")
        return x

    def _forward(self, x, weight, bias, keep):
        if not keep:
            return F.group_norm(x, self.num_groups, weight, bias, self.eps), ()
        n, c = x.shape[:2]
        out, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, n, c, math.prod(x.shape[2:]),
                                                           self.num_groups, self.eps)
        return out, (x, mean, rstd)

    def _examples(self, saved, g, mask):
        x, mean, rstd = saved
        return examples.DenseExamples(*examples.affine_example_grads(g, x, mean, rstd, self.num_groups, False,
                                                               self.weight.shape, self.bias is not None),
                                   self.weight.dtype)


def _convert_layer_norm(layer: nn.LayerNorm, **clipping) -> LayerNorm:
    return LayerNorm(layer.normalized_shape, eps=layer.eps, bias=layer.bias is not None, device="meta",
                     dtype=layer.weight.dtype, **_exact_kwargs(clipping))


def _convert_group_norm(layer: nn.GroupNorm, **clipping) -> GroupNorm:
    return GroupNorm(layer.num_groups, layer.num_channels, eps=layer.eps, device="meta", dtype=layer.weight.dtype,
                     **_exact_kwargs(clipping))


_EXACT = modes.EXACT
registry.register_layer(nn.LayerNorm, LayerNorm, convert=_convert_layer_norm, modes=_EXACT, multiplier_norm=_sqrt_numel,
                        plain=lambda layer, x, p: F.layer_norm(x, layer.normalized_shape, p.get("weight"), p.get("bias"),
                                                               layer.eps))
registry.register_layer(nn.GroupNorm, GroupNorm, convert=_convert_group_norm, modes=_EXACT, multiplier_norm=_sqrt_numel,
                        plain=lambda layer, x, p: F.group_norm(x, layer.num_groups, p.get("weight"), p.get("bias"),
                                                               layer.eps))
