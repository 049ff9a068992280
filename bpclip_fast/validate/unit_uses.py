"""Rule *gradient ownership* for the generic units: a unit clips its parameters' gradient over its
own forward only, so a parameter of a unit used anywhere else (``F.linear(h, u.inner.weight)``, a
tied head, ``u.inner.forward(h)`` called from outside, a hook that computes with it) gets a
gradient from outside the unit, which every step would refuse (charged) once training starts
(review 35 F4). Probe 4 (``probes._ownership_problems``) recomputes the fused layers' gradients
from their calls; a unit's forward is any code, so here each use is watched instead: during a
probe pass, a torch function mode records every differentiable call that takes a unit's parameter
while that unit's own forward method is not running (``forward._InsideForward`` marks it).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .. import registry


class OutsideUses(TorchFunctionMode):
    """Pushed for one probe pass (``remove`` pops it): ``found`` collects ``(unit, parameter)`` for
    each unit's parameter that a call made outside its unit's forward differentiates itself (the
    nodes the call made reach the parameter's ``AccumulateGrad``: :func:`_leaves_reached`) and whose
    output then receives a gradient in the pass's backward (a hook on it). So ``h.type_as(w)``, ``h.to(w)`` (no
    gradient to ``w``), a logged ``w.norm().item()`` or ``w.T.shape`` (nothing reaches the loss)
    are not uses (review 36 F5). Not looked at: calls inside a backward pass (they are the reuse
    rule's), and a traced region (under ``torch.compile`` dynamo would trace this mode; review 36 F3):
    there such a use is refused at the first step, charged."""

    def __init__(self, model: nn.Module, units: list, running: dict, found: set):
        super().__init__()
        self.running, self.found = running, found
        self.owner = {}  # id(parameter) -> (id(unit), the unit's name, the parameter's qualified name)
        for uname, u in units:
            for pname, p in u.named_parameters():
                if p.requires_grad:
                    self.owner.setdefault(id(p), (id(u), uname, f"{uname}.{pname}" if uname else pname))
        self.__enter__()

    def remove(self) -> None:
        self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.compiler.is_compiling() or not self.owner or torch._C._current_graph_task_id() != -1:
            return out
        used = {id(a): self.owner[id(a)] for a in pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor) and id(a) in self.owner}
        used = {k: v for k, v in used.items() if not self.running.get(v[0])}
        if used:
            before = {a.grad_fn for a in pytree.tree_leaves((args, kwargs))
                      if isinstance(a, torch.Tensor) and a.grad_fn is not None}
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and o.grad_fn is not None:
                    direct = [used[k] for k in _leaves_reached(o.grad_fn, before) if k in used]
                    if direct:
                        o.register_hook(functools.partial(self._landed, direct))
        return out

    def _landed(self, uses, grad):
        self.found.update((uname, name) for _, uname, name in uses)


def _leaves_reached(node, before: set) -> set:
    """``id`` of each leaf tensor whose ``AccumulateGrad`` the graph from ``node`` reaches through the
    nodes one call made: the walk stops at the graphs its arguments came with (``before``), so a
    parameter used by the unit earlier (``h = unit(x); h.type_as(unit.w)``) is not reached through
    ``h``."""
    reached, seen, stack = set(), set(), [node]
    while stack:
        n = stack.pop()
        if n is None or n in seen or n in before:
            continue
        seen.add(n)
        variable = getattr(n, "variable", None)
        if variable is not None:
            reached.add(id(variable))
            continue
        stack.extend(child for child, _ in n.next_functions)
    return reached


def outside_use_problems(model: nn.Module, found: set) -> list[str]:
    """The problem of each unit whose parameters ``found`` (``{(unit name, parameter name)}``) names
    (rule *gradient ownership*)."""
    problems = []
    modules = dict(model.named_modules())
    for uname in sorted({u for u, _ in found}):
        u = modules[uname]
        names = sorted(n for un, n in found if un == uname)
        if names:
            problems.append(
                f"{registry.label(uname, u, model)}: {', '.join(names)} "
                f"{'is' if len(names) == 1 else 'are'} used outside this generic unit's forward (rule: gradient "
                "ownership: in plain code such as F.linear(h, unit.inner.weight), a call of a submodule from "
                "outside the unit, or a hook); the unit clips its parameters' gradient over its own forward only, "
                "so that use would reach the gradient unclipped and every step would be refused; use the "
                "parameter inside the unit's forward only, or give the other use its own parameter")
    return problems
