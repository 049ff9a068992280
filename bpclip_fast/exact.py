"""Exact per-example clipping: modes ``per_layer`` and ``flat`` (DESIGN.md §6; docs/design.md).

Each layer's backward computes its input gradient from the **unclipped** upstream gradient ``g``,
and each example's squared gradient norm ``‖[∇W_i, ∇b_i]‖²`` without materialising the per-example
gradients where that is costly (``csrc/exact.cpp``: ghost norms or chunked instantiation, by the
cost rule). Then:

* ``per_layer``: factor ``c_{l,i} = f(‖G_{l,i}‖; C_l)`` at once, and the weight gradient is one
  GEMM on ``diag(c)·g`` into the buffer that already holds the noise ``N(0, σ²C²)``.
* ``flat``: the norms go into this forward's :class:`_Book`; when autograd runs the book's
  collector node — after the backward of every layer whose output reached the loss, whatever the
  branching or order, because the collector's outputs are inputs of every layer (autograd's own
  dependency count, not hook order) — the factor ``c_i = f((Σ_l ‖G_{l,i}‖²)^½; C)`` is known and
  each layer's weight gradient is the same one GEMM. No second backward, no gradient computed
  and thrown away.

The factors are computed from an upper bound of each norm that covers the rounding of the norms
and of the scaling (``csrc/exact.cpp``), by ``clip_rows`` (whose own proof keeps ``c·bound ≤ C``);
so each example's contribution to the release is at most ``C`` (flat: over all layers; per_layer:
``C_l`` per layer, ``(Σ_l C_l²)^½ = C`` over all), and the noise std is ``σC`` on every coordinate.

``loss_reduction="mean"`` follows the rule proved in :mod:`bpclip_fast.engine` for backpropagation
clipping: the backward over ``d`` rows clips at ``C/d`` (and ``γ/d``), adds noise ``σC/d`` and
multiplies by ``d/B̄``. The upstream gradient of example ``i`` is ``v_i/B`` (every backward map
below the loss is linear in the upstream gradient), so its parameter gradient is ``G_i/B`` and
``f(‖G_i‖/d; C/d) = f(‖G_i‖; C)`` (the factors are invariant under a common positive scale): the
release is ``(1/B̄)(Σ_i c_i G_i + N(0, σ²C²))`` with ``c_i`` the sum-loss factor of example ``i``
alone. ``flat`` needs every layer of one book to have seen the same ``d`` rows (checked).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import _ops, handles
from .amp import autocast_off
from .graph_nodes import forward_origin, untraced
from .modes import EXACT as EXACT_MODES, NAMES as MODES  # noqa: F401  (the modes' names live in bpclip_fast.modes)

NORM_METHODS = ("auto", "ghost", "instantiate")
WORKSPACE_BYTES = 64 << 20  # temporaries of the norms (instantiated gradients, Gram matrices) per layer
# On the CPU less: glibc serves a block above its mmap threshold (32 MB at most) by a fresh mmap
# each time, whose pages fault on first touch, ~0.25 ms per MB written; a 64 MB chunk's patches of
# CIFAR-10's 32 -> 64 conv (b32) paid it every step (that conv's norms 25.4 ms, 12.6 at 24 MB).
CPU_WORKSPACE_BYTES = 24 << 20
# Kept instantiated per-example gradients (csrc/exact.cpp, keep_instantiated) beyond the ones that
# cost no memory: under flat clipping they live until the collector's release, so a forward's book
# counts them against this (entries of a pass that never reached the collector count until the next
# release; two forwards summed into one backward have a book each); per_layer releases each at once.
# Keeping saves the release's second GEMM over the positions (CIFAR-10 b32's two deep convs).
KEPT_BYTES = 64 << 20
# Factors below this are set to 0: the bounds of csrc/exact.cpp cover the absolute (subnormal)
# rounding of the release only for factors >= 1/K, K = 2^60 (kFloorInverse there). It drops only
# examples whose bound exceeds 2^60·C; they are not counted as non-finite (no finite example is).
FACTOR_FLOOR = 2.0 ** -60


def factors(bound, max_norm: float, clip_fn: str, gamma: float, nonfinite: torch.Tensor,
            data_dtype: torch.dtype) -> torch.Tensor:
    """The per-example clip factors for norm upper bounds ``bound`` (float64 [B]; flat: the list of
    every layer's, whose total is an upper bound on the root of their sum of squares,
    csrc/include/bpclip_fast/bound.h): ``clip_rows`` on the bounds as rows of one element, so
    ``c·bound ≤ C`` after rounding (csrc/include/bpclip_fast/clip.h). The bounds are rounded *up*
    to the factor dtype (fp32; fp64 for fp64 data); a non-finite bound gives factor 0 and is counted
    in ``nonfinite``; a factor below :data:`FACTOR_FLOOR` is set to 0 (the subnormal part of the
    bound's proof, csrc/exact.cpp). One op (``exact_factors``) for both modes: the one place where
    factors are made (the audits plant their bugs here). ``bound`` may be a :class:`PendingBound`
    (a per_layer layer's instantiated per-example gradients): its bound and factors are made by one
    kernel (``examples_factors``) with exact_factors' arithmetic, and the bound is kept on it."""
    if isinstance(bound, PendingBound):
        factor, bound.value = bound.examples.factors(bound.mask, nonfinite, float(max_norm), clip_fn, float(gamma),
                                                     data_dtype == torch.float64)
        return factor
    bounds = bound if isinstance(bound, (list, tuple)) else [bound]
    factor, _ = torch.ops.bpclip_fast.exact_factors(bounds, nonfinite, float(max_norm), clip_fn, float(gamma),
                                                    data_dtype == torch.float64)
    return factor


class PendingBound:
    """The norm bounds of a per_layer layer's instantiated per-example gradients (``examples``,
    ``mask``), not yet computed: :func:`factors` computes them with the factors, in one launch
    instead of two (issue 25), and leaves them in ``value``."""

    __slots__ = ("examples", "mask", "value")

    def __init__(self, examples, mask):
        self.examples, self.mask, self.value = examples, mask, None


def _weight_bias(layer):
    """``(layer.weight, layer.bias)`` without ``Module.__getattr__`` (a Python call per read, asked
    several times per layer per step): a registered parameter is read from ``_parameters`` unless an
    instance attribute shadows it, where attribute lookup would find that first, as it does here."""
    d = layer.__dict__
    if "_bp_slots" in d:  # a generic unit (bpclip_fast.generic): all of its parameters
        return layer._bp_params()
    ps = d["_parameters"]
    w = ps["weight"] if "weight" in ps and "weight" not in d else layer.weight
    b = ps["bias"] if "bias" in ps and "bias" not in d else layer.bias
    return w, b


# Weights stored in another layout than the one the Linear/Conv2d ops take (``layer._bp_weight_layout``,
# issue 26): HF's ``Conv1D`` holds a Linear's weight transposed (``[in, out]``), ``nn.Conv1d`` a
# Conv2d's without its kernel height of 1 (``[O, C/G, k]``), ``nn.Conv3d`` a Linear's over its patches
# with the kernel unflattened (``[O, C, kd, kh, kw]``, layers/conv3d.py). The ops run on the kernel
# layout (a view of the parameter); the release is mapped back by the inverse bijection of entries (a
# transpose, or a view of the same entries in the parameter's shape), so each entry of the parameter
# gets exactly one entry of the ops' release, noise included, and the parameter's gradient is the very
# tensor the layer records.
TRANSPOSED, HEIGHT_ONE, FLATTENED = "transposed", "height_one", "flattened"


def kernel_weight(layer, weight):
    """``weight`` (the layer's parameter, or its detached alias) in the ops' layout: itself for
    Linear/Conv2d."""
    layout = layer._bp_weight_layout
    if layout is None:
        return weight
    if layout == FLATTENED:  # [O, C·kd·kh·kw] in (c, i, j, k) order: the patches' (layers/conv3d.py)
        return weight.flatten(1)
    return weight.t() if layout == TRANSPOSED else weight.unsqueeze(2)


def kernel_geometry(layer, padding):
    """``(stride, padding, dilation)`` of the Conv2d ops for ``layer`` and the ops' 2-D ``padding``:
    ``nn.Conv1d``'s at height 1 (stride and dilation 1 along it; its padding comes as ``(0, p)``)."""
    stride, dilation = list(layer.stride), list(layer.dilation)
    if len(stride) == 1:  # HEIGHT_ONE
        stride, dilation = [1, *stride], [1, *dilation]
    return stride, list(padding), dilation


def _param_layout(layer, grad, weight):
    """A release ``grad`` of :func:`kernel_weight`'s layout in the parameter ``weight``'s (contiguous:
    the compiled ops' outputs are declared so, and AccumulateGrad would copy a transposed one anyway)."""
    layout = layer._bp_weight_layout
    if layout is None or grad is None:
        return grad
    return grad.t().contiguous() if layout == TRANSPOSED else grad.view(weight.shape)


def _trainable(layer, wb=None):
    """``[weight, bias]`` (a generic unit: each of its parameters): which of the layer's parameters
    train (their gradients are computed). ``wb``: :func:`_weight_bias` of the layer, where the caller
    has read it already."""
    return [p is not None and p.requires_grad for p in (_weight_bias(layer) if wb is None else wb)]


class _Entry:
    """What a flat layer's backward leaves in the book for the collector."""

    __slots__ = ("layer", "x", "g", "kept", "bound", "step_args", "geometry", "task")

    def __init__(self, layer, x, g, kept, bound, step_args, geometry):
        # With kept per-example gradients (csrc/exact.cpp, keep_instantiated) x and g are not held.
        self.layer, self.x, self.g, self.kept, self.bound = layer, x, g, kept, bound
        self.step_args, self.geometry = step_args, geometry
        self.task = torch._C._current_graph_task_id()


class _Book:
    """One forward's flat layers: their tokens (collector outputs) and, during the backward, entries.
    ``serial`` names it in the step's records (``LayerStep.books``): unlike ``id()``, never reused."""

    _serials = itertools.count()

    def __init__(self, group, tokens):
        self.serial = next(_Book._serials)
        self.group = group
        self.tokens = dict(zip((id(layer) for layer in group.layers), tokens))
        self.entries: list[_Entry] = []
        self.kept_bytes = 0  # the entries' kept per-example gradients (KEPT_BYTES)
        self.released: set = set()  # ids of the layers a pass released (FlatClipping.release)


class _Collector(torch.autograd.Function):
    """Forward: the flat layers' trainable parameters in, one token per layer out (each layer takes
    its token as an input). Backward: runs once every layer that reached the loss has added its
    entry, and returns the clipped, noised gradients of the parameters."""

    @staticmethod
    def forward(ctx, group, holder, *params):
        ctx.group, ctx.holder = group, holder
        ctx.set_materialize_grads(False)
        # One buffer, one view per layer: a launch per forward, not per layer. The tokens carry no
        # data (the layers ignore their values and return no gradient for them: None, which
        # set_materialize_grads(False) lets through; this backward runs all the same).
        zeros = torch.zeros(len(group.layers), device=params[0].device)
        return tuple(zeros[i] for i in range(len(group.layers)))

    @staticmethod
    @untraced  # graph_nodes.untraced: the engine's calls never run under dynamo
    @once_differentiable
    @autocast_off
    def backward(ctx, *token_grads):
        grads = ctx.group.release(ctx.holder["book"])
        return (None, None, *(grads.get(id(p)) for p in ctx.holder["params"]))


def attach_flat(module, layers, max_grad_norm: float, clip_fn: str, gamma: float) -> "FlatClipping":
    """Gives ``layers`` one :class:`FlatClipping` on ``module``, replacing any they had (not once a
    privacy engine holds them: the noise is scaled to the engine's ``C``)."""
    held = [layer.layer_name for layer in layers if layer._bp_step is not None and layer._bp_step.enforce]
    if held:
        raise RuntimeError(f"attach_flat: {', '.join(held)} belong to a PrivacyEngine, whose flat clipping is fixed "
                           "at make_private")
    for group in {id(layer._bp_flat): layer._bp_flat for layer in layers if layer._bp_flat is not None}.values():
        group.remove()
    return FlatClipping(module, layers, max_grad_norm, clip_fn, gamma)


class FlatClipping:
    """The book-keeping of ``flat`` clipping for the flat layers of ``module``: a forward pre-hook
    starts a book (and its collector node) for every grad-enabled forward of ``module``; the layers
    find it as :meth:`current` and the collector releases their gradients at the end of the backward.

    Made by ``bpclip_fast.nn.convert_model(..., clipping="flat")`` (and so by ``make_private``). A
    flat layer run outside ``module``'s forward (a submodule called directly, or recomputed by
    activation checkpointing during the backward) raises: its norm would be missing from ``c_i``.
    """

    def __init__(self, module, layers, max_grad_norm: float, clip_fn: str, gamma: float):
        self.layers = list(layers)
        self._clipping = (float(max_grad_norm), clip_fn, float(gamma))  # read-only: the noise is scaled to C
        self._stack: list = []
        self._handles = [module.register_forward_pre_hook(self._begin),
                         module.register_forward_hook(self._end, always_call=True)]
        self.handle = handles.register(self)  # the compiled ops' name for it (bpclip_fast.handles)
        for i, layer in enumerate(self.layers):
            layer._bp_flat, layer._bp_flat_position = self, i

    def __getstate__(self):
        return {**self.__dict__, "handle": None}  # process-local and random: saved bytes must not vary

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.handle = handles.register(self)  # a copy's own, not the original's

    @property
    def max_grad_norm(self) -> float:
        return self._clipping[0]

    def _set_max_grad_norm(self, value: float) -> None:
        """The engine's adaptive threshold, between steps (its layers' noise bounds move with it)."""
        self._clipping = (float(value), *self._clipping[1:])

    @property
    def clip_fn(self) -> str:
        return self._clipping[1]

    @property
    def gamma(self) -> float:
        return self._clipping[2]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for layer in self.layers:
            layer._bp_flat = None

    def current(self):
        return self._stack[-1] if self._stack else None

    def _begin(self, module, args):
        params = []
        for layer in self.layers:  # what _trainable says trains, read once per layer
            params += [p for p in _weight_bias(layer) if p is not None and p.requires_grad]
        if not (torch.is_grad_enabled() and params):
            self._stack.append(None)
            return
        if torch.compiler.is_compiling():  # the collector as an opaque op (bpclip_fast.compiled)
            from . import compiled
            self._stack.append(compiled.begin_flat(self, params))
            return
        holder = {"params": params}
        tokens = _Collector.apply(self, holder, *params)
        book = _Book(self, tokens)
        holder["book"] = book
        self._stack.append(book)

    def _end(self, module, args, output):
        if self._stack:
            book = self._stack.pop()
            if book is not None:  # the layers took their tokens; holding them would keep the graph alive
                book.tokens = {}

    def _refuse_another_layer_set(self, entries, serial: int) -> None:
        """A release after which the layers holding this step's contribution would not all hold the same
        releases (books): its factors cover only the layers its forward reached, so one example's
        gradient over the step would be clipped piece by piece (a frozen trunk and k heads, one loss per
        head over a fresh forward each: √k·C per example in ``.grad``, review 50 F2). ``step()`` refuses
        that state (:meth:`bpclip_fast.modes.flat.Flat.step_problems`); it is refused here, before the
        release computes, since it would be readable in ``.grad`` first. One forward's release split
        over passes by layer groups (``backward(inputs=...)``) keeps one book everywhere and passes.
        Asked only once a layer holds a contribution (micro-batches), of the layers this pass lands on."""
        steps = [layer._bp_step for layer in self.layers]
        held = [st for st in steps if st is not None and st.enforce and st.rows]  # unenforced (audits): no records
        if not held:
            return
        landing = {id(e.layer._bp_step) for e in entries
                   if e.layer._bp_step is not None and e.layer._bp_step.enforce and e.layer._bp_step.lands_now()}
        after = {frozenset(st.books | ({serial} if id(st) in landing else set())) for st in held}
        held_ids = {id(st) for st in held}
        after |= {frozenset({serial}) for e in entries if id(e.layer._bp_step) in landing - held_ids}
        if len(after) < 2:
            return
        _refuse_release([e.layer for e in entries], "under flat clipping every layer holding this step's "
                        "contribution must hold the same forwards' releases, but this backward pass would land "
                        "another forward's release on another set of layers (another loss or head per pass, layers "
                        "frozen in turn), so no factor would cover an example's whole gradient",
                        "backward the sum of the losses once per micro-batch")

    def release(self, book: _Book) -> dict:
        """``{id(parameter): gradient}`` for every layer with an entry: the flat factors from all
        entries' bounds, then each layer's clipped, noised, scaled gradients."""
        # This pass's entries only: a pass that never reached the collector (torch.autograd.grad with
        # respect to the input) left entries that belong to no release; a second pass over a
        # retained graph releases its own (and the row count refuses it).
        task = torch._C._current_graph_task_id()
        entries = [e for e in book.entries if e.task == task]
        book.entries, book.kept_bytes = [], 0
        if not entries:
            return {}
        reached = {id(e.layer) for e in entries}
        if book.released and not reached <= book.released:
            # A later pass over a retained graph that releases layers of the forward an earlier pass did
            # not (multi-task heads backwarded one loss at a time): its factors would come from those
            # layers alone, so one example's release would reach √k·C over k passes, charged C (review
            # 48 G3). A later pass over layers already released is the row rules' (first_landing).
            _refuse_release([e.layer for e in entries], "flat clipping releases one forward's layers together, once, "
                            "but a later backward pass over this forward's retained graph reached layers the first "
                            "did not (one backward per loss of the forward)",
                            "backward the sum of the forward's losses once")
        book.released |= reached
        # One pass over the entries for the refusals below (in their order: rows, then bounds).
        ds, rows, layers, loose, bounds = set(), set(), set(), [], []
        max_grad_norm = self.max_grad_norm
        for e in entries:
            ds.add(e.step_args[3])
            rows.add(e.bound.shape[0])
            layers.add(id(e.layer))
            bounds.append(e.bound)
            if max_grad_norm > e.layer._bp_noise_bound:
                loose.append(e)
        if len(ds) > 1 or len(rows) > 1 or len(layers) < len(entries):
            _refuse_release([e.layer for e in entries], "flat clipping pairs each example's norms across the layers "
                            "of one forward by row, but a layer ran more than once in it or the layers saw different "
                            f"numbers of rows ({sorted(rows)})",
                            "keep every flat layer to one call on all rows of the batch")
        if loose:  # the noise is scaled to each layer's fixed noise_bound: never clip to more
            _refuse_release([e.layer for e in loose], f"flat clipping at C = {self.max_grad_norm:g} above the noise "
                            "bound the layers were made private with", "do not change the clipping after make_private",
                            rule="bounds")
        self._refuse_another_layer_set(entries, book.serial)
        d = ds.pop()
        scratch = torch.zeros(1, dtype=torch.int64, device=entries[0].bound.device)

        by_dtype = {}
        counting = any(e.layer._bp_step is not None and e.layer._bp_step.counting for e in entries)
        unclipped = None
        if counting:  # adaptive: the examples within C, by the same total the factors use
            _, total = torch.ops.bpclip_fast.exact_factors(bounds, scratch, self.max_grad_norm / d, self.clip_fn,
                                                           self.gamma / d, True)
            unclipped = (total <= self.max_grad_norm / d).sum().reshape(1)
        for e in entries:
            if e.layer._bp_step is not None:
                e.layer._bp_step.joined(book.serial)
                if counting:
                    e.layer._bp_step.count(unclipped)
        grads: dict = {}
        wbs = [_weight_bias(e.layer) for e in entries]  # read once: nothing below rebinds them
        for e, wb in zip(entries, wbs):
            dt = wb[0].dtype
            if dt not in by_dtype:
                by_dtype[dt] = factors(bounds, self.max_grad_norm / d, self.clip_fn, self.gamma / d, scratch, dt)
            released = _release(e.layer, e.x, e.g, by_dtype[dt], e.step_args, e.geometry, e.kept)
            for p, g in zip(wb, released):
                if g is not None:
                    grads[id(p)] = g if id(p) not in grads else grads[id(p)] + g
        for e, wb in zip(entries, wbs):
            if e.layer._bp_step is not None:
                e.layer._bp_step.produced(tuple(grads.get(id(p)) if p is not None else None for p in wb))
        return grads


def _refuse_release(layers, details, instead, rule="rows"):
    names = ", ".join(dict.fromkeys(layer.layer_name for layer in layers))
    step = layers[0]._bp_step if layers else None
    if step is not None:
        step.refuse(rule, f"{details} [{names}]")
    raise RuntimeError(f"{details} [{names}]; {instead}")


def _release(layer, x, g, factor, step_args, geometry, kept):
    """``(∇W, ∇b)`` of one layer: ``Σ_i c_i G_i`` plus the step's draw, times the mean-loss scale;
    ``None`` for a parameter that does not train. ``kept``: the norms op's kept per-example
    gradients (or ``None``; then from ``g`` and ``x``). The ops return the noised sum times the scale
    (applied in the noise's launch, as a later ``mul_``: post-processing of the noised sum) in fp32
    (fp64) for every data dtype; it is rounded to the parameter dtype here, once, after both."""
    seed, offset, std, d, scale = step_args
    wb = _weight_bias(layer)
    mask = _trainable(layer, wb)
    if geometry is EXAMPLES:
        return _release_examples(layer, kept, factor, step_args, mask)
    weight, bias = wb
    kernel = kernel_weight(layer, weight)
    kw, kb = kept if kept is not None else (None, None)
    if x is None:
        x = g = weight.new_empty(0)
    if geometry is None:
        gw, gb = torch.ops.bpclip_fast.linear_clipped_grads(g, x, factor, kernel, mask, [seed, offset], std, kw, kb,
                                                            scale)
    else:
        stride, padding, dilation, groups = geometry
        gw, gb = torch.ops.bpclip_fast.conv2d_clipped_grads(g, x, factor, kernel, stride, padding, dilation,
                                                            groups, mask, [seed, offset], std, kw, kb, scale)
    gw = _as_dtype(gw, weight.dtype) if mask[0] else None
    gb = _as_dtype(gb, bias.dtype) if mask[1] else None
    return _param_layout(layer, gw, weight), gb


def _as_dtype(t, dtype):
    """``t.to(dtype)``, which returns ``t`` itself when it already has the dtype, without the
    dispatcher round trip in that case (two per layer per step)."""
    return t if t.dtype == dtype else t.to(dtype)


def _norms(layer, x, g, geometry, mask, counter=None, book=None):
    """``(bound, kept)``: the norm bounds, and the kept per-example gradients (or ``None``).
    ``counter``: flat clipping's per-layer non-finite count, added to by the norms op's own kernel
    (:func:`bpclip_fast.examples._count_nonfinite` does it for the embeddings, in its own launch).
    ``book``: a flat book, whose forward's kept gradients share :data:`KEPT_BYTES`."""
    method, ws = layer._bp_norm_method, CPU_WORKSPACE_BYTES if x.is_cpu else WORKSPACE_BYTES
    extra = KEPT_BYTES if book is None else max(0, KEPT_BYTES - book.kept_bytes)
    if geometry is None:
        _, bound, kw, kb = torch.ops.bpclip_fast.linear_grad_norms(g, x, mask, method, ws, True, counter, extra)
    else:
        stride, padding, dilation, groups = geometry
        kernel = list(layer.kernel_size)
        if len(kernel) == 1:  # nn.Conv1d as a Conv2d of kernel height 1 (HEIGHT_ONE)
            kernel = [1, *kernel]
        _, bound, kw, kb = torch.ops.bpclip_fast.conv2d_grad_norms(g, x, kernel, stride, padding, dilation,
                                                                   groups, mask, method, ws, True, counter, extra)
    if not kw.numel():
        return bound, None
    if book is not None:
        book.kept_bytes += kw.numel() * kw.element_size() + kb.numel() * kb.element_size()
    return bound, (kw, kb)


def _input_grad(layer, x, g, weight, geometry):
    weight = kernel_weight(layer, weight)
    if geometry is None:
        return torch.matmul(g, weight)
    stride, padding, dilation, groups = geometry
    return torch.ops.aten.convolution_backward(g, x, weight, None, stride, padding, dilation, False, [0, 0], groups,
                                               [True, False, False])[0]


class _ExactLayer(torch.autograd.Function):
    """A Linear (``geometry`` None) or Conv2d layer under ``per_layer`` or ``flat`` clipping. Under
    flat the weight and bias come in detached (their gradients come from the collector) and
    ``token`` links the layer to its book."""

    @staticmethod
    def forward(ctx, x, weight, bias, token, layer, sensitivity, geometry, book):
        kernel = kernel_weight(layer, weight)
        if geometry is None:
            out = F.linear(x, kernel, bias)
        else:
            stride, padding, dilation, groups = geometry
            out = F.conv2d(x, kernel, bias, stride, padding, dilation, groups)
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.sensitivity, ctx.geometry, ctx.book = layer, sensitivity, geometry, book
        ctx.bounds_version, ctx._bp_origin = layer._bp_bounds_version, forward_origin()
        return out

    @staticmethod
    @untraced  # graph_nodes.untraced: the engine's calls never run under dynamo
    @once_differentiable
    @autocast_off
    def backward(ctx, grad_out):
        ctx.layer._bp_check_forward(ctx, ctx.bounds_version)  # before the saved tensors: their own check is less clear
        x, weight = ctx.saved_tensors
        layer, geometry, book = ctx.layer, ctx.geometry, ctx.book
        g = grad_out.contiguous()
        gx = _input_grad(layer, x, g, weight, geometry) if ctx.needs_input_grad[0] else None
        mask = _trainable(layer) if book is not None else [ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        if not any(mask):
            return gx, None, None, None, None, None, None, None
        out = clip_params(layer, x, g, geometry, mask, book, ctx.sensitivity)
        if out is None:  # flat: the collector releases the gradients; the token's gradient is not read
            return gx, None, None, None, None, None, None, None
        return gx, *out, None, None, None, None, None


def clip_params(layer, x, g, geometry, mask, book, sensitivity, own_inputs=False):
    """The parameter part of a Linear/Conv2d backward under an exact mode, for ``_ExactLayer`` and
    the compiled op alike (:mod:`bpclip_fast.compiled`): the norms (flat: with the layer's
    non-finite count), then :func:`_clip`. ``own_inputs``: a flat book holds copies of ``x`` and
    ``g`` (a compiled graph reuses their buffers once the op returns, and the release would scale
    other data by factors computed from these norms)."""
    step_args = _step_args(layer, g.shape[0], sensitivity, book)
    bound, kept = _norms(layer, x, g, geometry, mask, layer._bp_nonfinite[1:2] if book is not None else None, book)
    held = (None, None) if kept is not None else (x, g)
    if own_inputs and book is not None and kept is None:
        held = (x.clone(), g.clone())
    return _clip(layer, book, bound, held, kept, step_args, geometry, x.dtype)


def _clip(layer, book, bound, held, kept, step_args, geometry, data_dtype):
    """The part of a layer's backward after its norm bounds: ``flat`` leaves an entry in the book
    (returns ``None``); ``per_layer`` clips at once and returns ``(∇W, ∇b)``."""
    d = step_args[3]
    if book is not None:  # the norms ops (_norms) and example_bound counted the non-finite bounds
        book.entries.append(_Entry(layer, *held, kept, bound, step_args, geometry))
        return None
    if layer._bp_max_grad_norm > layer._bp_noise_bound:  # the noise is scaled to noise_bound
        _refuse_release([layer],
                        f"max_grad_norm {layer._bp_max_grad_norm:g} above the noise bound {layer._bp_noise_bound:g}",
                        "do not change the clipping after make_private", rule="bounds")
    factor = factors(bound, layer._bp_max_grad_norm / d, layer._bp_clip_fn, layer._bp_gamma / d, layer._bp_nonfinite[1:2],
                     data_dtype)
    if isinstance(bound, PendingBound):
        bound = bound.value
    if layer._bp_step is not None and layer._bp_step.counting:  # adaptive thresholds: the examples within C_l
        layer._bp_step.count((bound <= layer._bp_max_grad_norm / d).sum().reshape(1))
    grads = _release(layer, *held, factor, step_args, geometry, kept)
    if layer._bp_step is not None:
        layer._bp_step.produced(grads)
    return grads


def _step_args(layer, rows, sensitivity, book=None):
    """``(seed, offset, std, d, scale)`` of this backward (``boundary.LayerStep.begin_backward``);
    no noise and no scaling for a layer that was never armed. ``book``: flat's, which releases the
    layer's calls of one forward together (a second call in a pass is one more entry)."""
    if layer._bp_step is None:
        return 0, 0, 0.0, 1.0, 1.0
    return layer._bp_step.begin_backward(rows, sensitivity, again_ok=book is not None)


def _flat_book(layer):
    """``(book, token)`` of a flat layer's grad-enabled forward (refused outside its model's forward)."""
    group = layer._bp_flat
    book = group.current() if group is not None else None
    if book is None:
        raise RuntimeError(
            f"{layer.layer_name}: a flat-clipping layer ran with gradients enabled outside the forward of the "
            "model its clipping belongs to (a submodule called directly, a layer recomputed by activation "
            "checkpointing, or a layer built without convert_model); flat clipping needs every layer's norm of "
            "the example, so call the whole model, or use clipping='per_layer'")
    return book, book.tokens.get(id(layer))


def exact_layer(x, layer, sensitivity, geometry=None):
    """The forward of ``layer`` (Linear, or Conv2d with ``geometry = (stride, padding, dilation,
    groups)``) under its exact clipping mode, eager (the layers' forward sends a compiled one to
    :mod:`bpclip_fast.compiled` before it gets here)."""
    _ops.require_extension()
    weight, bias = wb = _weight_bias(layer)
    needs = torch.is_grad_enabled() and any(_trainable(layer, wb))
    book, token = None, None
    if layer._bp_clipping == "flat" and needs:
        book, token = _flat_book(layer)
        weight, bias = weight.detach(), bias.detach() if bias is not None else None
    return _ExactLayer.apply(x, weight, bias, token, layer, sensitivity, geometry, book)


# ------------------------------------------------------------------------------ layers whose per-example
# gradients are instantiated: LayerNorm, GroupNorm, Embedding, PositionalEmbedding, ClassToken

EXAMPLES = "examples"  # the geometry of an entry whose ``kept`` is a per-example representation


def _release_examples(layer, examples, factor, step_args, mask):
    """``(∇W, ∇b)`` from per-example gradients: the clipped sum, the step's draw (counters
    ``offset`` for the weight, ``offset + 1`` for the bias, as every layer), the mean-loss scale,
    rounded once to the stored dtype (a parameter of another dtype is converted after)."""
    seed, offset, std, d, scale = step_args
    if "_bp_slots" in layer.__dict__:  # a generic unit: one [P] vector of its trainable parameters
        flat, _ = examples.release(factor, (True, False), (seed, offset, std, scale))
        return layer._bp_split_release(flat, mask)
    grads = examples.release(factor, mask, (seed, offset, std, scale))
    return tuple(g.to(p.dtype) if m and g is not None else None
                 for p, g, m in zip((layer.weight, layer.bias), grads, mask))
