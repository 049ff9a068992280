"""Declared accumulation, the engine's half: ``with optimizer.accumulate():`` around the micro-batches
of one step. The layers keep what each pass computes for their parameters and hand autograd zeros
until the block ends (:mod:`bpclip_fast.held_grads`, where the argument is), so the loop reads the
step's gradient once, after all its passes, as if it were one backward over the batch."""

from __future__ import annotations

import contextlib


class Holder:
    """Whether the loop is inside the block, shared by the engine's layers (``LayerStep.holder``)."""

    __slots__ = ("active",)

    def __init__(self):
        self.active = False


@contextlib.contextmanager
def accumulating(engine):
    """The block: the layers hold their passes' gradients inside it and release them at its end (also
    when it ends by an exception: a refused step has dropped them already). Refused under DDP, whose
    reducer would average the zeros the passes return while each rank kept its own sum."""
    if engine.distributed:
        raise RuntimeError("optimizer.accumulate() is not supported under DistributedDataParallel yet: take one "
                           "backward per step on each rank (raise the number of ranks or lower the batch size to fit "
                           "memory)")
    holder = engine._holder
    if holder.active:
        raise RuntimeError("optimizer.accumulate(): the block is already open (blocks do not nest)")
    holder.active = True
    try:
        yield
    finally:
        holder.active = False
        for st in engine._steps_of:
            st.release_held()


def refuse_step_inside(engine) -> None:
    """``step()`` inside the block would release gradients the block still holds (or miss them)."""
    if engine._holder.active:
        raise RuntimeError("DPOptimizer.step() was called inside optimizer.accumulate(): end the block first "
                           "(the step's gradients are held until it ends); nothing was released or charged")
