"""Declared accumulation, the engine's half: ``with optimizer.accumulate():`` around the micro-batches
of one step. The layers hold what each pass lands out of ``.grad`` until the block ends
(:mod:`bpclip_fast.held_grads`, where the argument is), so the loop reads the step's gradient once,
after all its passes, as if it were one backward over the batch."""

from __future__ import annotations

import contextlib

import torch

from ..graph_nodes import untraced


class Holder:
    """Whether the loop is inside the block (``active``), shared by the engine's layers; takes each
    landed gradient out of ``.grad``. At once, in the post-accumulate hook, unless DDP's reducer is
    still to write the averaged gradient into ``.grad`` (it does at the end of the pass): then once it
    has, by the same two-level callback as :class:`bpclip_fast.engine.distributed.DistributedRecorder`,
    queued after the recorder's (callbacks run in the order they were queued). The callbacks are
    queued once per backward pass (graph task), not behind a flag: a pass that raises before its end
    runs none of them, and a flag left set would leave every later pass's gradients in ``.grad``."""

    def __init__(self, deferred: bool):
        self.active = False
        self.deferred = deferred
        self._touched = {}
        self._task = None

    def touched(self, step, i: int) -> None:
        if not self.deferred:
            step.hold(i)
            return
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            self._touched = {}  # an aborted pass's: its step was refused and its gradients dropped
            torch.autograd.Variable._execution_engine.queue_callback(self._requeue)
        self._touched[(id(step), i)] = (step, i)

    @untraced
    def _requeue(self):
        torch.autograd.Variable._execution_engine.queue_callback(self._hold)

    @untraced
    def _hold(self):
        for step, i in self._touched.values():
            step.hold(i)
        self._touched = {}
        self._task = None


@contextlib.contextmanager
def accumulating(engine):
    """The block: the layers hold their gradients inside it and release them at its end (also when it
    ends by an exception: a refused step has dropped them already)."""
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
