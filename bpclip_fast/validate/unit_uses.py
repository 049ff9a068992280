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

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .. import registry


class OutsideUses(TorchFunctionMode):
    """Pushed for one probe pass (``remove`` pops it): ``found`` collects the qualified names of the
    units' parameters that a call made outside their unit's forward differentiates through (an
    output that requires a gradient). Calls inside a backward pass (activation checkpointing's
    recomputation) are the forward's again and not looked at."""

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
        if self.owner and torch._C._current_graph_task_id() == -1:
            used = [self.owner[id(a)] for a in pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor) and id(a) in self.owner]
            if used and any(isinstance(o, torch.Tensor) and o.requires_grad for o in pytree.tree_leaves(out)):
                self.found.update((uname, name) for unit, uname, name in used if not self.running.get(unit))
        return out


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
