"""The clipped ``nn.Embedding`` (exact modes only), its refused options and its registration; its
bound is :class:`bpclip_fast.examples.RowExamples`'."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import broadcast, examples, modes, registry
from .base import _ExampleLayer, _exact_kwargs, _sqrt_numel


class Embedding(_ExampleLayer, nn.Embedding):
    """``nn.Embedding`` under exact per-example clipping, with per-example norms through index
    equality (:class:`bpclip_fast.examples.RowExamples`; no per-example copy of the table). Refused:
    ``max_norm`` (the forward rewrites table rows outside the step), ``scale_grad_by_freq`` (a
    token's gradient is divided by its count in the whole batch, so examples move each other) and
    ``sparse`` gradients."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, sparse=False, _weight=None, _freeze=False, *, clipping="backprop",
                 max_grad_norm=None, clip_fn="clip", gamma=0.01, device=None, dtype=None):
        reason = _embedding_problem(max_norm, scale_grad_by_freq, sparse)
        if reason:
            raise ValueError(f"Embedding: {reason}")
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, _weight=_weight, _freeze=_freeze,
                         device=device, dtype=dtype)
        self.register_parameter("bias", None)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _bp_check_input(self, x):
        name = self.layer_name
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name}: expected an int64/int32 tensor of indices, got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.device != self.weight.device:
            raise ValueError(f"{name}: the input is on {x.device} but the layer's parameters are on "
                             f"{self.weight.device}; move the input or the model (.to(device)) so they match")
        if x.dim() < 1:
            raise ValueError(f"{name}: the input needs a batch dimension, [B, *]; got a scalar")
        if self.__dict__.get("_bp_step") is not None and not torch.compiler.is_compiling():
            # Trained by an engine: one row shared by the call's examples is looked up per example
            # (bpclip_fast.broadcast; make_private's probes checked that this is safe for the model).
            x = broadcast.expand(x)
        return x

    def _forward(self, x, weight, bias, keep):
        return F.embedding(x, weight, self.padding_idx), ((x,) if keep else ())

    def _examples(self, saved, g, mask):
        (idx,) = saved
        b, v, dim = idx.shape[0], self.num_embeddings, self.embedding_dim
        idx = idx.reshape(b, math.prod(idx.shape[1:])).long()  # not -1: an empty batch has b = 0
        positions = idx.shape[1]
        keys = torch.arange(b, device=idx.device).unsqueeze(1) * v + idx
        rows = g.reshape(b * positions, dim)
        if self.padding_idx is not None:  # torch gives the padding row no gradient
            keep = (idx != self.padding_idx).reshape(-1)
            keys, rows = keys.reshape(-1)[keep], rows[keep]
        keys, inverse = torch.unique(keys.reshape(-1), return_inverse=True)
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        summed = rows.new_zeros(keys.shape[0], dim, dtype=acc).index_add_(0, inverse, rows.to(acc))
        return examples.RowExamples(summed, keys // v, keys % v, b, positions, v, self.weight.dtype)


def _embedding_problem(max_norm, scale_grad_by_freq, sparse) -> str | None:
    if max_norm is not None:
        return ("max_norm rewrites the rows an example reads during its forward, outside the private step; "
                "use max_norm=None")
    if scale_grad_by_freq:
        return ("scale_grad_by_freq divides each token's gradient by its count in the whole batch, so one example "
                "changes another's gradient; use scale_grad_by_freq=False")
    if sparse:
        return "sparse gradients are not supported; use sparse=False"
    return None


def _convert_embedding(layer: nn.Embedding, **clipping) -> Embedding:
    return Embedding(layer.num_embeddings, layer.embedding_dim, padding_idx=layer.padding_idx, device="meta",
                     dtype=layer.weight.dtype, **_exact_kwargs(clipping))


_EXACT = modes.EXACT
registry.register_layer(nn.Embedding, Embedding, convert=_convert_embedding, modes=_EXACT, multiplier_norm=_sqrt_numel,
                        plain=lambda layer, x, p: F.embedding(x, p["weight"], layer.padding_idx))


@registry.register_module_check(nn.Embedding)
def _embedding_options(module):
    return _embedding_problem(module.max_norm, module.scale_grad_by_freq, module.sparse)
