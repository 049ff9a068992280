"""Clipped added parameters (:mod:`bpclip_fast.modules`' ``PositionalEmbedding`` and
``ClassToken``), exact modes only: each example's gradient is its upstream gradient (at the
prepended positions), released through :class:`bpclip_fast.examples.DenseExamples`."""

from __future__ import annotations

import torch

from .. import examples, modes, modules, registry
from .base import _ExampleLayer, _exact_kwargs, _sqrt_batch


class PositionalEmbedding(_ExampleLayer, modules.PositionalEmbedding):
    """:class:`bpclip_fast.modules.PositionalEmbedding` under exact per-example clipping: example
    ``i``'s gradient is its upstream gradient."""

    def __init__(self, *shape, clipping="backprop", max_grad_norm=None, clip_fn="clip", gamma=0.01, device=None,
                 dtype=None):
        super().__init__(*shape, device=device, dtype=dtype)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _bp_check_input(self, x):
        x = super()._bp_check_input(x)
        self._check_shape(x)
        return x

    def _forward(self, x, weight, bias, keep):
        return x + weight, ()

    def _examples(self, saved, g, mask):
        return examples.DenseExamples(g, None, self.weight.dtype)


class ClassToken(_ExampleLayer, modules.ClassToken):
    """:class:`bpclip_fast.modules.ClassToken` under exact per-example clipping: example ``i``'s
    gradient is its upstream gradient at the prepended positions."""

    def __init__(self, dim, tokens=1, *, clipping="backprop", max_grad_norm=None, clip_fn="clip", gamma=0.01,
                 device=None, dtype=None):
        super().__init__(dim, tokens, device=device, dtype=dtype)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _bp_check_input(self, x):
        x = super()._bp_check_input(x)
        self._check_shape(x)
        return x

    def _forward(self, x, weight, bias, keep):
        return torch.cat([weight.expand(x.shape[0], -1, -1), x], dim=1), ()

    def _examples(self, saved, g, mask):
        return examples.DenseExamples(g[:, :self.weight.shape[0]].contiguous(), None, self.weight.dtype)


def _convert_positional(layer: modules.PositionalEmbedding, **clipping) -> PositionalEmbedding:
    return PositionalEmbedding(*layer.weight.shape, device="meta", dtype=layer.weight.dtype,
                               **_exact_kwargs(clipping))


def _convert_class_token(layer: modules.ClassToken, **clipping) -> ClassToken:
    return ClassToken(layer.weight.shape[1], layer.weight.shape[0], device="meta", dtype=layer.weight.dtype,
                      **_exact_kwargs(clipping))


_EXACT = modes.EXACT
registry.register_layer(modules.PositionalEmbedding, PositionalEmbedding, convert=_convert_positional, modes=_EXACT,
                        multiplier_norm=_sqrt_batch, plain=lambda layer, x, p: x + p["weight"])
registry.register_layer(modules.ClassToken, ClassToken, convert=_convert_class_token, modes=_EXACT,
                        multiplier_norm=_sqrt_batch,
                        plain=lambda layer, x, p: torch.cat([p["weight"].expand(x.shape[0], -1, -1), x], dim=1))
