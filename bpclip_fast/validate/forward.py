"""How the probes call a model, and :func:`probe`, the forward the engine runs on one example.

Apart from the probe batch's passes because the engine runs this one on the model itself (not a
copy), without gradients, at every make_private: it restores buffers and random number generators
on its own. Rule *reuse* lives here, shared with probe 5 of the dynamic probes.
"""

from __future__ import annotations

from collections.abc import Mapping

import contextlib

import torch
from torch import nn

from .. import registry


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


class _InsideForward:
    """Marks ``running[id(unit)]`` while the unit's own ``forward`` runs, by an instance attribute
    ``forward`` that wraps it (what ``Module.__call__`` calls, inside every hook); ``remove`` puts
    back what was there."""

    def __init__(self, unit: nn.Module, running: dict):
        self.unit, self.saved = unit, unit.__dict__.get("forward", _MISSING)
        inner = unit.forward  # the module's own (bound method, or the instance attribute already set)
        key = id(unit)

        def forward(*args, **kwargs):
            running[key] = running.get(key, 0) + 1
            try:
                return inner(*args, **kwargs)
            finally:
                running[key] -= 1

        unit.__dict__["forward"] = forward

    def remove(self) -> None:
        restore_forward(self.unit, self.saved)


_MISSING = object()


def restore_forward(module: nn.Module, saved) -> None:
    """Puts back the instance attribute ``forward`` a probe replaced (``saved``: what
    ``module.__dict__.get("forward", _MISSING)`` held before)."""
    if saved is _MISSING:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = saved


def count_hooks(model: nn.Module, counts: dict[str, int], units: list, running: dict | None = None) -> list:
    """Hooks that count into ``counts`` the calls of every module owning trainable parameters (rule
    *reuse*); returns their handles. The calls a module inside a generic unit (``units``: the mode's
    ``[(name, unit)]``, :func:`registry.generic_units`) gets while that unit's forward runs count once
    together: the unit's per-example gradient is taken over its whole forward, a child it calls twice
    one term of it (review 33 F2). "While" is while the unit's own ``forward`` runs (:class:`_InsideForward`),
    what training reparametrises: its calls from anywhere else (the unit's own hooks, global module
    hooks, review 35 F1) count each, and so does each call of the unit, whether or not it holds a
    parameter itself. Calls made inside a backward pass count too (a unit run again by a custom
    Function's backward is reused, review 36 F2), so the dynamic probes refuse activation
    checkpointing's recomputation as reuse (uncharged; flat cannot train it at all, review 36 F1)."""
    unit_of = {id(sub): id(u) for _, u in units for sub in u.modules() if sub is not u}
    running = {} if running is None else running  # id(unit) -> its forward's depth (OutsideUses reads it)
    inside: set[str] = set()
    handles = [_InsideForward(u, running) for _, u in units]
    unit_ids = {id(u) for _, u in units}
    for name, m in model.named_modules():
        if not registry.owns_trainable(m) and id(m) not in unit_ids:  # a unit of shared weights owns none itself
            continue

        def count(mod, args, _name=name, _unit=unit_of.get(id(m))):
            if _unit is not None and running.get(_unit):
                if _name in inside:
                    return
                inside.add(_name)
            counts[_name] = counts.get(_name, 0) + 1

        handles.append(m.register_forward_pre_hook(count))
    return handles


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


def probe(model: nn.Module, example_input, shared: bool = False) -> tuple[list[str], dict[str, tuple]]:
    """One forward pass of ``example_input``: (problems: modules with trainable parameters called more
    than once (``shared``: the exact modes' generic units, :func:`count_hooks`),
    {qualified name: input shape} of every clipped layer)."""
    calls: dict[str, int] = {}
    shapes: dict[str, tuple] = {}
    handles = count_hooks(model, calls, registry.generic_units(model, shared))
    for name, m in model.named_modules():
        if not registry.owns_trainable(m):
            continue

        def hook(mod, args, _name=name):
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


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({t.device.index for t in list(model.parameters()) + list(model.buffers())
                   if t.device.type == "cuda" and t.device.index is not None})
