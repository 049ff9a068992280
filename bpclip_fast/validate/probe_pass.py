"""One probe pass: a forward (and backward) of the probe batch, recorded by hooks.

Every probe compares the records of passes; one recorder means they all see the same calls, the same
dropout masks and the same loss, so a difference between two passes is the perturbation's alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import contextvars
import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import batches, broadcast, registry
from .forward import _call, count_hooks
from .unit_uses import OutsideUses
from .probe_input import _SEED, _map_tensors, _random_like, _tensors


# Whether the probes treat the closest common ancestor of modules sharing a trainable parameter as one
# generic unit (the exact modes train it so; registry.generic_units), set by dynamic_problems.
_SHARED_UNITS: contextvars.ContextVar = contextvars.ContextVar("bpclip_shared_units", default=False)


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
    outside: set = field(default_factory=set)  # (unit, parameter) used outside the unit's forward (unit_uses)


def _seed(devices: list[int]) -> None:
    """Seeds the generators the model's random layers use, and only those (inside a fork_rng)."""
    torch.random.default_generator.manual_seed(_SEED)
    for d in devices:
        torch.cuda.default_generators[d].manual_seed(_SEED)


def _record(model: nn.Module, record: _Pass) -> list:
    """Hooks that fill ``record`` during a forward (and the backward after it); returns their handles."""
    layers = {id(m) for _, m in _trainable_layers(model)}
    units = registry.generic_units(model, _SHARED_UNITS.get())
    running: dict[int, int] = {}
    handles = count_hooks(model, record.counts, units, running)
    for name, m in model.named_modules():
        if not registry.owns_trainable(m):
            continue
        is_layer = id(m) in layers

        def before(mod, args, kwargs, _name=name, _is_layer=is_layer):
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
    for name, unit in units:
        handles += _unit_hooks(unit, name, record)
    if _SHARED_UNITS.get():  # last: a torch function mode pushed here is popped by _run's removal of the handles
        handles.append(OutsideUses(model, units, running, record.outside))
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
    from .. import generic  # imports bpclip_fast.nn, as the package's __init__ does
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
        for h in reversed(handles):  # last in, first out: the torch function mode first
            h.remove()
    return record
