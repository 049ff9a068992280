"""The clipped ``nn.EmbeddingBag`` (exact modes only), its refused options and its registration; its
bound is :class:`bpclip_fast.examples.RowExamples`' (one bag is one example).

Example ``i``'s gradient on table row ``j`` is ``Σ_{t: idx[i,t]=j} w_{i,t} g_i`` (``g_i`` the bag's
output gradient): ``w`` the per-sample weights (or 1) in ``sum`` mode, ``1/|bag|`` in ``mean`` mode
(``|bag|`` counting the entries that are not ``padding_idx``), and in ``max`` mode dimension ``d`` of
``g_i`` goes to the row torch's forward picked for it (its ``max_indices``, so ties go where torch's
own backward sends them). Padding entries and empty bags get nothing, as in torch. Each row of the
representation is built from one bag's indices, weights and ``g_i`` alone, so RowExamples' proof
(rows normed are the rows released, keyed by example) holds unchanged."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from .. import compiled, examples, exact_examples, modes, registry
from ..amp import autocast_on
from .base import _ExampleLayer, _exact_kwargs
from .embedding import _embedding_problem

_MODES = {"sum": 0, "mean": 1, "max": 2}


class EmbeddingBag(_ExampleLayer, nn.EmbeddingBag):
    """``nn.EmbeddingBag`` under exact per-example clipping, each bag one example, with per-example
    norms through index equality (no per-example copy of the table). Takes a 2-D ``[B, T]`` input
    (``B`` bags of ``T`` entries) or, used directly (``convert_model``), a 1-D input with ``offsets``
    (``B`` bags; not under ``make_private``, whose batches and probes hold one example per input row).
    Refused as :class:`bpclip_fast.layers.embedding.Embedding`: ``max_norm``, ``scale_grad_by_freq``,
    ``sparse``."""

    def __init__(self, num_embeddings, embedding_dim, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                 mode="mean", sparse=False, _weight=None, include_last_offset=False, padding_idx=None, *,
                 clipping="backprop", max_grad_norm=None, clip_fn="clip", gamma=0.01, device=None, dtype=None):
        reason = _embedding_problem(max_norm, scale_grad_by_freq, sparse)
        if reason:
            raise ValueError(f"EmbeddingBag: {reason}")
        if mode not in _MODES:
            raise ValueError(f"EmbeddingBag: mode must be one of {tuple(_MODES)}, got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, mode=mode, _weight=_weight,
                         include_last_offset=include_last_offset, padding_idx=padding_idx, device=device, dtype=dtype)
        self.register_parameter("bias", None)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def forward(self, input, offsets=None, per_sample_weights=None):
        bags = self._bags(input, offsets, per_sample_weights)
        dev = input.device.type
        if autocast_on(dev):
            # As base._in_parameter_dtype: the layer computes in its parameters' dtype.
            idx, offs, psw = bags
            if psw is not None and psw.dtype != self.weight.dtype:
                bags = (idx, offs, psw.to(self.weight.dtype))
            with torch.autocast(dev, enabled=False):
                return self._run(bags, input)
        return self._run(bags, input)

    def _run(self, bags, input):
        if torch.compiler.is_compiling():
            return compiled.example_layer(self, bags)
        return exact_examples.example_layer(self, bags, self._bp_noise_sensitivity(input))

    def _bags(self, input, offsets, per_sample_weights):
        """``(indices [N], offsets [B + 1] ending at N, per-sample weights [N] or None)``, checked: one
        layout for both input forms, so that bag ``i`` is entries ``offsets[i]:offsets[i + 1]``."""
        name = self.layer_name
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name}: expected an int64/int32 tensor of indices, got "
                            f"{input.dtype if isinstance(input, torch.Tensor) else type(input).__name__}")
        if input.is_nested:
            raise ValueError(f"{name}: nested tensor input is not supported; pass a 2-D [B, T] tensor (pad with "
                             "padding_idx) or a 1-D tensor with offsets")
        if input.device != self.weight.device:
            raise ValueError(f"{name}: the input is on {input.device} but the layer's parameters are on "
                             f"{self.weight.device}; move the input or the model (.to(device)) so they match")
        psw = per_sample_weights
        if psw is not None:
            if self.mode != "sum":
                raise ValueError(f"{name}: per_sample_weights are only supported with mode='sum' (torch's rule), "
                                 f"got mode={self.mode!r}")
            if not isinstance(psw, torch.Tensor) or psw.shape != input.shape:
                raise ValueError(f"{name}: per_sample_weights must be a tensor of the input's shape "
                                 f"{tuple(input.shape)}, got "
                                 f"{tuple(psw.shape) if isinstance(psw, torch.Tensor) else type(psw).__name__}")
            psw = psw.reshape(-1)
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError(f"{name}: a 2-D input [B, T] is B bags of T entries; offsets must be None")
            b, t = input.shape
            if t == 0 and b > 0:
                raise ValueError(f"{name}: a 2-D input needs at least one entry per bag, got shape {tuple(input.shape)}")
            full = (torch.arange(0, (b + 1) * t, t, dtype=input.dtype, device=input.device) if t
                    else input.new_zeros(1))
            return input.reshape(-1), full, psw
        if input.dim() != 1:
            raise ValueError(f"{name}: the input must be 2-D [B, T] or 1-D with offsets, got {input.dim()}-D")
        if self._bp_step is not None:
            raise ValueError(
                f"{name}: a 1-D input with offsets is not supported under make_private: the engine samples, "
                "splits and probes batches along dim 0 of the inputs, one example per row, and a 1-D index "
                "tensor is not batch-major; pass the bags as a 2-D [B, T] tensor (pad with padding_idx; mean "
                "mode does not count padding entries)")
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name}: a 1-D input needs offsets, a 1-D int64/int32 tensor of bag starts")
        n = input.shape[0]
        end = offsets.new_full((1,), n)
        full = offsets if self.include_last_offset else torch.cat([offsets, end])
        # torch reads decreasing offsets without complaint (and its CPU kernel puts the entries past an
        # include_last_offset end in the last bag): bags would then not be offsets[i]:offsets[i + 1].
        ok = full.numel() >= 2 and bool(((full[1:] >= full[:-1]).all() & (full[0] == 0) & (full[-1] == n)))
        if not ok:
            last = "the input's length" if self.include_last_offset else "at most the input's length"
            raise ValueError(f"{name}: offsets must start at 0, be non-decreasing and end at {last} ({n})"
                             f"{' with at least one bag' if self.include_last_offset else ''}; got "
                             f"{offsets.tolist() if offsets.numel() <= 16 else tuple(offsets.shape)}")
        return input, full, psw

    def _forward(self, bags, weight, bias, keep):
        idx, full, psw = bags
        if full.shape[0] == 1:  # no bag (an empty Poisson batch): torch's kernel must not see it
            out = weight.new_zeros(0, self.embedding_dim)
            if not keep:
                return out, ()
            empty = idx.new_zeros(0, dtype=torch.int64)
            if self.mode == "max":
                return out, (empty.reshape(0, self.embedding_dim), empty)
            return out, (empty, empty, weight.new_zeros(0))
        out, _, bag_size, max_indices = torch.embedding_bag(
            weight, idx, full, False, _MODES[self.mode], False, psw, True, self.padding_idx)
        if not keep:
            return out, ()
        if self.mode == "max":
            return out, (max_indices, bag_size)
        b = full.shape[0] - 1
        bag = torch.repeat_interleave(torch.arange(b, device=idx.device), full[1:] - full[:-1], output_size=idx.shape[0])
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        if self.mode == "mean":  # 1/|bag|, |bag| without padding entries (an empty bag reads no entry)
            w = (1.0 / bag_size.to(acc).clamp(min=1))[bag]
        else:
            w = psw.detach().to(acc) if psw is not None else torch.ones(idx.shape[0], dtype=acc, device=idx.device)
        return out, (idx, bag, w)

    def _examples(self, saved, g, mask):
        b, v, dim = g.shape[0], self.num_embeddings, self.embedding_dim
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        if self.mode == "max":
            max_indices, bag_size = saved
            # Dimension d of g_i goes to row max_indices[i, d]: one (key, d) pair per (i, d), so the rows
            # are written, not summed. Empty (or all-padding) bags read no row: torch gives them nothing.
            example = torch.arange(b, device=g.device).unsqueeze(1).expand(b, dim)
            column = torch.arange(dim, device=g.device).expand(b, dim)
            keep = (bag_size > 0).unsqueeze(1).expand(b, dim).reshape(-1)
            keys = (example * v + max_indices.long()).reshape(-1)[keep]
            keys, inverse = torch.unique(keys, return_inverse=True)
            rows = g.new_zeros(keys.shape[0], dim, dtype=acc)
            rows[inverse, column.reshape(-1)[keep]] = g.reshape(-1)[keep].to(acc)
        else:
            idx, bag, w = saved
            idx = idx.long()
            keys = bag * v + idx
            terms = g.to(acc)[bag] * w.unsqueeze(1)
            if self.padding_idx is not None:  # torch gives the padding row no gradient
                keep = idx != self.padding_idx
                keys, terms = keys[keep], terms[keep]
            keys, inverse = torch.unique(keys, return_inverse=True)
            rows = terms.new_zeros(keys.shape[0], dim).index_add_(0, inverse, terms)
        return examples.RowExamples(rows, keys // v, keys % v, b, None, v, self.weight.dtype)

    def extra_repr(self):
        return f"{nn.EmbeddingBag.extra_repr(self)}, {self._bp_clip_repr()}"


def _convert_embedding_bag(layer: nn.EmbeddingBag, **clipping) -> EmbeddingBag:
    return EmbeddingBag(layer.num_embeddings, layer.embedding_dim, mode=layer.mode,
                        include_last_offset=layer.include_last_offset, padding_idx=layer.padding_idx, device="meta",
                        dtype=layer.weight.dtype, **_exact_kwargs(clipping))


def _plain(layer, x, p, offsets=None, per_sample_weights=None):
    return F.embedding_bag(x, p["weight"], offsets, mode=layer.mode, per_sample_weights=per_sample_weights,
                           include_last_offset=layer.include_last_offset, padding_idx=layer.padding_idx)


def _multiplier_norm(layer, x, offsets=None, per_sample_weights=None) -> float:
    """Bag ``i``'s gradient sums the terms ``|w_t|·|g_i|`` of its entries (``w`` the per-sample weights,
    1 without them; mean and max add less): their norm over the batch is at most
    ``Σ_i ‖g_i‖·Σ_t |w_{i,t}| ≤ ‖g‖·(Σ_i (Σ_t |w_{i,t}|)²)^½`` (Cauchy–Schwarz), ``T·√B·‖g‖`` for ``w = 1``."""
    if per_sample_weights is not None and x.dim() == 2:
        return float(per_sample_weights.double().abs().sum(1).norm())
    return float(x.shape[-1]) * float(x.shape[0]) ** 0.5 if x.dim() == 2 else float(x.numel())


registry.register_layer(nn.EmbeddingBag, EmbeddingBag, convert=_convert_embedding_bag, modes=modes.EXACT,
                        multiplier_norm=_multiplier_norm, plain=_plain)


@registry.register_module_check(nn.EmbeddingBag)
def _embedding_bag_options(module):
    return _embedding_problem(module.max_norm, module.scale_grad_by_freq, module.sparse)
