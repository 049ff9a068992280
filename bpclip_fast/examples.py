"""Instantiated per-example gradients: what the layers whose per-example gradients are formed
(LayerNorm, GroupNorm, Embedding, PositionalEmbedding, ClassToken; bpclip_fast/layers/) hand to the
exact modes — their storage, their norm bound and their clipped, noised release, each proved in its
docstring. The layers' autograd around them is in :mod:`bpclip_fast.exact`."""

from __future__ import annotations


import torch

from . import _ops


def _count_nonfinite(counter, bound):
    """Adds the examples whose (float64) bound is not finite to ``counter``, in one launch:
    ``exact_factors`` counts exactly those (with ``fp64`` the bounds are not rounded to fp32, so no
    finite bound overflows into the count); its factors are not needed here. ``isfinite()``,
    ``logical_not``, ``sum`` and ``add_`` took seven launches per layer."""
    torch.ops.bpclip_fast.exact_factors([bound], counter, 1.0, "clip", 0.0, True)


def _grow(terms: int) -> float:
    """``1 + (n + 4)·2^-52`` for ``n`` summed squares: covers the double sum and the roundings of
    the root and the product by ``√grow`` (RowExamples; DenseExamples' kernel uses ``grow(n + 1)``,
    csrc/include/bpclip_fast/examples.h). Exact in double for ``n < 2^40``."""
    return 1.0 + (terms + 4) * 2.0 ** -52


class DenseExamples:
    """Each example's gradient stored as a tensor: ``[B, *weight.shape]`` (and bias), rounded to the
    parameters' dtype first (so that a lone example's release is exactly its stored values, with no
    rounding after the clipping). The release is ``Σ_i RZ(c_i·G_i)`` (summed in the accumulation
    dtype, in a fixed order), the very values normed here, so the bound needs only the rounding of
    the norm. Both are one kernel each (``examples_bound``, ``examples_release``; their arithmetic
    and proofs: csrc/include/bpclip_fast/examples.h):

    The bound is each example's double sum of squares over its entries (weight and bias side by
    side): squares of fp32/bf16/fp16 entries are exact in double; an fp64 square rounds once
    (``≤ v``, ``v = 2^-53``) or underflows (absolute ``≤ τ/2``, ``τ = 2^-1074``, covered by adding
    ``nτ``); a double sum of ``n`` non-negative terms, in any order, errs by at most
    ``γ_{n-1}(v)``; that addition, the root and the product by ``r ≥ √grow(n + 1)`` round once each,
    so the bound is ``≥ ‖G_i‖`` (for ``nv < 2^-13``: ``n < 2^39``, checked).
    ``factors`` then gives ``c_i·bound ≤ C`` (clip_rows' proof) and ``|RZ(c_i g)| ≤ c_i|g|`` entrywise
    (the release rounds each product toward zero, as ``scale_rows``), so ``‖RZ(c_i·G_i)‖ ≤ C``:
    example ``i`` adds at most ``C`` to the release. A non-finite ``G_i`` has a non-finite bound,
    factor 0, and adds exact zeros (never ``0·NaN``). The release adds the step's draw to the sums
    exactly as ``philox_noise_(accumulate=True)`` would (counters ``offset`` for the weight,
    ``offset + 1`` for the bias), multiplies by the mean-loss scale and rounds once to the dtype.
    """

    def __init__(self, gw, gb, dtype):
        self.gw, self.gb = (t.to(dtype) if t is not None else None for t in (gw, gb))

    def _masked(self, mask):
        return tuple(t if m and t is not None else None for t, m in zip((self.gw, self.gb), mask))

    def bound(self, mask, nonfinite=None) -> torch.Tensor:
        """Float64 ``[B]``; ``nonfinite`` (flat clipping's per-layer count) += the non-finite ones."""
        return _ops.examples_bound(*self._masked(mask), nonfinite)

    def factors(self, mask, nonfinite, max_norm, clip_fn, gamma, fp64):
        """``(factor, bound)``: :meth:`bound` and ``exact_factors`` of it, in one kernel
        (``examples_factors``: the same bound, factor and count). Only :func:`bpclip_fast.exact.factors`
        calls it, so the factors keep their one home."""
        return _ops.examples_factors(*self._masked(mask), nonfinite, max_norm, clip_fn, gamma, fp64)

    def release(self, factor, mask, noise):
        """``(∇W, ∇b)`` in the stored dtype: the clipped sums with the draw ``noise = (seed, offset,
        std, scale)`` added and the scale applied (``None`` where masked)."""
        w, b = self._masked(mask)
        gw, gb = _ops.examples_release(w, b, factor, *noise)
        return (gw if w is not None else None), (gb if b is not None else None)


class RowExamples:
    """An embedding table's per-example gradients as rows: row ``k`` is ``Σ_t g_{i,t}`` over the
    positions ``t`` of example ``i = example[k]`` that read table row ``index[k]`` (ghost norm through
    index equality: no ``[B, V, D]`` tensor). ``‖G_i‖² = Σ_{k of i} ‖row_k‖²``; the release is
    ``Σ_k RZ(c_{example[k]}·row_k)`` into table row ``index[k]``, which holds example ``i``'s rows and
    nothing else of it. The bound: the rows are rounded to the table's dtype first (fp32/fp16/bf16:
    squares exact in double; fp64: see below), a double sum of ``n_i = D·(rows of i)`` squares
    (``γ_{n_i-1}``), then ``√(ŝ·grow(n_i))``, whose product and root round twice: ``grow(n) ≥
    1/((1 − γ_{n-1})(1 − v)^4)`` leaves room for them and for the fp64 squares' own rounding; an fp64
    square that underflows is covered by adding ``n_i·τ`` (``τ = 2^-1074``), one more rounding.
    ``n_i`` counts example ``i``'s own rows (not the batch's padded length, nor an EmbeddingBag's
    longest bag), so that no example's factor depends on another example; ``grow(n_i + 1)`` is exact
    in double (``n_i < 2^40``). ``positions`` is the callers' record only."""

    def __init__(self, rows, example, index, batch, positions, num_embeddings, dtype):
        self.rows, self.example, self.index = rows.to(dtype), example, index
        self.batch, self.positions, self.num_embeddings = batch, positions, num_embeddings

    def bound(self, mask, nonfinite=None) -> torch.Tensor:
        n = torch.bincount(self.example, minlength=self.batch).double() * self.rows.shape[1]
        sq = torch.zeros(self.batch, dtype=torch.float64, device=self.rows.device)
        sq.index_add_(0, self.example, self.rows.double().square().sum(1))
        if self.rows.dtype == torch.float64:  # squares that underflow (see the docstring)
            sq.add_(n * 2.0 ** -1074)
        bound = (sq * (1.0 + (n + 5) * 2.0 ** -52)).sqrt()  # grow(n_i + 1), as _grow
        if nonfinite is not None:
            _count_nonfinite(nonfinite, bound)
        return bound

    def release(self, factor, mask, noise):
        out = self.rows.new_zeros(self.num_embeddings, self.rows.shape[1], dtype=factor.dtype)
        out.index_add_(0, self.index, _ops.scale_rows(self.rows, factor[self.example]).to(factor.dtype))
        return _noised(out, self.rows.dtype, noise, 0), None


def _noised(total, dtype, noise, which):
    """The step's draw on a clipped sum ``total`` (accumulation dtype) of parameter ``which`` (0
    weight, 1 bias: counters ``offset + which``), then the mean-loss scale, then one rounding to
    ``dtype``. The one place the separately drawn noise of these layers is added."""
    seed, offset, std, scale = noise
    if std > 0:
        _ops.philox_noise_(total, seed, offset + which, std, accumulate=True)
    if scale != 1.0:
        total.mul_(scale)
    return total.to(dtype)


def affine_example_grads(g, x, mean, rstd, groups, layer_norm, weight_shape, has_bias):
    """Per-example gradients ``([B, *weight_shape], [B, *weight_shape] or None)`` of a LayerNorm's
    (``layer_norm``) or GroupNorm's affine parameters, in the accumulation dtype, from the statistics
    the forward's ``native_layer_norm``/``native_group_norm`` returned: one fused pass over ``g`` and
    ``x`` (``norm_affine_example_grads``, csrc/cpu/norm_affine_cpu.cpp and its CUDA kernels)."""
    b = x.shape[0]
    gw, gb = _ops.norm_affine_example_grads(g, x, mean, rstd, b, groups, layer_norm)
    return gw.reshape(b, *weight_shape), (gb.reshape(b, *weight_shape) if has_bias else None)
