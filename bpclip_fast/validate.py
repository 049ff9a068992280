"""What :meth:`bpclip_fast.PrivacyEngine.validate` checks: static checks, and probes that run the model.

The privacy argument (DESIGN.md section 5) assumes that each example reaches each clipped layer once
per step, that a layer's first dimension is the example dimension, that examples do not mix before
(or, through the gradient, after) a layer, that a clipped layer's parameter gradient is exactly its
own clipped contribution, and that nothing data-dependent is released through buffers. Every
problem message names the module (qualified name and type) and the rule, and says what to do.

``static_problems(model)``
    Found without running the model, by the checks of :mod:`bpclip_fast.registry` (the one home of
    what can be trained, which ``convert_model`` and the engine consult too): BatchNorm in any mode,
    InstanceNorm with running statistics, ``padding_mode`` other than zeros, trainable parameters
    outside the registered layer types (:mod:`bpclip_fast.registry`).

``probe(model, example_input)``
    What the engine runs on one example today: a ``torch.no_grad()`` forward (buffers and random
    number generators restored) that counts the calls of every module owning trainable parameters
    (rule *reuse*) and records each one's input shape.

``dynamic_problems(model, example_input)``
    Runs the model on a probe batch of ``B`` rows built from ``example_input`` (its rows repeated,
    floating-point values replaced by seeded random normals so that the outcome does not depend on
    the private data; integer tensors such as token indices are kept). Everything runs on a
    ``copy.deepcopy`` of the model in training mode, under a forked random number generator; if the
    model cannot be deep-copied it runs in place and the training modes, buffers and ``.grad`` are
    restored (Python attributes that ``forward`` itself changes are not). Gradients are taken with
    ``torch.autograd.grad`` of a fixed loss on the outputs (a random projection plus a square), so no
    ``.grad`` is ever written. The probes:

    1. *example rows*: every trainable layer's input has first dimension ``B``. ``B >= 3`` is chosen
       to differ from every dimension of the input and, after a first pass, of every layer input,
       so a ``[T, B, d]`` layout cannot pass by coincidence. Catches ``flatten(0, 1)`` and
       sequence-first layouts inside the model. A generic unit (:mod:`bpclip_fast.generic`) must hold
       the ``B`` examples in the batch dimension the path reads, of its first tensor input and of
       every output that gets a gradient (``B`` avoids their other sizes too): a position table
       returned on its own, a transposed or sequence-first output without ``batch_first=False``.
    2. *batch independence*: changing the first (then the last) example changes no other example's
       model output, trainable-layer input or trainable-layer output gradient. Catches
       ``h - h.mean(0)``, ``F.batch_norm`` with batch statistics, attention across the batch.
       The changed example's integer and boolean tensors (ids, masks, lengths) take the next
       example's values, rolled (:func:`_perturbed`): valid indices, and a new multiset of the batch's tokens.
    3. *buffers*: no buffer changes in one training-mode forward (an EMA, running statistics, a
       counter): it would be updated from the data and released without noise.
    4. *gradient ownership*: each trainable layer's parameter gradient equals the one the layer
       computes from its own inputs and output gradients. Catches a weight also used in plain code
       (a tied decoder ``F.linear(z, enc.weight.t())``), by another module, or by two layers.
    5. *reuse*: no module owning trainable parameters is reached more than once per forward.

    An Embedding's index of one row in the probe batch (a position index shared by the examples) is
    looked up once per example in every pass, as in private training (:mod:`bpclip_fast.broadcast`),
    after :mod:`bpclip_fast.broadcast_probes` checked that this keeps the model's output (else it is
    refused there and the passes look it up as one row) and before it checks that each looked-up row
    reaches its own example only.

    What they cannot see: only what this one probe batch exercises. A layer that sees a subset of
    the rows, mixes rows or is reused only for some data (data-dependent control flow, a branch taken
    for large batches only) passes; so does mixing through an example that is neither the first nor
    the last (``h + h[1]``), a weight used elsewhere with a contribution below rounding error, a
    buffer or Python attribute changed only in some steps or outside ``forward``, Python attributes
    of the model (never compared), and anything the training loop does outside the model (a
    sequence-first input built by the loop, a loss that mixes examples, two backward passes). Values
    that are not finite on the probe batch (a ``log`` of the random inputs) give no verdict.
    Modules already reported statically (BatchNorm, InstanceNorm with running statistics) are put in
    eval mode for the probes, so that their problem is reported once. Our own layers
    (``bpclip_fast.nn.Linear``/``Conv2d``) are probed as their registered torch type.

Without an input, reuse is left to training time, where our layers refuse a second grad-enabled
forward while the step's noise is armed (``bpclip_fast.nn``).

``fix_model(model)``
    Replaces every BatchNorm by a GroupNorm (statistics within each example), in place, and warns
    with the list of what it changed: the fix the BatchNorm problem message suggests.
"""

from __future__ import annotations

from collections.abc import Mapping

import contextlib
import contextvars
import copy
import functools
import math
import types
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from . import nn as _clipped_layers  # noqa: F401  (registers the clipped layer types in the registry)
from . import batches, broadcast, broadcast_probes, registry
from .models import group_count

__all__ = ["static_problems", "probe", "dynamic_problems", "validate", "fix_model"]


def static_problems(model: nn.Module, clipping: str | None = None) -> list[str]:
    """Every problem that can be found without running the model: the registry's module checks
    (:func:`bpclip_fast.registry.module_problems`), with ``clipping`` the layers that mode has no
    bound for (:func:`bpclip_fast.registry.mode_problems`), and a model with nothing to train."""
    problems = registry.module_problems(model)
    if clipping is not None:
        problems += registry.mode_problems(model, clipping)
    if not any(p.requires_grad for p in model.parameters()):
        problems.append(f"{type(model).__name__}: no trainable parameters")
    return problems


# ------------------------------------------------------------ probe(): the engine's one-example forward


def _call(model: nn.Module, example_input):
    """``model`` called the way a training loop would: tuple/list -> ``model(*x)``, dict -> ``model(**x)``."""
    if isinstance(example_input, (tuple, list)):
        return model(*example_input)
    if isinstance(example_input, Mapping):
        return model(**example_input)
    return model(example_input)


def _reuse_problems(calls: dict[str, int], model: nn.Module) -> list[str]:
    modules = dict(model.named_modules())
    return [f"{registry.label(name, modules[name], model)}: reached {k} times in one forward pass (rule: reuse); one example "
            f"would then move its gradient by {k}·Δ while the noise is scaled to Δ; use a separate layer per use"
            for name, k in calls.items() if k > 1]


@contextlib.contextmanager
def _preserved_state(model: nn.Module):
    """Restores the model's buffers and the random number generators after a probe forward."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def probe(model: nn.Module, example_input) -> tuple[list[str], dict[str, tuple]]:
    """One forward pass of ``example_input``: (problems: modules with trainable parameters called more
    than once, {qualified name: input shape} of every clipped layer)."""
    calls: dict[str, int] = {}
    shapes: dict[str, tuple] = {}
    handles = []
    for name, m in model.named_modules():
        if not registry.owns_trainable(m):
            continue

        def hook(mod, args, _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            if args and isinstance(args[0], torch.Tensor):
                shapes[_name] = tuple(args[0].shape)

        handles.append(m.register_forward_pre_hook(hook))
    try:
        with _preserved_state(model), torch.no_grad():
            _call(model, example_input)
    finally:
        for h in handles:
            h.remove()
    return _reuse_problems(calls, model), shapes


# ------------------------------------------------------------------------------- the probe batch

# One fixed seed for the probe values, the perturbations, the output projection and the random
# layers (dropout): the probes' outcome depends neither on the private data nor on the global RNG.
_SEED = 0x5EED


def _map_tensors(obj, fn):
    """``obj`` (a tensor, or tuples/lists/dicts of them, as a model call takes) with ``fn`` applied to every tensor."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        items = [_map_tensors(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # namedtuples take fields
    if isinstance(obj, Mapping):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _tensors(obj) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(obj, lambda t: found.append(t) or t)
    return found


def _random_like(shape, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # Drawn on the CPU from our own generator, so the values are the same on every device.
    return torch.randn(tuple(shape), generator=generator).to(dtype=like.dtype, device=like.device)


def _probe_input(example_input, batch: int):
    """``batch`` rows: the given rows repeated along the first dimension, floating-point values replaced
    by seeded normals (the outcome must not depend on the private values), integer tensors (indices,
    masks) kept as they are."""
    generator = torch.Generator().manual_seed(_SEED)

    def rows(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        if t.shape[0] == 0:
            raise ValueError(f"the example input has a tensor of shape {tuple(t.shape)} without rows")
        t = t[torch.arange(batch, device=t.device) % t.shape[0]]
        return _random_like(t.shape, t, generator) if t.is_floating_point() else t

    return _map_tensors(example_input, rows)


def _perturbed(probe_input, row: int):
    """``probe_input`` with one example (``row``) changed: its floating-point values drawn afresh, its
    integer and boolean values (token ids, masks, lengths) replaced by the next example's, rolled by
    one along their last dimension: values of the input's own, so still valid indices and masks.
    Without the integer part a model using one example's tokens for all of them
    (``emb(ids[:1].expand(B, T))``) passed every probe; rolling the example's own row only kept the
    batch's multiset of tokens, so a model mixing examples through it
    (``emb(ids) / bincount(ids.flatten())[ids]``, a batch-wide frequency) passed."""
    generator = torch.Generator().manual_seed(_SEED + 1 + row)

    def change(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        t = t.clone()
        if t.is_floating_point():
            t[row] = _random_like(t.shape[1:], t, generator)
        elif t.dim() > 1:  # rolled too: a probe batch built from one row holds the same ids in every row
            t[row] = t[(row + 1) % t.shape[0]].roll(1, dims=-1)
        else:
            t[row] = t[(row + 1) % t.shape[0]]
        return t

    return _map_tensors(probe_input, change)


def _has_rows_to_perturb(probe_input) -> bool:
    return any(t.dim() > 0 and not torch.equal(t, _perturbed(t, 0)) for t in _tensors(probe_input))


def _smallest_batch(excluded: set[int]) -> int:
    batch = 3  # 1 and 2 rows hide too much: with 3, every example has two others to be compared with
    while batch in excluded:
        batch += 1
    return batch


# ------------------------------------------------------------------------------ one probe pass


def _trainable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers the engine clips that have a trainable parameter (``registry.trained_layer``). Not
    the generic units (:mod:`bpclip_fast.generic`) nor what is below them: their inputs and outputs
    are of any layout, their parameters reached by the unit's own code; probe 1's unit check
    (:func:`_unit_rows_problems`), the model-output check of probe 2 and the step's records cover them."""
    inside = {id(sub) for _, u in registry.generic_units(model, _SHARED_UNITS.get()) for sub in u.modules()}
    return [(name, m) for name, m in model.named_modules() if registry.trained_layer(m) and id(m) not in inside]


@dataclass
class _Call:
    """One call of a trainable layer: its input, and (after the backward) the gradient of its output."""
    name: str
    input: torch.Tensor | None
    grad: torch.Tensor | None = None
    # The call's other arguments (an EmbeddingBag's per_sample_weights), for probe 4's recomputation.
    extra: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass
class _UnitCall:
    """One call of a generic unit (:mod:`bpclip_fast.generic`): the example rows the path reads from
    its input (or why it reads none), ``[shape, batch dimension, got a gradient]`` of each output that
    requires a gradient, and every size of its tensors (the probe batch avoids them)."""
    name: str
    rows: int | None
    error: str | None
    sizes: set
    outputs: list = field(default_factory=list)


@dataclass
class _Pass:
    units: list[_UnitCall] = field(default_factory=list)     # generic-unit calls, in forward order
    calls: list[_Call] = field(default_factory=list)         # trainable-layer calls, in forward order
    counts: dict[str, int] = field(default_factory=dict)     # calls of every module owning trainable parameters
    outputs: list[torch.Tensor] = field(default_factory=list)  # the model output's floating-point tensors
    grads: dict[int, torch.Tensor | None] = field(default_factory=dict)  # id(parameter) -> its gradient
    expanded: list[str] = field(default_factory=list)  # layers whose one shared index row was expanded


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({t.device.index for t in list(model.parameters()) + list(model.buffers())
                   if t.device.type == "cuda" and t.device.index is not None})


def _seed(devices: list[int]) -> None:
    """Seeds the generators the model's random layers use, and only those (inside a fork_rng)."""
    torch.random.default_generator.manual_seed(_SEED)
    for d in devices:
        torch.cuda.default_generators[d].manual_seed(_SEED)


def _record(model: nn.Module, record: _Pass) -> list:
    """Hooks that fill ``record`` during a forward (and the backward after it); returns their handles."""
    layers = {id(m) for _, m in _trainable_layers(model)}
    handles = []
    for name, m in model.named_modules():
        if not registry.owns_trainable(m):
            continue
        is_layer = id(m) in layers

        def before(mod, args, kwargs, _name=name, _is_layer=is_layer):
            record.counts[_name] = record.counts.get(_name, 0) + 1
            if _is_layer:
                x = args[0] if args and isinstance(args[0], torch.Tensor) else None
                # A copy: later in-place operations must not change what probe 4 recomputes from.
                copied = _map_tensors((tuple(args[1:]), dict(kwargs)), lambda t: t.detach().clone())
                record.calls.append(_Call(_name, None if x is None else x.detach().clone(), None, *copied))

        def after(mod, args, out, _name=name):
            call = next(c for c in reversed(record.calls) if c.name == _name)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                # A tensor hook gets the gradient of the layer's own output even if a later in-place
                # operation (ReLU(inplace=True)) rewrites it; a module backward hook would refuse those.
                out.register_hook(lambda g, _call=call: setattr(_call, "grad", g.detach().clone()))

        handles.append(m.register_forward_pre_hook(before, with_kwargs=True))
        if is_layer and _shared_index_layer(m):
            # First of the pre-hooks: what is recorded is what the fused layer looks up in training.
            handles.append(m.register_forward_pre_hook(functools.partial(_expand_index, record, name), prepend=True))
        if is_layer:
            handles.append(m.register_forward_hook(after))
    for name, unit in registry.generic_units(model, _SHARED_UNITS.get()):
        handles += _unit_hooks(unit, name, record)
    return handles


def _shared_index_layer(m: nn.Module) -> bool:
    """A layer trained as the fused Embedding, which looks up an index of one row shared by the
    call's examples once per example (:mod:`bpclip_fast.broadcast`)."""
    kind = registry.layer_type(m)
    return kind is not None and kind.torch_type is nn.Embedding


def _expand_index(record: _Pass, name: str, mod, args):
    if args and isinstance(args[0], torch.Tensor):
        x = broadcast.expand(args[0])
        if x is not args[0]:
            record.expanded.append(name)
            return (x, *args[1:])
    return None


def _unit_hooks(unit: nn.Module, name: str, record: _Pass) -> list:
    """Hooks recording a generic unit's calls as the generic path reads them (its ``_rows`` and
    ``batch_dims``): probe 1 checks them, where the unit's own backward could not see a size that
    equals the batch by coincidence."""
    from . import generic  # imports bpclip_fast.nn, as the import at the top does
    from torch.utils import _pytree as pytree

    def before(mod, args, kwargs):
        flat = pytree.tree_leaves((args, kwargs))
        rows, error = None, None
        try:
            rows = generic._rows(mod, flat, (args, kwargs))
        except ValueError as exc:
            error = str(exc)
        sizes = {n for t in flat if isinstance(t, torch.Tensor) for n in t.shape}
        record.units.append(_UnitCall(name, rows, error, sizes))

    def after(mod, args, kwargs, out):
        call = next(c for c in reversed(record.units) if c.name == name)
        flat = pytree.tree_leaves(out)
        for o, d in zip(flat, generic.batch_dims(mod, flat)):
            if not isinstance(o, torch.Tensor):
                continue
            call.sizes |= set(o.shape)
            if o.requires_grad:
                entry = [tuple(o.shape), d, False]
                call.outputs.append(entry)
                o.register_hook(lambda g, _entry=entry: _entry.__setitem__(2, True))

    return [unit.register_forward_pre_hook(before, with_kwargs=True),
            unit.register_forward_hook(after, with_kwargs=True)]


def _parameter_gradients(model: nn.Module, outputs: list[torch.Tensor], batch: int) -> dict[int, torch.Tensor | None]:
    """The trainable layers' parameter gradients, by ``autograd.grad`` (no ``.grad`` is written), of a
    loss ``Σ r·y + y²/2`` over the outputs ``y``: ``r`` a fixed random projection (a plain sum could
    vanish: softmax rows sum to 1), the square so that the gradient depends on the outputs as a real
    loss's does (a linear loss would make the backward of a linear mixing step data-independent).
    The square only for outputs with one row per example: squaring an output that sums over the
    examples (a model that returns its mean loss) would itself couple them."""
    generator = torch.Generator().manual_seed(_SEED)
    terms = []
    for t in outputs:
        if t.requires_grad:
            per_example = t.dim() > 0 and t.shape[0] == batch
            terms.append(((_random_like(t.shape, t, generator) + (0.5 * t if per_example else 0)) * t).sum())
    params = list({id(p): p for _, m in _trainable_layers(model)
                   for p in m.parameters(recurse=False) if p.requires_grad}.values())
    # The generic units' parameters too: the backward must reach their outputs (probe 1 reads which
    # of them get a gradient).
    params += list({id(p): p for _, u in registry.generic_units(model, _SHARED_UNITS.get()) for p in u.parameters()
                    if p.requires_grad and id(p) not in {id(q) for q in params}}.values())
    if not terms or not params:
        return {}
    grads = torch.autograd.grad(sum(terms), params, allow_unused=True)
    # Dense: a refused Embedding(sparse=True) gives a sparse gradient, which the probes' arithmetic
    # (add(sparse, dense)) would raise on before its static refusal is reported.
    return {id(p): (g.to_dense() if g is not None and g.is_sparse else g) for p, g in zip(params, grads)}


def _call_rows(probe_input) -> int | None:
    """The examples of the call :func:`_call` makes, as the engine's hooks count them."""
    if isinstance(probe_input, (tuple, list)):
        return batches.call_rows(tuple(probe_input))
    if isinstance(probe_input, Mapping):
        return batches.call_rows((), dict(probe_input))
    return batches.call_rows((probe_input,))


def _run(model: nn.Module, probe_input, batch: int, devices: list[int], backward: bool = True,
         expand: bool = True) -> _Pass:
    """One forward (and, with ``backward``, one backward) of ``probe_input``, recorded; with
    ``expand``, an Embedding's index of one row shared by the examples is looked up per example, as
    in private training (:mod:`bpclip_fast.broadcast`)."""
    record = _Pass()
    handles = _record(model, record)
    try:
        _seed(devices)  # the same dropout masks in every pass, so that only the perturbation differs
        with torch.set_grad_enabled(backward), broadcast.pushed(_call_rows(probe_input) if expand else None):
            outputs = [t for t in _tensors(_call(model, probe_input)) if t.is_floating_point()]
        record.outputs = [t.detach() for t in outputs]
        if backward:
            record.grads = _parameter_gradients(model, outputs, batch)
    finally:
        for h in handles:
            h.remove()
    return record


def _probe_batch(example_input, run) -> int:
    """The probe's number of rows: >= 3, and unlike every other dimension of the input and, after a
    first pass, of every layer input, so that a layer whose first dimension is not the examples' (a
    [T, B, d] layout) cannot show B rows by coincidence."""
    excluded = {d for t in _tensors(example_input) for d in t.shape[1:]}
    candidate = _smallest_batch(excluded)
    first = run(_probe_input(example_input, candidate), candidate, backward=False, expand=False)
    excluded |= {d for c in first.calls if c.input is not None for d in c.input.shape}
    excluded |= {d for u in first.units for d in u.sizes}
    return _smallest_batch(excluded)


# --------------------------------------------------------------------------------- the probes


def _example_rows_problems(reference: _Pass, batch: int, labels: dict[str, str],
                           reported: set[str] = frozenset()) -> list[str]:
    """Probe 1: every trainable layer's input has the probe's examples as its first dimension (an
    Embedding's index of one shared row after its expansion, :mod:`bpclip_fast.broadcast`).
    ``reported``: layers whose expansion was refused already, with the same advice."""
    problems, reported = [], set(reported)
    for c in reference.calls:
        if c.input is None or c.name in reported or (c.input.dim() > 0 and c.input.shape[0] == batch):
            continue
        reported.add(c.name)
        first = c.input.shape[0] if c.input.dim() else "none"
        problems.append(
            f"{labels[c.name]}: its input has shape {tuple(c.input.shape)}, whose first dimension ({first}) is not "
            f"the {batch} examples of the probe batch (rule: example rows); the layer clips each row of its first "
            "dimension as one example, so an example spread over several rows gets the bound once per row (or one "
            "row holds several examples); keep the examples in the first dimension: a Linear takes [B, *, d] "
            "directly (no flatten(0, 1) of the batch), and sequences stay batch-first ([B, T, d], not [T, B, d])"
            + (_BROADCAST_HINT if first == 1 and c.input.dim() > 1 and not c.input.is_floating_point() else ""))
    return problems + _unit_rows_problems(reference, batch, labels)


def _unit_rows_problems(reference: _Pass, batch: int, labels: dict[str, str]) -> list[str]:
    """Probe 1 for the generic units: the path clips row ``i`` along each input's and output's batch
    dimension as example ``i`` (:func:`bpclip_fast.generic.batch_dims`); each must hold the probe's
    examples there. At training time a unit's backward sees only sizes, and a position or feature
    dimension equal to the batch size passes it."""
    problems, reported = [], set()
    advice = ("the generic exact path clips row i of the batch dimension (dimension 0; 1 for modules with "
              "batch_first=False and for a recurrent layer's final states) of the module's first tensor input and "
              "of every output as example i; keep the examples there (return [B, ...] outputs from a batch-first "
              "module; add a tensor without examples, such as a position table, to the examples' tensor inside "
              "the module rather than returning it)")
    for u in reference.units:
        if u.name in reported:
            continue
        if u.error is not None:
            why = u.error
        elif u.rows != batch:
            why = f"its input's batch dimension has {u.rows} rows, not the {batch} examples of the probe batch"
        else:
            bad = [(shape, d) for shape, d, got in u.outputs if got and (len(shape) <= d or shape[d] != batch)]
            if not bad:
                continue
            shape, d = bad[0]
            why = (f"its output of shape {shape} does not hold the {batch} examples of the probe batch in its batch "
                   f"dimension {d}")
        reported.add(u.name)
        problems.append(f"{labels[u.name]}: {why} (rule: example rows); {advice}")
    return problems


# An index tensor of one row in a batch of B that private training cannot look up per example
# (bpclip_fast.broadcast: the expansion refused by broadcast_probes, or the call's rows unknown):
# broadcast after the lookup, its gradient arrives summed over the examples.
_BROADCAST_HINT = ("; an index of one row broadcast over the batch (Hugging Face's position_ids [1, T]) must be "
                   "given per example: pass it expanded to the batch, e.g. model(input_ids, "
                   "position_ids=torch.arange(T).expand(B, T))")


# Probe 2 compares the other examples' values between two passes that differ in one example. Both
# passes run the same kernels on tensors of the same shapes (and the same dropout masks), and a
# GEMM or convolution computes each row from that row alone, so the other rows would be bitwise
# equal but for the summation order, which may depend on memory alignment (CPU BLAS) or on atomics
# (GPU backward): a difference of a few rounding errors of the tensor's largest entry. An example
# that really reaches another one moves it by a fraction 1/B of its scale (B is small here).
_ROW_TOLERANCE = 64  # in units of the dtype's machine epsilon, relative to the tensor's largest entry


def _rows_differ(a: torch.Tensor | None, b: torch.Tensor | None, changed_row: int, batch: int) -> bool:
    """Whether any row but ``changed_row`` of ``a`` and ``b`` differs beyond rounding."""
    if a is None or b is None:
        return (a is None) != (b is None)
    if a.shape != b.shape:
        return True
    if a.dim() == 0 or a.shape[0] != batch or a.numel() == 0:
        return False  # rows that are not examples: probe 1 reports the layer
    if not a.is_floating_point():
        a, b = a.long(), b.long()
    diff = (a - b).abs()
    diff[changed_row] = 0
    tolerance = _ROW_TOLERANCE * torch.finfo(a.dtype).eps * torch.maximum(a.abs().max(), b.abs().max()) \
        if a.is_floating_point() else 0
    return bool(diff.max() > tolerance)


def _mixing_problems(probe_input, reference: _Pass, batch: int, run, labels: dict[str, str]) -> list[str]:
    """Probe 2: changing one example (the first, then the last) changes nothing of the other examples."""
    found: dict[tuple[int, int], tuple[str, str]] = {}  # (call index, 0 input / 1 gradient) -> (layer, what)
    output_mixes = False
    for row in sorted({0, batch - 1}):
        changed = run(_perturbed(probe_input, row), batch)
        for index, (a, b) in enumerate(zip(reference.calls, changed.calls)):
            if a.name != b.name:  # another example decided which layers run
                found.setdefault((index, 0), (a.name, "input"))
                break
            if _rows_differ(a.input, b.input, row, batch):
                found.setdefault((index, 0), (a.name, "input"))
            if _rows_differ(a.grad, b.grad, row, batch):
                found.setdefault((index, 1), (a.name, "output gradient"))
        output_mixes |= len(reference.outputs) != len(changed.outputs) or any(
            _rows_differ(a, b, row, batch) for a, b in zip(reference.outputs, changed.outputs))
    advice = ("compute every statistic within one example (GroupNorm/LayerNorm instead of batch "
              "statistics, bpclip_fast.fix_model(model) swaps BatchNorm for GroupNorm; attention within a sequence, nothing like h - h.mean(0) over the batch)")
    if found:
        (name, what), *rest = [found[k] for k in sorted(found)]
        where = "before this layer" if what == "input" else "after this layer (the backward brings it back here)"
        also = list(dict.fromkeys(f"{labels[n]} {w}" for n, w in rest))
        more = f"; also affected: {', '.join(also[:4])}{', ...' if len(also) > 4 else ''}" if also else ""
        return [f"{labels[name]}: its {what} changed when another example of the probe batch changed (rule: batch "
                f"independence); examples mix {where}, so one example moves the other examples' clipped "
                f"contributions and the per-example bound no longer holds{more}; {advice}"]
    if output_mixes:
        return [f"{labels['']} (model output): an example's output changed when another example of the probe batch "
                "changed (rule: batch independence); examples mix after the last trainable layer, so a loss on "
                f"these outputs mixes examples' gradients; {advice}"]
    return []


def _buffer_snapshot(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor, torch.Tensor]]:
    return [(name, m, key, b, b.detach().clone()) for name, m in model.named_modules()
            for key, b in m._buffers.items() if b is not None]


def _restore_buffers(snapshot) -> None:
    with torch.no_grad():
        for _, m, key, b, saved in snapshot:
            m._buffers[key] = b  # the same tensor object, in case forward assigned a new one
            b.copy_(saved)


def _buffer_problems(snapshot, labels: dict[str, str]) -> list[str]:
    """Probe 3: no buffer changes in one training-mode forward (and backward)."""
    problems = []
    for name, m, key, _, saved in snapshot:
        now = m._buffers.get(key)
        if now is not None and now.shape == saved.shape and now.dtype == saved.dtype and torch.equal(now, saved):
            continue
        problems.append(
            f"{labels[name]}: buffer {name + '.' if name else ''}{key} changed in one training-mode forward pass "
            "(rule: buffers); it is updated from the data in forward and released (with the model or its "
            "state_dict) without noise; keep it constant during private training (compute it from public data, "
            "or update it only outside training mode) or drop it")
    return problems


def _own_gradients(layer: nn.Module, calls: list[_Call]):
    """``(own, scale, terms)``: the parameter gradients the layer computes from its own calls' inputs
    and output gradients; for each, a bound on the Frobenius norm of ``Σ|gradient|·|input|``
    (``√taps·‖g‖·‖x‖`` for the weight, taps the kernel positions; ``√rows·‖g‖`` for the bias); and
    the number of terms each entry sums (rows, or batch·positions, per call, plus one per call)."""
    names = [n for n in ("weight", "bias") if getattr(layer, n, None) is not None]
    own = {n: torch.zeros_like(getattr(layer, n)) for n in names}
    scale = dict.fromkeys(names, 0.0)
    kind = registry.layer_type(layer)
    taps = kind.taps(layer)
    terms = 0
    for c in calls:
        if c.input is None or c.grad is None:
            continue  # the output did not reach the loss: no gradient from this call
        with torch.enable_grad():
            leaves = {n: getattr(layer, n).detach().requires_grad_() for n in names}
            out = kind.plain(layer, c.input, leaves, *c.extra, **c.kwargs)
            grads = torch.autograd.grad((out * c.grad).sum(), list(leaves.values()), allow_unused=True)
        for n, gr in zip(names, grads):
            if gr is not None:
                own[n] += gr
        rows = c.grad.numel() // max(layer.weight.shape[0], 1)
        g_norm = float(c.grad.double().norm())
        x_norm = (kind.multiplier_norm(layer, c.input, *c.extra, **c.kwargs) if kind.multiplier_norm is not None
                  else float(c.input.double().norm()))
        scale["weight"] += math.sqrt(taps) * g_norm * x_norm
        if "bias" in scale:
            scale["bias"] += math.sqrt(rows) * g_norm
        terms += rows + 1
    return own, scale, terms


def _rounding(p: torch.Tensor) -> float:
    """The unit roundoff for ``p``'s gradients; on a GPU float32 GEMMs and convolutions may use TF32."""
    eps = torch.finfo(p.dtype).eps
    return max(eps, 2.0 ** -10) if p.device.type == "cuda" and p.dtype == torch.float32 else eps


def _ownership_problems(model: nn.Module, reference: _Pass, labels: dict[str, str]) -> list[str]:
    """Probe 4: each trainable layer's parameter gradient is exactly what it computes from its own calls.

    Both sides sum the same products ``gradient·input``, in possibly different orders: each entry is
    within ``terms·u·Σ|gradient|·|input|`` of the exact sum (recursive summation bound, u the unit
    roundoff), so their difference has a Frobenius norm below ``2·terms·u`` times the scale of
    ``_own_gradients`` (with a factor 2 of margin here). A use of the parameter elsewhere adds a
    contribution of the gradient's own size, orders of magnitude above that.
    """
    if not reference.grads:
        return []  # nothing reached the output with a gradient
    problems = []
    for name, layer in _trainable_layers(model):
        calls = [c for c in reference.calls if c.name == name]
        own, scale, terms = _own_gradients(layer, calls)
        foreign = []
        for pname, p in layer.named_parameters(recurse=False):
            if not p.requires_grad or pname not in own:
                continue
            total = reference.grads.get(id(p))
            total = torch.zeros_like(p) if total is None else total
            tolerance = 4 * (terms + 1) * _rounding(p) * scale[pname]
            if float((total - own[pname]).norm()) > tolerance:  # NaN (a model non-finite on the probe): no verdict
                foreign.append(f"{name + '.' if name else ''}{pname}")
        if foreign:
            problems.append(
                f"{labels[name]}: the gradient of {', '.join(foreign)} is not the layer's own (rule: gradient "
                "ownership): it differs from what the layer computes from its own inputs and output gradients, so "
                "the parameter is also used outside this layer's forward (in plain code such as "
                "F.linear(h, enc.weight.t()), by another module, or by a second layer sharing it), and that use "
                "would be released without clipping; give each use its own layer with its own parameters "
                "(untie the weights)")
    return problems


# ------------------------------------------------------------------------------ isolation


_MISSING = object()


@contextlib.contextmanager
def _isolated(model: nn.Module):
    """The model the probes may change: a deep copy (tied parameters stay tied in it); if the model
    cannot be copied, the model itself, with its training modes, buffers and ``.grad`` restored after."""
    try:
        work = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - an attribute that cannot be copied (a lock, a file, a C object)
        work = None
    if work is not None:
        yield work
        return
    modes = [(m, m.training) for m in model.modules()]
    buffers = _buffer_snapshot(model)
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training
        _restore_buffers(buffers)
        for p, g in grads:
            p.grad = g


@contextlib.contextmanager
def _unpacked(work: nn.Module, model: nn.Module):
    """The probes see what training runs: every composite (``registry.Composite``, an
    ``nn.MultiheadAttention``) unpacked into the registered layers that train it, as ``convert_model``
    does; packed back after where ``work`` is the model itself (it could not be copied)."""
    done = [(m, e) for _, m, e in registry.composites(work, _SHARED_UNITS.get())]
    for m, e in done:
        e.unpack(m)
    try:
        yield
    finally:
        if work is model:
            for m, e in reversed(done):
                e.pack(m)


@contextlib.contextmanager
def _as_torch_layers(model: nn.Module):
    """Our layers clip in their backward (and may draw a step's noise), so their parameter gradient is
    not the plain one probe 4 recomputes: the probes run their torch base class's forward instead."""
    patched = []
    for m in model.modules():
        if registry.is_clipped(m):
            base = type(m)._bp_base if registry.is_generic(m) else registry.layer_type(m).torch_type
            patched.append((m, m.__dict__.get("forward", _MISSING)))
            m.forward = types.MethodType(base.forward, m)
    try:
        yield
    finally:
        for m, previous in patched:
            if previous is _MISSING:
                del m.forward
            else:
                m.forward = previous


# ------------------------------------------------------------------------------ entry points


# Whether the probes treat the closest common ancestor of modules sharing a trainable parameter as one
# generic unit (the exact modes train it so; registry.generic_units), set by dynamic_problems.
_SHARED_UNITS: contextvars.ContextVar = contextvars.ContextVar("bpclip_shared_units", default=False)


def dynamic_problems(model: nn.Module, example_input, clipping: str | None = None) -> list[str]:
    """Problems found by running the model on a probe batch built from ``example_input`` (a tensor, or a
    tuple/list/dict of tensors as the model takes them; its first dimension is the examples'): rules
    *example rows*, *batch independence* (skipped when the input has no floating-point tensor),
    *buffers*, *gradient ownership* and *reuse*; see the module docstring.

    The model, its parameters, ``.grad``, buffers, training modes and the global random number
    generators are left as they were. Modules reported by :func:`static_problems` for batch
    statistics (BatchNorm, InstanceNorm with running statistics) run in eval mode here, so each
    problem is reported once. Raises whatever the model raises on the probe batch. ``clipping``: an
    exact mode trains modules that share a trainable parameter as one generic unit (their common
    ancestor), which the per-layer rules then skip; otherwise the sharing is reported.
    """
    if example_input is None:
        raise ValueError("dynamic_problems: needs an example input (one batch as the model takes it)")
    from .modes import EXACT

    token = _SHARED_UNITS.set(clipping in EXACT)
    try:
        with _isolated(model) as work, _unpacked(work, model), _as_torch_layers(work), \
                torch.random.fork_rng(devices=_cuda_devices(work)):
            return _probe(work, example_input)
    finally:
        _SHARED_UNITS.reset(token)


def _probe(model: nn.Module, example_input) -> list[str]:
    labels = {name: registry.label(name, m, model) for name, m in model.named_modules()}
    model.train()  # private training runs in training mode: dropout active, buffers updated
    for m in model.modules():
        if registry.mixes_batch(m):
            m.eval()  # already a static problem; in eval mode it neither mixes examples nor updates buffers
    buffers = _buffer_snapshot(model)
    devices = _cuda_devices(model)

    expanding = [True]  # whether the passes expand a shared index row, unless a pass says (broadcast_probes)

    def run(probe_input, batch: int, backward: bool = True, expand: bool | None = None) -> _Pass:
        _restore_buffers(buffers)  # every pass starts from the same buffers (an EMA used in forward)
        return _run(model, probe_input, batch, devices, backward, expanding[0] if expand is None else expand)

    batch = _probe_batch(example_input, run)
    probe_input = _probe_input(example_input, batch)
    shared = {name for name, m in _trainable_layers(model) if _shared_index_layer(m)}
    problems, refused = broadcast_probes.equivalence_problems(model, probe_input, batch, run, labels, shared)
    expanding[0] = not refused  # a refused expansion is reported once; the other probes see the model as today
    reference = run(probe_input, batch)
    buffer_problems = _buffer_problems(buffers, labels)  # before the next pass restores them
    problems += _example_rows_problems(reference, batch, labels, refused)
    problems += broadcast_probes.row_problems(model, probe_input, reference, batch, run, labels)
    if _has_rows_to_perturb(probe_input):
        problems += _mixing_problems(probe_input, reference, batch, run, labels)
    problems += buffer_problems
    problems += _ownership_problems(model, reference, labels)
    problems += _reuse_problems(reference.counts, model)
    return problems


def validate(model: nn.Module, example_input=None, clipping: str | None = None) -> list[str]:
    """Static problems (for ``clipping``, if given), plus (with ``example_input``) the problems the
    probes find (module docstring)."""
    problems = static_problems(model, clipping)
    if example_input is not None:
        problems += dynamic_problems(model, example_input, clipping)
    return problems


# ------------------------------------------------------------------------------ fix_model


def _group_norm_for(bn: nn.modules.batchnorm._BatchNorm) -> nn.GroupNorm:
    """The GroupNorm replacing ``bn`` (:func:`fix_model`), its affine parameters copied."""
    if isinstance(bn, nn.modules.lazy.LazyModuleMixin) and bn.has_uninitialized_params():
        raise ValueError(f"fix_model: {type(bn).__name__} has not seen an input yet, so its number of channels is "
                         "unknown; run one forward pass before fix_model")
    channels = bn.num_features
    # A BatchNorm1d may see [B, C] feature vectors, where a group of a few channels would normalise a
    # handful of numbers (one channel: its output is its bias alone); one group normalises them all.
    groups = 1 if isinstance(bn, nn.BatchNorm1d) else group_count(channels, 32)
    like = bn.weight if bn.affine else bn.running_mean
    kw = {} if like is None else {"device": like.device, "dtype": like.dtype}
    gn = nn.GroupNorm(groups, channels, eps=bn.eps, affine=bn.affine, **kw)
    if bn.affine:
        with torch.no_grad():
            gn.weight.copy_(bn.weight)
            gn.bias.copy_(bn.bias)
        gn.weight.requires_grad_(bn.weight.requires_grad)
        gn.bias.requires_grad_(bn.bias.requires_grad)
    gn.train(bn.training)
    return gn


def fix_model(model: nn.Module) -> nn.Module:
    """Replaces every BatchNorm of ``model`` (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, lazy ones once
    initialised: every ``nn.modules.batchnorm._BatchNorm``) by an ``nn.GroupNorm``, in place; returns
    ``model`` (a bare BatchNorm: its replacement).

    BatchNorm normalises each example with statistics of the batch, so one example moves the others
    (:mod:`bpclip_fast.registry` refuses it); GroupNorm's statistics are each example's own. The
    replacement has the BatchNorm's ``num_features``, ``eps`` and ``affine``, its weight and bias
    (values and ``requires_grad``), device, dtype and training mode; the running statistics are
    dropped. Groups: the largest divisor of the channels that is at most 32 (64 channels -> 32, 48 ->
    24), except for ``BatchNorm1d``, which becomes ``GroupNorm(1, C)``: it may normalise ``[B, C]``
    feature vectors, where a group of few channels would normalise a handful of numbers. A module
    shared by two parents is replaced by one GroupNorm. A model that learnt with BatchNorm computes
    other functions afterwards: train (or fine-tune) it after fixing.

    Warns (``UserWarning``) with one line per replaced module, ``name: BatchNorm2d(64) ->
    GroupNorm(32, 64)``; silent when there is nothing to replace.
    """
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        gn = _group_norm_for(model)
        warnings.warn(f"fix_model: replaced {type(model).__name__}({model.num_features}) by "
                      f"GroupNorm({gn.num_groups}, {gn.num_channels})", stacklevel=2)
        return gn
    replaced: dict[int, nn.GroupNorm] = {}
    changes = []
    for parent_name, parent in list(model.named_modules()):
        # _modules, not named_children(): that yields a module held twice by one parent only once
        for child_name, child in list(parent._modules.items()):
            if not isinstance(child, nn.modules.batchnorm._BatchNorm):
                continue
            if id(child) not in replaced:
                replaced[id(child)] = _group_norm_for(child)
                gn = replaced[id(child)]
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                changes.append(f"{name}: {type(child).__name__}({child.num_features}) -> "
                               f"GroupNorm({gn.num_groups}, {gn.num_channels})")
            setattr(parent, child_name, replaced[id(child)])
    if changes:
        warnings.warn(f"fix_model: replaced {len(changes)} BatchNorm layer{'s' if len(changes) > 1 else ''} by "
                      "GroupNorm (statistics within each example; train the model after this):\n  "
                      + "\n  ".join(changes), stacklevel=2)
    return model
