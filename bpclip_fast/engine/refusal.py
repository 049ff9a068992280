"""A refused step (module docstring of :mod:`bpclip_fast.boundary`): every gradient discarded and
draw ``t`` re-armed, so nothing was released; charged unless the refusal cannot depend on the data."""

from __future__ import annotations

from ..boundary import StepRefused
from . import budget


def discard(engine, optimizer) -> None:
    """Drops every gradient the optimizer could apply and every layer's records of this step, and
    re-arms the layers with draw ``t``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
    for st in engine._steps_of:
        st.discard()
    engine._delivered_at_step = engine._counter.delivered
    engine._arm()


def refuse(engine, problems, charged=True):
    """Discards the step's gradients, charges it (see ``bpclip_fast.boundary``) and raises. Every
    batch drawn since the last step may have been used, so each is charged (shuffled: ``budget.charge``
    follows t). Callers have checked that the budget covers it (``budget.covers``)."""
    if charged:
        for _ in range(max(1, budget.drawn(engine)) if engine.poisson_sampling else 1):
            budget.charge(engine)
    discard(engine, engine.optimizer.original_optimizer)
    rule = problems[0][0]
    details = "; ".join(d for _, d, _ in problems)
    names = list(dict.fromkeys(n for _, _, ns in problems for n in ns))
    raise StepRefused(rule, details, names, charged=charged)


def refuse_in_forward(engine, rule, details, names):
    """The layers' ``on_refuse``: a refusal raised inside a forward or backward of one layer."""
    refuse(engine, [(rule, details, names)])
