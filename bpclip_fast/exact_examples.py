"""The exact modes' autograd path of the layers whose per-example gradients are instantiated
(LayerNorm, GroupNorm, Embedding, EmbeddingBag, PositionalEmbedding, ClassToken, the generic units'
bound): the forward computes the output with the parameters detached, and an identity node (the
tap) carries the parameters' gradients, clipped from the layer's per-example gradients
(``layer._examples``) by :mod:`bpclip_fast.exact`'s bound, factors and release."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import _ops
from .amp import autocast_off
from .graph_nodes import forward_origin, untraced
from .exact import EXAMPLES, PendingBound, _clip, _flat_book, _step_args, _trainable, _weight_bias


def example_bound(layer, examples, mask, book):
    """The norm bounds of a layer with instantiated per-example gradients; under flat clipping
    (``book``) the layer's non-finite count is added to by the bound itself (the factors come later,
    from every layer's bounds), as the Linear/Conv2d norms ops do. Under per_layer, for examples
    with a fused bound-and-factors kernel, a :class:`~bpclip_fast.exact.PendingBound` that :func:`~bpclip_fast.exact.factors` fills."""
    counting = layer._bp_step is not None and layer._bp_step.counting  # adaptive: reads the bound after the factors
    if book is None and not counting and hasattr(examples, "factors"):
        return PendingBound(examples, mask)
    return examples.bound(mask, layer._bp_nonfinite[1:2] if book is not None else None)


class _Tap(torch.autograd.Function):
    """Identity on the layer's output, whose backward clips the layer's parameter gradients: the
    output was computed with the parameters detached (so autograd takes the input gradient from the
    unclipped upstream gradient, as for Linear), and this node alone carries their gradient, from the
    layer's per-example gradients (``layer._examples(saved, g, mask)``)."""

    @staticmethod
    def forward(ctx, out, weight, bias, token, layer, sensitivity, book, *saved):
        ctx.save_for_backward(*saved)
        ctx.layer, ctx.sensitivity, ctx.book = layer, sensitivity, book
        ctx.bounds_version, ctx._bp_origin = layer._bp_bounds_version, forward_origin()
        ctx.dtype = out.dtype
        # Not out.view_as(out): torch refuses in-place ops on a view made inside a custom Function, so
        # ReLU(inplace=True) after a GroupNorm would fail. The detached alias shares out's storage and
        # version counter; no backward saves out itself (layer norms save their input and statistics,
        # + and cat nothing), and one that did would see an in-place edit as a version mismatch.
        return out.detach()

    @staticmethod
    @untraced  # graph_nodes.untraced: the engine's calls never run under dynamo
    @once_differentiable
    @autocast_off
    def backward(ctx, grad_out):
        ctx.layer._bp_check_forward(ctx, ctx.bounds_version)
        saved = ctx.saved_tensors
        layer, book = ctx.layer, ctx.book
        nones = (None,) * (4 + len(saved))
        mask = _trainable(layer) if book is not None else [ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        if not any(mask):
            return grad_out, None, None, *nones
        g = grad_out.contiguous()
        step_args = _step_args(layer, g.shape[0], ctx.sensitivity, book)
        examples = layer._examples(saved, g, mask)
        bound = example_bound(layer, examples, mask, book)
        out = _clip(layer, book, bound, (None, None), examples, step_args, EXAMPLES, ctx.dtype)
        if out is None:  # flat: as _ExactLayer
            return grad_out, None, None, *nones
        return grad_out, *out, *nones


def example_layer(layer, x, sensitivity):
    """The forward of a layer whose per-example gradients are instantiated (``layer._forward(x,
    weight, bias, keep) -> (out, saved)``, ``layer._examples(saved, g, mask)``) under its exact mode."""
    _ops.require_extension()
    weight, bias = wb = _weight_bias(layer)
    needs = torch.is_grad_enabled() and any(_trainable(layer, wb))
    detached = (weight.detach(), bias.detach() if bias is not None else None)
    if not needs:
        return layer._forward(x, *detached, False)[0]
    book, token = _flat_book(layer) if layer._bp_clipping == "flat" else (None, None)
    if book is not None:
        weight, bias = detached
    out, saved = layer._forward(x, *detached, True)
    return _Tap.apply(out, weight, bias, token, layer, sensitivity, book, *saved)
