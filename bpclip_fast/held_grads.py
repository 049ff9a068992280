"""Declared accumulation, the layer's half: inside ``optimizer.accumulate()`` the gradients a backward
lands are taken out of ``.grad`` and held where the loop cannot read them, until the block ends.

Why. The step's noise is added once, by its first landing backward; a later micro-batch adds its
clipped sum as it is. Had ``.grad`` been readable between two micro-batches, the difference of two
reads would be that micro-batch's clipped sum with no noise (review 49 H1: an example's clipped
gradient recovered to 4e-7). Inside the block nothing of the step is readable until all its passes
have landed, so the loop sees one release, ``Σ_i c_i + N``, the same as one backward over the batch.
Outside the block a second landing pass of a step is refused (``accumulate``,
:meth:`~bpclip_fast.pass_refusals.PassRefusals._refuse_before_landing`).

How. A landed gradient is held the moment it lands (the post-accumulate hook; under DDP once the
reducer has written it, at the end of the pass: :class:`bpclip_fast.engine.accumulation.Holder`),
and put back in the ``AccumulateGrad`` pre-hook of the next pass that lands on it, just before
torch adds to it, and at the end of the block. Held, a gradient is a copy the engine made: the
tensor torch accumulated into may be one the loop kept a reference to (``g = p.grad`` after
``zero_grad(set_to_none=False)``), through which it would read the later passes' sums. The records
(:meth:`~bpclip_fast.boundary.LayerStep._grad_states`) read a held gradient as the parameter's, so
every check of the step sees what it would see without the block. A gradient written by the loop
while one is held is refused (``grad-edit``): the two cannot both be the step's.

A mixin of :class:`bpclip_fast.boundary.LayerStep` (its state: ``_held``, ``_owned``,
``_expected``, ``_fingerprints``, ``holder``), like :mod:`bpclip_fast.pass_refusals`."""

from __future__ import annotations

import weakref


def record(t):
    """``(weak reference, version)`` of a gradient tensor: what the step's records compare against."""
    return (weakref.ref(t), t._version)


class HeldGrads:
    """The held-gradient half of :class:`bpclip_fast.boundary.LayerStep`."""

    def holding(self) -> bool:
        """Whether the loop is inside ``optimizer.accumulate()``."""
        holder = self.holder
        return holder is not None and holder.active

    def hold(self, i: int) -> None:
        """Takes parameter ``i``'s landed gradient out of ``.grad`` (after its records were taken). A
        tensor the engine did not make is copied first: the loop may hold a reference to it."""
        p = self._param(i)
        g = p.grad
        if g is None:
            return
        owned = self._owned.get(i)
        if owned is None or owned() is not g:
            g = g.clone()
            self._owned[i] = weakref.ref(g)
        self._held[i] = g
        self._expected[i] = record(g)
        self._fingerprints.pop(i, None)  # no .data write can reach a held copy
        p.grad = None

    def grad_of(self, i: int, p):
        """What parameter ``i`` holds as gradient now: ``.grad``, or the held copy while ``.grad`` is
        unset."""
        g = p.grad
        if g is None and self._held:
            return self._held.get(i)
        return g

    def put_back(self, i: int) -> None:
        """In the ``AccumulateGrad`` pre-hook: the held gradient back in ``.grad``, for torch to add to."""
        held = self._held.pop(i, None)
        if held is None:
            return
        p = self._param(i)
        if p.grad is not None:
            self._held[i] = held
            self._refuse_written(i)
        p.grad = held

    def check_held(self, params) -> None:
        """At a pass's first visit: a held gradient's ``.grad`` must still be unset."""
        for i in self._held:
            if params[i].grad is not None:
                self._refuse_written(i)

    def release_held(self) -> None:
        """The end of the block: every held gradient back in ``.grad``, released; a later landing pass
        in the step is refused (``accumulate``)."""
        for i in list(self._held):
            if self._param(i).grad is not None:
                self._refuse_written(i)
        for i, held in list(self._held.items()):
            self._param(i).grad = held
        self._held.clear()
        if self.rows > 0 or self.noised:
            self._landed_open = True

    def drop_held(self) -> None:
        self._held.clear()
        self._owned.clear()

    def _refuse_written(self, i: int) -> None:
        self.check_budget("a gradient written inside optimizer.accumulate()")
        details = (f"{self._param_name(i)}.grad was written inside optimizer.accumulate() while the engine held "
                   "its accumulated gradient")
        self.refuse("grad-edit", details)
        raise RuntimeError(details + "; leave .grad alone inside the block (clear it with optimizer.zero_grad() "
                           "before the block)")
