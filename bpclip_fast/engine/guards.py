"""The checks that run while a step is being computed, before anything reaches ``step()``: no
trainable parameter outside the clipped layers (before every grad-enabled forward and at every
backward pass), the budget and the batch count once per backward pass, and ``zero_grad``'s fresh
start for the layers it cleared."""

from __future__ import annotations

import sys
import weakref

import torch

from .. import handles
from ..graph_nodes import untraced
from . import budget, refusal
from .distributed import refuse_data_parallel
from ._common import accounting


def _no_check(*_):
    return None


def _no_check_factory():
    return _no_check


class OutsideCheck:
    """The model's forward pre-hook calling :func:`check_outside`. It holds the engine weakly and
    pickles as a no-op, so that ``torch.save(model)`` never carries the engine (its seed)."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)

    def __call__(self, module, args):
        engine = self._engine()
        if engine is not None:
            if module.__dict__.get("_is_replica"):  # nn.DataParallel around the private model: before any work
                raise RuntimeError(refuse_data_parallel("the private model runs as a replica of nn.DataParallel"))
            if torch.compiler.is_compiling():  # at run time, on every call (outside_at_run_time)
                if not torch.is_grad_enabled():
                    return
                traced_for = trainable_flags(engine)  # constants of the graph: what it was traced for
                if _EFFECTFUL:
                    torch.ops.bpclip_fast_compiled.check_outside(engine._handle, traced_for)
                else:  # a torch without effectful ops: a graph break, checked eagerly
                    _check_outside_eagerly(engine, traced_for)
                return
            check_outside(engine)

    def __reduce__(self):
        return (_no_check_factory, ())


def owned_ids(engine) -> set:
    return {id(p) for st in engine._steps_of for p in st.params}


def any_outside(module, owned: set, trainable: bool) -> bool:
    """Whether a parameter of ``module`` or its submodules that is not in ``owned`` trains
    (``trainable``) or holds a gradient (else). Walked afresh at every call: a module or parameter
    registered, replaced or removed since (also by a direct ``_parameters``/``_modules`` write, which
    no registration hook sees) is seen. Without the dotted names (``named_parameters`` cost a ViT step
    ~0.4 ms per call; a name is needed only for a refusal, :func:`outside_params`) and without a
    parameter list (the test is made during the walk, which stops at the first hit): asked three
    times a step (the model's forward, the first backward pass, ``step()``)."""
    modules, seen = [module], {id(module)}
    for m in modules:  # grows while iterated: each module once, breadth-first
        for p in m._parameters.values():
            if p is not None and (p.requires_grad if trainable else p.grad is not None) and id(p) not in owned:
                return True
        for c in m._modules.values():
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                modules.append(c)
    return False


def outside_params(engine):
    """``(name, parameter)`` of the model's parameters that no clipped layer of this engine owns, as
    the model is now (a layer added or replaced after make_private is outside), for the messages."""
    owned = owned_ids(engine)
    return [(name, p) for name, p in engine._inner.named_parameters() if id(p) not in owned]


def check_outside(engine, in_backward=False) -> None:
    """No parameter outside the clipped layers may be trainable (one unfrozen after make_private,
    maybe with an optimizer of its own, would be trained on raw gradients). Checked before every
    grad-enabled forward of the model (so no such gradient is computed) and at every backward
    pass of a clipped layer (a forward that bypassed the model's hook); such gradients are
    discarded."""
    if in_backward or torch.is_grad_enabled():
        _check_outside(engine)


def _check_outside(engine) -> None:
    if not any_outside(engine._inner, owned_ids(engine), trainable=True):
        return
    outside = outside_params(engine)
    bad = [name for name, p in outside if p.requires_grad]
    if bad:
        for _, p in outside:
            p.grad = None
        budget.require(engine, "the forward of the private model")
        refusal.refuse(engine, [("unclipped-param", f"{', '.join(bad)} is trainable but not a clipped layer of this "
                                 "engine (unfrozen, added or replaced after make_private)", bad)])


def trainable_flags(engine) -> list:
    """Whether each parameter of the engine's clipped layers trains, in the engine's layer order."""
    return [p.requires_grad for st in engine._steps_of for p in st.params]


def _check_traced_for(engine, traced_for) -> None:
    """A compiled forward runs only with the clipped parameters' ``requires_grad`` it was traced for.
    Its layers chose at trace time which of them get a gradient (and flat clipping, which the
    collector releases), and dynamo re-traces on a change only where it guards ``requires_grad``:
    torch 2.11's ``skip_tensor_guards_with_matching_dict_tags`` skips those guards (review 28), and a
    stale graph refused every later step of a loop that froze a layer (charged) or never trained
    one it unfroze (:func:`bpclip_fast.compiled.require_parameter_guards` turns that setting off at
    ``make_private``; this check catches any other gap). Raised before the forward computes anything,
    uncharged: it depends on the loop, not the data."""
    if list(traced_for) != trainable_flags(engine):
        raise RuntimeError(
            "bpclip_fast: a clipped layer's parameters were frozen or unfrozen after this compiled graph was "
            "traced, and torch did not re-trace it (its guards skip requires_grad); set "
            "torch._dynamo.config.skip_tensor_guards_with_matching_dict_tags = False before compiling, or "
            "call torch._dynamo.reset() after changing requires_grad; then run the forward again on the same batch (a "
            "new batch before a step is refused as another batch)")


@torch.library.custom_op("bpclip_fast_compiled::check_outside", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def outside_at_run_time(engine: int, traced_for: list[bool]) -> None:
    """:func:`check_outside` inside a compiled forward, when it runs: the engine's pre-hook, traced,
    calls this op (``engine``: the engine's handle) in grad-enabled graphs. Traced into guards instead,
    the check ran again only when a guard failed, and dynamo does not always guard the parameters'
    ``requires_grad`` (torch 2.11's recursive dict-tag guards skip them: a layer unfrozen after compiling
    was not refused at the forward, and with a graph break before it its raw gradient was accumulated
    before a clipped layer's backward refused, review 25). Registered as an ordered effect, so that
    AOTAutograd keeps it, returning nothing, and runs it before what follows it; tagged
    ``cudagraph_unsafe``, so that a CUDA graph replay never skips it. ``traced_for``: the clipped
    parameters' ``requires_grad`` when the graph was traced (:func:`_check_traced_for`)."""
    found = handles.get(engine)
    if found is not None:
        _check_traced_for(found, traced_for)
        _check_outside(found)


@outside_at_run_time.register_fake
def _(engine, traced_for):
    return None


# Without an effect, AOTAutograd would drop an op whose result nothing reads.
_EFFECTFUL = hasattr(torch.library, "_register_effectful_op")
if _EFFECTFUL:
    torch.library._register_effectful_op(torch.ops.bpclip_fast_compiled.check_outside.default,
                                         torch.library.EffectType.ORDERED)


@untraced
def _check_outside_eagerly(engine, traced_for) -> None:
    _check_traced_for(engine, traced_for)
    _check_outside(engine)


def batch_rows(engine) -> int:
    """The layers' ``batch_rows``: the rows of the batch drawn for the step."""
    return engine._counter.last_rows


def check_new_pass(engine) -> None:
    """Before a backward pass adds to the step: budget left for the charge of any refusal in the
    pass (first; after the budget, a backward would only make gradients nothing may release), no
    trainable parameter outside the clipped layers, at most one batch drawn since the last step
    (a loop that never calls the private step(), or draws a second batch, stops here, charged).
    Once per backward pass, not per layer."""
    task = torch._C._current_graph_task_id()
    gate = engine._pass_gate  # shared with the layers (boundary.PassGate): they skip this call once it is set
    if task == gate.task:
        return
    gate.task = task
    gate.passes += 1
    if not budget.covers(engine):  # first: everything below may be charged
        refusal.discard(engine, engine.optimizer.original_optimizer)
        raise accounting().PrivacyBudgetError(
            f"backward refused: any further step would exceed max_epsilon={engine.max_epsilon:g} at "
            f"δ={engine.delta:g}; the budget is spent, so no gradient of private data is computed any more")
    if _compiled_autograd_on():
        _refuse_compiled_autograd(engine)
    check_outside(engine, in_backward=True)
    drawn = budget.drawn(engine)
    if drawn == 0:
        # Before anything of the pass is computed: its noised gradient would be readable in .grad,
        # and with no batch drawn no step() could charge it (a step refuses it uncharged), so passes
        # over data already used (the last step's batch) would be free releases, each with a fresh
        # draw. Not charged: whether a batch was drawn depends on the loop only.
        refusal.discard(engine, engine.optimizer.original_optimizer)
        raise RuntimeError(
            "backward refused: no batch was drawn from the private data loader since the last step (or refused "
            "step); every backward pass of private parameters must belong to the step of a batch drawn for it "
            "(its noised gradient is released to .grad and charged at that step). Draw the next batch from the "
            "private loader first; evaluate without gradients (torch.no_grad()). Not charged.")
    if drawn > 1:
        refusal.refuse(engine, [("batches", f"{drawn} batches were drawn from the private loader since the last step "
                                 "and a backward pass was run", [])])


def _compiled_autograd_on() -> bool:
    """Whether this backward runs under compiled autograd (``torch._dynamo.compiled_autograd``, on by
    ``torch._dynamo.config.compiled_autograd`` or its context manager; never imported otherwise)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(getattr(ca, "compiled_autograd_enabled", False)
                                   or getattr(ca, "in_compiled_autograd_region", False))


def _refuse_compiled_autograd(engine) -> None:
    """Compiled autograd traces the backward into a graph that our records cannot follow: the pass
    was refused at ``step()`` as an edited gradient and charged (review 21, F4), whatever the data.
    Refused now, before the pass computes anything; charged where an earlier pass of the step ran
    (its gradients could have been read, and cleared since). Otherwise nothing of the data was
    computed in this step (gradients held from an earlier step were charged by it: review 24, F1),
    and whether compiled autograd is on depends on the loop alone."""
    earlier = engine._pass_gate.passes > 1
    refusal.refuse(engine, [("grad-edit", "backward refused: compiled autograd (torch._dynamo.compiled_autograd, "
                             "or torch._dynamo.config.compiled_autograd = True) runs the private layers' backward "
                             "where the step's records cannot verify the gradients it leaves; turn it off for the "
                             "private model's backward (torch.compile of the model itself is supported)", [])],
                   charged=earlier)


def after_zero_grad(engine) -> None:
    """``zero_grad`` through the private optimizer: every layer whose gradients it cleared starts
    afresh (its draw is added again by its next backward); no device check is needed for them."""
    for st in engine._steps_of:  # only what is None now: zeroed or untouched gradients are checked as usual
        trains = False
        for p in st.params:  # a plain loop: two generators per layer were most of this function's time
            if p.grad is not None:
                break
            trains = trains or p.requires_grad
        else:
            if trains:
                st.cleared()
