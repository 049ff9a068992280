"""The generic exact path: any module with trainable parameters and no fused path of ours, trained
under ``flat`` or ``per_layer`` from the per-example gradients of its parameters.

**What is computed.** A *generic unit* is a module that owns a trainable parameter, whose type has
no registered clipped layer (:mod:`bpclip_fast.registry`), with every parameter below it (its
children's too: their forward may never run, as ``nn.MultiheadAttention``'s ``out_proj``). Its
forward runs the module's own code on *inner leaves*: detached copies of its tensor inputs and
parameters, so the autograd graph from them to the outputs is private to the unit. One autograd
node (:class:`_Unit`) stands for the whole unit in the caller's graph. Its backward receives the
upstream gradients ``g`` of the outputs and computes, on the saved inner graph,

* the input gradients ``∂⟨out, g⟩/∂x`` (unclipped, as for every clipped layer: they carry no
  parameter gradient), and
* for each example ``i``, ``G_i = ∂⟨out, g ⊙ e_i⟩/∂θ``, where ``e_i`` keeps the rows of example
  ``i`` along each output's batch dimension and zeroes the rest: one vectorised backward per chunk
  of examples (``torch.autograd.grad(..., is_grads_batched=True)``), so memory stays at
  ``chunk × outputs`` for the masks plus ``B × P`` for the per-example gradients.

**Why ``G_i`` is example ``i``'s gradient.** If each output row ``out_i`` depends on the
parameters and on example ``i``'s input rows only (batch independence, which ``make_private``'s
probes check on the whole model), then ``⟨out, g ⊙ e_i⟩ = ⟨out_i(θ, x_i), g_i⟩`` and
``Σ_i G_i = ∂⟨out, g⟩/∂θ``, the unit's ordinary gradient. ``G_i`` then depends on example ``i``'s
own input and upstream gradient only; removing example ``j ≠ i`` leaves it unchanged. The same
saved graph that produced the forward is differentiated, so dropout and other random choices are
those of the forward (a recomputation would draw new ones).

**The bound and the release** are those of the instantiated layers
(:class:`bpclip_fast.examples.DenseExamples`, proved there): the per-example gradients of the
unit's trainable parameters, flattened and concatenated to ``[B, P]`` and rounded to the
parameters' dtype, are normed in double with a proved upper bound, clipped by the mode's factors
``c_i`` (``c_i·bound_i ≤ C``), and released as ``Σ_i RZ(c_i G_i)`` plus one draw of ``P`` normals
from the layer's weight counters, so example ``i`` moves the whole unit's release by at most
``C``. The released vector is split back into the parameters' gradients.

**Batch dimensions.** Dimension 0 of every tensor input and output, except for modules with a
``batch_first`` attribute set to ``False`` (the recurrent layers, ``nn.MultiheadAttention``,
``nn.Transformer*Layer``), whose sequence-major tensors carry the batch in dimension 1, and the
recurrent layers' hidden states ``h_n``/``c_n``, ``[layers·D, B, H]`` whatever ``batch_first`` says;
see :func:`batch_dims`. Every output that receives a gradient must have the backward's row count ``B``
there (else the step is refused): a mask along the wrong dimension would mix examples.

It is exact and slower than a fused path (``B`` vectorised backward passes of the unit, chunked),
announced once per module type by a warning.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.utils.rnn import PackedSequence
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from . import exact, exact_examples, examples
from .graph_nodes import forward_origin, untraced

# Examples per vectorised backward: the masked upstream gradients of a chunk are CHUNK copies of
# the outputs' gradients.
CHUNK = 16

_ANNOUNCED: set = set()


def batch_dims(module: nn.Module, outputs) -> list[int]:
    """The batch dimension of each output of ``module`` (``outputs``: its flattened outputs, every
    position counted, tensors or not; module docstring)."""
    first = getattr(module, "batch_first", True) is not False
    if isinstance(module, nn.RNNBase):  # (output, h_n[, c_n]): the final states are [layers, B, H] either way
        return [0 if first else 1] + [1] * (len(outputs) - 1)
    if first:
        return [0] * len(outputs)
    if isinstance(module, nn.MultiheadAttention):  # (attn_output [T, B, E], attn_weights [B, T, S])
        return [1, 0][:len(outputs)] + [0] * max(0, len(outputs) - 2)
    return [1] * len(outputs)  # Transformer layers: [T, B, E]


def input_batch_dim(module: nn.Module) -> int:
    return 1 if getattr(module, "batch_first", True) is False else 0


class _State:
    """What a unit's backward needs from its forward: the inner graph's ends (held here, not saved
    through ``save_for_backward``: they are the private graph, not tensors of the caller's)."""

    __slots__ = ("layer", "in_leaves", "param_leaves", "outs", "dims", "rows", "sensitivity", "book",
                 "bounds_version", "dtype", "inner_args", "spec", "tracked", "replay")


class _Unit(torch.autograd.Function):
    """Identity on the unit's outputs in the caller's graph; its backward takes the input gradients
    and the clipped parameter gradients from the unit's inner graph (module docstring)."""

    @staticmethod
    def forward(ctx, state, token, n_inputs, *tensors):
        ctx.state, ctx.n_inputs, ctx._bp_origin = state, n_inputs, forward_origin()
        ctx.set_materialize_grads(False)
        return tuple(o.detach() for o in state.outs)

    @staticmethod
    @untraced  # graph_nodes.untraced: the engine's calls never run under dynamo
    @once_differentiable
    def backward(ctx, *grads):
        st = ctx.state
        layer = st.layer
        layer._bp_check_forward(ctx, st.bounds_version)
        n_params = len(ctx.needs_input_grad) - 3 - ctx.n_inputs
        nones = (None,) * (3 + ctx.n_inputs + n_params)
        pairs = [(o, g, d) for o, g, d in zip(st.outs, grads, st.dims) if g is not None]
        if not pairs:
            return nones
        outs = [o for o, _, _ in pairs]
        gs = [g for _, g, _ in pairs]
        dims = [d for _, _, d in pairs]  # the dims of these outputs: st.dims holds those without a gradient too
        for o, _, d in pairs:
            if o.dim() <= d or o.shape[d] != st.rows:
                raise RuntimeError(
                    f"{layer.layer_name}: an output of shape {tuple(o.shape)} has no dimension {d} of {st.rows} "
                    f"rows (the examples'); the generic exact path masks each example's rows along it, and any "
                    f"other layout would mix examples. Return outputs with the batch in dimension {d}")
        input_grads = _input_grads(ctx, st, outs, gs)
        book = st.book
        mask = exact._trainable(layer) if book is not None else list(ctx.needs_input_grad[3 + ctx.n_inputs:])
        if not any(mask):
            _release_graph(ctx)
            return (None, None, None, *input_grads, *(None,) * n_params)
        leaves = [leaf for leaf, m in zip(st.param_leaves, mask) if m]
        per_example = _per_example(outs, gs, dims, st.rows, leaves)
        _isolate_nonfinite(st, per_example, grads, mask)
        _release_graph(ctx)
        step_args = exact._step_args(layer, st.rows, st.sensitivity, book)
        kept = examples.DenseExamples(per_example, None, st.dtype)
        bound = exact_examples.example_bound(layer, kept, (True, False), book)
        out = exact._clip(layer, book, bound, (None, None), kept, step_args, exact.EXAMPLES, st.dtype)
        if out is None:  # flat: the collector releases the unit with the others
            return (None, None, None, *input_grads, *(None,) * n_params)
        return (None, None, None, *input_grads, *out)


def _release_graph(ctx):
    st = ctx.state
    st.outs = st.in_leaves = st.param_leaves = st.inner_args = ()
    st.replay = None


def _isolate_nonfinite(st, per_example, grads, mask) -> None:
    """Recomputes, alone, each example whose gradient came out non-finite (in place in
    ``per_example``).

    One example's non-finite forward values (an fp16 attention logit that overflows, an infinite
    cell state, an all-padding row) reach every other example's masked backward as ``0·inf = NaN``
    wherever the backward multiplies the zero upstream rows by the forward's values, and the weight
    gradients sum over all rows: every example's gradient would be NaN and every example dropped, so
    that one example would move the release by the others' whole clipped sum. Here example ``i`` is
    recomputed by a forward and backward of the unit in which every example row of every input
    (:func:`_example_rows`, any dtype: boolean padding masks and token ids too) is a copy of example
    ``i``'s, so the whole computation is example ``i``'s: under batch independence its own rows are
    unchanged, and any other row is non-finite only where example ``i``'s own values are. ``G_i`` is
    then a function of example ``i`` alone, finite unless its own values are not (then its bound is
    not finite and its factor 0, as the fused layers drop a non-finite example). A tensor input
    without the examples where :func:`_example_rows` looks (a position table, a 2-D attention mask) is
    shared by the examples and kept. The recomputation runs under what the forward ran under
    (:class:`_Replay`): its autocast state, since a backward outside the autocast region (PyTorch's
    recommended pattern) would recompute in fp32 what the forward computed in bf16, so that the other
    examples' gradients were their fp32 values when a non-finite example was present and their bf16
    values when it was not (2.1·C moved by an example whose own factor was 0), and its generators'
    states, since fresh dropout masks gave the same (2.8·C). The generators are forked around it:
    whether a recomputation runs depends on the data, and it must not move the state later draws
    start from. Costs one read of a flag on the host, and a forward and backward per such example."""
    bad = ~torch.isfinite(per_example).all(1)
    if not bool(bad.any()):
        return
    layer = st.layer
    base = type(layer)._bp_base
    leaves = [leaf for leaf, m in zip(st.param_leaves, mask) if m]
    args, kwargs = pytree.tree_unflatten(list(st.inner_args), st.spec)
    for i in bad.nonzero().flatten().tolist():
        iargs, ikwargs = _example_rows(layer, args, kwargs, i, st.rows)
        with st.replay.entered(), torch.enable_grad(), \
                _reparametrize_module(layer, layer._bp_leaves_map(st.param_leaves), tie_weights=False):
            out = base.forward(layer, *iargs, **ikwargs)
        out_flat = pytree.tree_flatten(out)[0]
        outs, gs = [], []
        for j, g, dim in zip(st.tracked, grads, st.dims):
            if g is None:
                continue
            outs.append(out_flat[j])
            gs.append(_only_rows(g, dim, torch.arange(st.rows, device=g.device) == i))
        got = torch.autograd.grad(outs, leaves, gs, allow_unused=True)
        per_example[i] = torch.cat([(t if t is not None else torch.zeros_like(leaf)).reshape(-1)
                                    for t, leaf in zip(got, leaves)])


class _Replay:
    """The thread-local state that decided the values of a unit's forward besides its inputs and
    parameters: autocast (for the CPU and the parameters' device type) and the default generators'
    states at the forward's start (dropout's masks). :func:`_isolate_nonfinite` recomputes under it,
    so that example ``i``'s recomputed rows are the forward's own (same kernels, dtypes and masks),
    with the generators forked around it. Costs a copy of the generators' states per forward of a
    unit (the CPU's 5 KB; a CUDA device's seed and offset), as ``torch.utils.checkpoint``'s."""

    __slots__ = ("autocast", "cache", "cpu", "cuda", "index")

    def __init__(self, device: torch.device):
        self.autocast = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                         for t in dict.fromkeys(("cpu", device.type)) if torch.amp.is_autocast_available(t)]
        self.cache = torch.is_autocast_cache_enabled()
        self.cpu = torch.get_rng_state()
        self.index = self.cuda = None
        if device.type == "cuda":
            self.index = device.index if device.index is not None else torch.cuda.current_device()
            self.cuda = torch.cuda.get_rng_state(self.index)

    @contextlib.contextmanager
    def entered(self):
        with torch.random.fork_rng(devices=[] if self.cuda is None else [self.index]), \
                contextlib.ExitStack() as stack:
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.index)
            for device_type, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.cache))
            yield


def _only_rows(g, dim, keep):
    """``g`` with the rows along ``dim`` outside ``keep`` (boolean, ``[rows]``) set to 0, not
    multiplied by 0: another example's non-finite upstream row (its loss overflowed after the unit)
    times 0 is NaN."""
    shape = [1] * g.dim()
    shape[dim] = keep.shape[0]
    return torch.where(keep.view(shape), g, torch.zeros((), dtype=g.dtype, device=g.device))


def _example_rows(module, args, kwargs, i, rows):
    """``(args, kwargs)`` with every example row replaced by example ``i``'s, along each input's own
    batch dimension: a recurrent layer's ``hx`` is ``[layers·D, B, H]`` whatever ``batch_first`` says;
    attention's ``*key_padding_mask`` is ``[B, S]`` and a 3-D ``*mask`` ``[B·heads, T, S]``; any other
    tensor carries the examples in :func:`input_batch_dim` when it has ``rows`` there, else it is shared
    and kept."""
    d = input_batch_dim(module)
    heads = getattr(module, "num_heads", None) or getattr(getattr(module, "self_attn", None), "num_heads", None)
    try:
        bound = inspect.signature(type(module)._bp_base.forward).bind(module, *args, **kwargs)
    except TypeError:
        bound = None

    def rule(name):
        if isinstance(module, nn.RNNBase) and name == "hx":
            return lambda t: _repeat_row(t, 1, i, rows)
        if name.endswith("key_padding_mask"):
            return lambda t: _repeat_row(t, 0, i, rows)
        if name.endswith("mask") and heads:
            return lambda t: (_repeat_row(t.view(rows, heads, *t.shape[1:]), 0, i, rows).view(t.shape)
                              if t.dim() == 3 and t.shape[0] == rows * heads else t)
        return lambda t: _repeat_row(t, d, i, rows)

    def apply(f, value):
        return pytree.tree_map(lambda t: f(t) if isinstance(t, torch.Tensor) else t, value)

    if bound is None:
        f = rule("")
        return apply(f, args), apply(f, kwargs)
    for name, value in list(bound.arguments.items())[1:]:
        bound.arguments[name] = apply(rule(name), value)
    return bound.args[1:], bound.kwargs


def _repeat_row(t, dim, i, rows):
    if t.dim() <= dim or t.shape[dim] != rows:
        return t
    return t.detach().index_select(dim, torch.full((rows,), i, dtype=torch.long, device=t.device))


def _input_grads(ctx, st, outs, gs):
    """``∂⟨out, g⟩/∂x`` for each tensor input the caller's graph wants a gradient of."""
    wanted = [i for i in range(ctx.n_inputs) if ctx.needs_input_grad[3 + i]]
    result = [None] * ctx.n_inputs
    leaves = [st.in_leaves[i] for i in wanted]
    if leaves:
        got = torch.autograd.grad(outs, leaves, gs, retain_graph=True, allow_unused=True)
        for i, g in zip(wanted, got):
            result[i] = g
    return result


def _per_example(outs, gs, dims, rows, leaves) -> torch.Tensor:
    """``[rows, P]``: each example's gradient of ``leaves``, flattened and concatenated (``[0, P]`` for
    an empty batch, which Poisson sampling draws: the release is then the draw alone)."""
    pieces = [torch.zeros(0, sum(leaf.numel() for leaf in leaves), dtype=leaves[0].dtype, device=leaves[0].device)]
    for start in range(0, rows, CHUNK):
        k = min(CHUNK, rows - start)
        batched = []
        for g, d in zip(gs, dims):
            shape = [1] * (g.dim() + 1)
            shape[0], shape[d + 1] = k, rows
            sel = torch.zeros(k, rows, dtype=torch.bool, device=g.device)
            sel[torch.arange(k), torch.arange(start, start + k)] = True
            # where, not a product: another example's non-finite upstream row times 0 is NaN
            batched.append(torch.where(sel.view(shape), g.unsqueeze(0), torch.zeros((), dtype=g.dtype, device=g.device)))
        got = torch.autograd.grad(outs, leaves, batched, retain_graph=True, allow_unused=True, is_grads_batched=True)
        pieces.append(torch.cat([(t if t is not None else leaf.new_zeros(k, *leaf.shape)).reshape(k, -1)
                                 for t, leaf in zip(got, leaves)], dim=1))
    return torch.cat(pieces, dim=0)


# The names a unit's class adds to the user's module besides the ``_bp_`` ones and nn.Module's own
# overrides: the clipped layers' public API (``layer_name``, ``exact``, the Δ queries). A module
# that has one already would have it shadowed (and its forward read ours), so it is refused by name.
UNIT_NAMES = ("exact", "layer_name", "max_input_shape", "sensitivity", "sensitivity_for", "set_max_input_shape")


def unit_problems(name: str, module: nn.Module) -> list[str]:
    """Why ``module`` cannot become a generic unit, found before anything is converted
    (``registry.mode_problems``: convert_model and make_private report them with the others): it
    defines one of :data:`UNIT_NAMES` (its class, an attribute, a parameter, a buffer or a child),
    which the unit would shadow, or its parameters have several dtypes (the path releases them as one
    vector)."""
    problems = []
    own = (set(module.__dict__) | set(module._parameters) | set(module._buffers) | set(module._modules)
           | {n for n in UNIT_NAMES if hasattr(type(module), n)})
    clash = sorted(own.intersection(UNIT_NAMES))
    if clash:
        problems.append(f"{name}: has no fused clipped layer, so it is trained by the generic exact path, which adds "
                        f"{', '.join(clash)} to the module; this module already defines "
                        f"{'it' if len(clash) == 1 else 'them'}. Rename the attribute in the module, or freeze its "
                        "parameters (requires_grad_(False))")
    dtypes = {p.dtype for p in module.parameters()}
    if len(dtypes) > 1:
        problems.append(f"{name}: the generic exact path releases a module's parameters as one vector of one dtype, "
                        f"but they have {sorted(map(str, dtypes))}; convert the module to one dtype (module.to(dtype))")
    return problems


class GenericLayer:
    """Mixin of the generic units' classes (:func:`generic_class`): the module's own forward runs on
    inner leaves and one :class:`_Unit` node clips its parameters' gradients (module docstring)."""

    _bp_generic = True

    def _bp_init_generic(self, clipping, max_grad_norm, clip_fn, gamma):
        # What the module held of its own: a noise_multiplier set on the unit after this is a mistaken
        # bare-protocol setting (bpclip_fast.nn.arm_noise refuses it), not one the module reads.
        nn.Module.__setattr__(self, "_bp_own_sigma", "noise_multiplier" in self.__dict__)
        # named_parameters lists a parameter registered twice (tied) once: one parameter of the unit.
        names = [name for name, _ in self.named_parameters()]
        slots = []
        for name in names:
            owner, _, attr = name.rpartition(".")
            slots.append((self.get_submodule(owner) if owner else self, attr))
        nn.Module.__setattr__(self, "_bp_slots", tuple(slots))
        nn.Module.__setattr__(self, "_bp_names", tuple(names))  # unit_problems checked them before the swap
        self._bp_init_clipping(None, None, clip_fn, gamma, clipping, max_grad_norm)

    def _bp_param_device(self):
        m, name = self._bp_slots[0]
        return m._parameters[name].device

    def _bp_params(self) -> tuple:
        params = tuple([m._parameters.get(name) for m, name in self._bp_slots])
        for p in params:
            if p is None:
                raise self._bp_removed_parameter()
        return params

    def _bp_leaves_map(self, leaves) -> dict:
        """``{name: leaf}`` for torch's reparametrisation of the unit's parameters by ``leaves``: one
        name per distinct slot (module object, attribute) that holds one of them. A parameter tied
        between two modules has two slots and both are swapped (what ``tie_weights=True`` does); a
        module held under two names (``self.inner2 = self.inner``) has one slot, and torch's own
        untying swapped it twice, restoring the detached leaf last: after the first forward the
        module held a plain tensor instead of the optimizer's parameter (review 32)."""
        by_param = {id(p): leaf for p, leaf in zip(self._bp_params(), leaves)}
        out, seen = {}, set()
        for prefix, m in self.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                leaf = by_param.get(id(p)) if p is not None else None
                if leaf is not None and (id(m), attr) not in seen:
                    seen.add((id(m), attr))
                    out[f"{prefix}.{attr}" if prefix else attr] = leaf
        return out

    def _bp_removed_parameter(self) -> RuntimeError:
        """A parameter of the unit set to None or deleted after make_private (review 31: an
        AttributeError deep in the engine): the unit's per-example gradients and its noise are laid out
        over the parameters it had, so it cannot train without one."""
        gone = [n for (m, name), n in zip(self._bp_slots, self._bp_names) if m._parameters.get(name) is None]
        return RuntimeError(f"{self.layer_name}: {', '.join(gone)} was removed from this generic unit after make_private "
                            "(set to None or deleted); the unit's per-example gradients and noise are laid out over its "
                            "parameters at make_private: restore it, or make a fresh model private")

    def _bp_split_release(self, flat, mask):
        """The released ``[P]`` vector as the gradients of the unit's parameters (``None`` where
        ``mask`` is off), each its own tensor (not views of one buffer: each parameter's gradient is
        recorded and checked on its own)."""
        out, at = [], 0
        for p, m in zip(self._bp_params(), mask):
            if not m:
                out.append(None)
                continue
            out.append(flat[at:at + p.numel()].view(p.shape).to(p.dtype, copy=True))
            at += p.numel()
        return tuple(out)

    def sensitivity_for(self, input_shape=None) -> float:
        return self._bp_noise_bound

    def _bp_shape_dependent(self, input_shape) -> bool:
        return False

    # Never traced: under torch.compile the unit runs eagerly between compiled regions. Traced, its
    # inner forward became compiled graphs whose backward the per-example vectorised backward runs
    # again over the saved graph (retain_graph) and under vmap, which a compiled backward refuses
    # (donated buffers, aot_eager, once a new batch size recompiled it: every Poisson step) or
    # cannot run (inductor: a BatchedTensor's storage; review 34 P1).
    @untraced
    def forward(self, *args, **kwargs):
        base = type(self)._bp_base
        params = self._bp_params()
        mask = [p.requires_grad for p in params]
        if not (torch.is_grad_enabled() and any(mask)):
            return base.forward(self, *args, **kwargs)
        exact._ops.require_extension()
        _announce(base)
        current = self._bp_flat.current() if self._bp_clipping == "flat" and self._bp_flat is not None else None
        if current is not None and not isinstance(current, exact._Book):  # bpclip_fast.compiled's: no entries
            raise RuntimeError(f"{_label(self)}: a generic unit under clipping='flat' cannot run in a torch.compile'd "
                               "model (the compiled collector has no place for its per-example gradients); use "
                               "clipping='per_layer', or do not compile the model")
        book, token = exact._flat_book(self) if self._bp_clipping == "flat" else (None, None)
        flat_args, spec = pytree.tree_flatten((args, kwargs))
        outer = [a for a in flat_args if isinstance(a, torch.Tensor) and a.requires_grad]
        in_leaves = [a.detach().requires_grad_() for a in outer]
        swap = iter(in_leaves)
        inner_args = [next(swap) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in flat_args]
        param_leaves = [p.detach().requires_grad_(m) for p, m in zip(params, mask)]
        rows = _rows(self, flat_args, (args, kwargs))
        iargs, ikwargs = pytree.tree_unflatten(inner_args, spec)
        replay = _Replay(params[0].device)  # before the forward draws anything
        # torch.func's reparametrisation, not a write into _parameters: some modules keep their
        # own references to their parameters (nn.LSTM's _flat_weights), which it updates too.
        with torch.enable_grad(), _reparametrize_module(self, self._bp_leaves_map(param_leaves), tie_weights=False):
            out = base.forward(self, *iargs, **ikwargs)
        out_flat, out_spec = pytree.tree_flatten(out)
        tracked = [i for i, o in enumerate(out_flat) if isinstance(o, torch.Tensor) and o.requires_grad]
        state = _State()
        state.layer, state.in_leaves, state.param_leaves = self, in_leaves, param_leaves
        state.outs = [out_flat[i] for i in tracked]
        dims = batch_dims(self, out_flat)  # by position among all outputs: an untracked one shifts none
        state.dims = [dims[i] for i in tracked]
        state.rows, state.book, state.dtype = rows, book, params[0].dtype
        state.sensitivity = self._bp_noise_sensitivity(None)
        state.bounds_version = self._bp_bounds_version
        state.inner_args, state.spec, state.tracked, state.replay = inner_args, spec, tracked, replay
        trained = () if book is not None else params
        aliases = _Unit.apply(state, token, len(outer), *outer, *trained)
        for i, a in zip(tracked, aliases):
            out_flat[i] = a
        return pytree.tree_unflatten(out_flat, out_spec)


def _rows(module, flat_args, call) -> int:
    """The examples' count: the batch dimension of the first tensor input. A sequence layer's
    unbatched ``[T, d]`` input and a ``PackedSequence`` (tokens of every example interleaved along
    one dimension) have no dimension of examples: masking one would clip each feature or token as
    an example."""
    if any(isinstance(a, PackedSequence) for a in pytree.tree_leaves(call, is_leaf=lambda a: isinstance(a, PackedSequence))):
        raise ValueError(f"{_label(module)}: the generic exact path clips each example's rows along the batch dimension, "
                         "and a PackedSequence holds the examples' tokens interleaved in one dimension; pad the "
                         "batch instead (a [B, T, d] tensor with batch_first=True, and mask or select the padded "
                         "positions in the model)")
    d = input_batch_dim(module)
    sequence = isinstance(module, (nn.RNNBase, nn.MultiheadAttention))
    for a in flat_args:
        if isinstance(a, torch.Tensor) and a.dim() > d:
            if sequence and a.dim() != 3:
                raise ValueError(f"{_label(module)}: an input of shape {tuple(a.shape)} is unbatched; the generic exact path "
                                 f"clips the examples along the batch dimension ({d}) of batched inputs: pass "
                                 f"{'[B, T, d]' if d == 0 else '[T, B, d]'} tensors")
            return int(a.shape[d])
    raise ValueError(f"{_label(module)}: the generic exact path needs a tensor input with the batch in dimension {d}")


def _label(module) -> str:
    """The module's name in messages, a unit or (in make_private's probes) the module it will be."""
    base = getattr(type(module), "_bp_base", type(module)).__name__
    name = getattr(module, "_bp_name", None)
    return f"{name} ({base})" if name and name != base else base


def _announce(base: type) -> None:
    if base in _ANNOUNCED:
        return
    _ANNOUNCED.add(base)
    warnings.warn(f"bpclip_fast: {base.__module__}.{base.__qualname__} and everything below it are trained by the "
                  "generic exact path, since it owns parameters that no fused clipped layer covers or modules below it "
                  "share a trainable parameter (per-example gradients from one vectorised backward per chunk of "
                  "examples: exact, slower and larger in memory than the fused layers)", stacklevel=3)


# ------------------------------------------------------------------------------ the units' classes
# One class per module type, made on first use: ``Private<Name>(GenericLayer, _Clipped, Name)``. The
# conversion swaps a module's class in place (its attributes, parameters, hooks and state_dict keys
# stay). The classes are reachable as attributes of this module by name, so a model holding one
# pickles and unpickles (torch.save) like any other.

_CLASSES: dict = {}


def _class_name(base: type) -> str:
    # ':' and '/' occur in no module or class name, and the name holds no '.' (pickle splits on it).
    return f"Private:{base.__module__.replace('.', '/')}:{base.__qualname__.replace('.', '/')}"


def generic_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is None:
        from .layers.base import _Clipped  # here, where a unit is made: bpclip_fast.nn imports this module

        name = _class_name(base)
        cls = type(name, (GenericLayer, _Clipped, base), {"_bp_base": base, "__module__": __name__,
                                                           "__qualname__": name})
        _CLASSES[base] = cls
    return cls


def __getattr__(name: str):
    """Unpickling: the unit class named ``name`` (:func:`_class_name`), made again from its base."""
    if not name.startswith("Private:"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _, module_name, qualname = name.split(":", 2)
    module_name, qualname = module_name.replace("/", "."), qualname.replace("/", ".")
    __import__(module_name)
    base = sys.modules[module_name]
    for part in qualname.split("."):
        base = getattr(base, part)
    return generic_class(base)
