"""Clipped normalisation layers (affine ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``,
``nn.InstanceNorm1d/2d/3d``), exact modes only: each example's gradients of the affine parameters are
instantiated and released through :class:`bpclip_fast.examples.DenseExamples`, whose docstring
proves the bound. What that proof assumes of its input: row ``i`` of the stored gradients is example
``i``'s alone. Here every statistic (mean, rstd) is taken over one example's entries only (a row of
the normalized shape, or one channel of one example), and row ``i`` sums example ``i``'s own
positions: one fused pass (``examples.affine_example_grads``). The stored values need not equal the
exact gradients for the bound: they are the values normed and released (their accuracy is what
tests/test_fused_norms.py checks against float64)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import examples, modes, registry
from .base import _ExampleLayer, _exact_kwargs, _sqrt_numel


def _normalized_input(layer, x):
    """``x`` if it is ``[B, *, *normalized_shape]`` (LayerNorm, RMSNorm), else a clear error."""
    k = len(layer.normalized_shape)
    if x.dim() <= k or tuple(x.shape[-k:]) != tuple(layer.normalized_shape):
        raise ValueError(f"{layer.layer_name}: the input must be [B, *, {', '.join(map(str, layer.normalized_shape))}] "
                         f"(a batch dimension, then the normalized shape); got {tuple(x.shape)}")
    return x



def _group_norm_layout(x):
    """``x`` contiguous, the one layout every example's statistics and gradients are computed in. The
    CPU kernel reduces a channels-last input in another order than a contiguous one, and a
    channels-last batch of one is contiguous too: example ``i``'s mean and rstd, so its ``x̂``, then
    depended on the other examples' presence in the last bits, and where ``x̂`` nearly cancels under a
    huge upstream gradient its gradient is those bits, so the direction of its clipped gradient
    flipped when another example was removed (2·C, the bound fuzzer at seed 58: InstanceNorm3d, flat,
    float64). (torch 2.11's kernel also refused a strided view.)"""
    return x.contiguous()

class LayerNorm(_ExampleLayer, nn.LayerNorm):
    """``nn.LayerNorm`` (affine) under exact per-example clipping (``flat``/``per_layer``). Example
    ``i``'s gradients are ``Σ_t g_t ⊙ x̂_t`` and ``Σ_t g_t`` over its positions ``t``."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, *, clipping="backprop",
                 max_grad_norm=None, clip_fn="clip", gamma=0.01, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias, device=device,
                         dtype=dtype)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _bp_check_input(self, x):
        return _normalized_input(self, super()._bp_check_input(x))

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

    def _bp_check_input(self, x):
        x = super()._bp_check_input(x)
        if x.dim() < 2 or x.shape[1] != self.num_channels:
            raise ValueError(f"{self.layer_name}: the input must be [B, {self.num_channels}, *]; got {tuple(x.shape)}")
        return x

    def _forward(self, x, weight, bias, keep):
        if not keep:
            return F.group_norm(x, self.num_groups, weight, bias, self.eps), ()
        n, c = x.shape[:2]
        x = _group_norm_layout(x)
        out, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, n, c,
                                                           math.prod(x.shape[2:]), self.num_groups, self.eps)
        return out, (x, mean, rstd)

    def _examples(self, saved, g, mask):
        x, mean, rstd = saved
        return examples.DenseExamples(*examples.affine_example_grads(g, x, mean, rstd, self.num_groups, False,
                                                               self.weight.shape, self.bias is not None),
                                   self.weight.dtype)


class RMSNorm(_ExampleLayer, nn.RMSNorm):
    """``nn.RMSNorm`` (affine) under exact per-example clipping. Example ``i``'s weight gradient is
    ``Σ_t g_t ⊙ x̂_t``, ``x̂ = x·rstd``, ``rstd = 1/√(mean(x²) + eps)`` over the normalized shape of
    each position ``t`` (``eps=None``: as torch, the eps of the dtype it computes in, float32's for
    fp16/bf16 ``x``, not ``finfo(x.dtype).eps``): LayerNorm's kernel with mean 0, on the ``rstd`` the
    forward's ``_fused_rms_norm`` returned."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, *, clipping="backprop",
                 max_grad_norm=None, clip_fn="clip", gamma=0.01, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device, dtype=dtype)
        self.register_parameter("bias", None)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _bp_check_input(self, x):
        return _normalized_input(self, super()._bp_check_input(x))

    def _forward(self, x, weight, bias, keep):
        if not keep:
            return F.rms_norm(x, self.normalized_shape, weight, self.eps), ()
        out, rstd = torch.ops.aten._fused_rms_norm(x, list(self.normalized_shape), weight, self.eps)
        return out, (x, rstd)

    def _examples(self, saved, g, mask):
        x, rstd = saved
        zero = torch.zeros_like(rstd)  # x̂ = (x − 0)·rstd: the kernel's LayerNorm arithmetic, exactly x·rstd
        return examples.DenseExamples(*examples.affine_example_grads(g, x, zero, rstd, 1, True, self.weight.shape,
                                                                     False), self.weight.dtype)


def _running_stats_problem(track_running_stats) -> str | None:
    if track_running_stats:
        return ("track_running_stats=True updates running statistics averaged over the batch, released without "
                "noise; use track_running_stats=False (statistics within each example, in training and eval)")
    return None


class _InstanceNorm(_ExampleLayer):
    """Affine ``nn.InstanceNorm1d/2d/3d`` without running statistics under exact per-example clipping:
    GroupNorm with one group per channel (each example's statistics per channel, ``native_group_norm``
    in every mode). Example ``i``'s gradients are ``Σ_s g_{c,s} x̂_{c,s}`` and ``Σ_s g_{c,s}`` per
    channel ``c`` over its positions ``s``. ``track_running_stats=True`` is refused (the running
    buffers are updated from the private batch and released without noise)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=False, *, bias=True,
                 clipping="backprop", max_grad_norm=None, clip_fn="clip", gamma=0.01, device=None, dtype=None):
        reason = _running_stats_problem(track_running_stats)
        if reason:
            raise ValueError(f"{type(self).__name__}: {reason}")
        # `bias` only when it differs from the default: torch's InstanceNorm gained the option after 2.11
        # (an H100 image's torch rejected the keyword), and a bias-free one exists only where it has it.
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine, track_running_stats=False,
                         device=device, dtype=dtype, **({} if bias else {"bias": False}))
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _bp_check_input(self, x):
        x = super()._bp_check_input(x)
        dims = self._get_no_batch_dim() + 1
        if x.dim() != dims or x.shape[1] != self.num_features:
            raise ValueError(f"{self.layer_name}: the input must be [B, {self.num_features}"
                             f"{', *' * (dims - 2)}] ({dims} dims: a batch dimension, then channels); got "
                             f"{tuple(x.shape)}")
        if math.prod(x.shape[2:]) == 1:  # torch's own rule (F.instance_norm's; x̂ would be 0)
            raise ValueError(f"{self.layer_name}: expected more than 1 spatial element, got input of shape "
                             f"{tuple(x.shape)}")
        return x

    def _forward(self, x, weight, bias, keep):
        n, c = x.shape[:2]
        x = _group_norm_layout(x)
        out, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, n, c,
                                                           math.prod(x.shape[2:]), c, self.eps)
        return out, ((x, mean, rstd) if keep else ())

    def _examples(self, saved, g, mask):
        x, mean, rstd = saved
        return examples.DenseExamples(*examples.affine_example_grads(g, x, mean, rstd, self.num_features, False,
                                                                     self.weight.shape, self.bias is not None),
                                      self.weight.dtype)


class InstanceNorm1d(_InstanceNorm, nn.InstanceNorm1d):
    __doc__ = _InstanceNorm.__doc__


class InstanceNorm2d(_InstanceNorm, nn.InstanceNorm2d):
    __doc__ = _InstanceNorm.__doc__


class InstanceNorm3d(_InstanceNorm, nn.InstanceNorm3d):
    __doc__ = _InstanceNorm.__doc__


def _convert_layer_norm(layer: nn.LayerNorm, **clipping) -> LayerNorm:
    return LayerNorm(layer.normalized_shape, eps=layer.eps, bias=layer.bias is not None, device="meta",
                     dtype=layer.weight.dtype, **_exact_kwargs(clipping))


def _convert_group_norm(layer: nn.GroupNorm, **clipping) -> GroupNorm:
    return GroupNorm(layer.num_groups, layer.num_channels, eps=layer.eps, device="meta", dtype=layer.weight.dtype,
                     **_exact_kwargs(clipping))


def _convert_rms_norm(layer: nn.RMSNorm, **clipping) -> RMSNorm:
    return RMSNorm(layer.normalized_shape, eps=layer.eps, device="meta", dtype=layer.weight.dtype,
                   **_exact_kwargs(clipping))


_CLIPPED_INSTANCE = {nn.InstanceNorm1d: InstanceNorm1d, nn.InstanceNorm2d: InstanceNorm2d,
                     nn.InstanceNorm3d: InstanceNorm3d}


def _convert_instance_norm(layer, **clipping):
    return _CLIPPED_INSTANCE[type(layer)](layer.num_features, eps=layer.eps, momentum=layer.momentum,
                                          track_running_stats=layer.track_running_stats,
                                          bias=layer.bias is not None, device="meta", dtype=layer.weight.dtype,
                                          **_exact_kwargs(clipping))


_EXACT = modes.EXACT
registry.register_layer(nn.LayerNorm, LayerNorm, convert=_convert_layer_norm, modes=_EXACT, multiplier_norm=_sqrt_numel,
                        plain=lambda layer, x, p: F.layer_norm(x, layer.normalized_shape, p.get("weight"), p.get("bias"),
                                                               layer.eps))
registry.register_layer(nn.GroupNorm, GroupNorm, convert=_convert_group_norm, modes=_EXACT, multiplier_norm=_sqrt_numel,
                        plain=lambda layer, x, p: F.group_norm(x, layer.num_groups, p.get("weight"), p.get("bias"),
                                                               layer.eps))
registry.register_layer(nn.RMSNorm, RMSNorm, convert=_convert_rms_norm, modes=_EXACT,
                        multiplier_norm=_sqrt_numel,
                        plain=lambda layer, x, p: F.rms_norm(x, layer.normalized_shape, p.get("weight"), layer.eps))
for _torch_type, _clipped_type in _CLIPPED_INSTANCE.items():
    registry.register_layer(_torch_type, _clipped_type, convert=_convert_instance_norm, modes=_EXACT,
                            multiplier_norm=_sqrt_numel,
                            plain=lambda layer, x, p: F.instance_norm(x, None, None, p.get("weight"), p.get("bias"),
                                                                      True, layer.momentum, layer.eps))
