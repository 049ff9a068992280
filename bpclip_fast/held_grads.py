"""Declared accumulation, the layer's half: inside ``optimizer.accumulate()`` the engine keeps what each
backward pass computes for the layer's parameters, and what the pass returns to autograd is zero, until
the block ends and ``.grad`` receives the sum.

Why. The step's noise is added once, by its first landing backward; a later micro-batch adds its
clipped sum as it is. Had that sum been readable, the difference of two reads would be a
micro-batch's clipped sum with no noise (review 49 H1: an example's clipped gradient recovered to
4e-7). Inside the block nothing a pass computes for a parameter leaves the engine until all the
step's passes have run, so the loop sees one release, ``Σ_i c_i + N``, the same as one backward over
the batch. Outside the block a second landing pass of a step is refused (``accumulate``,
:meth:`~bpclip_fast.pass_refusals.PassRefusals._refuse_before_landing`).

How. :meth:`~bpclip_fast.boundary.LayerStep.produced`, the one point every clipped layer's backward
(fused, flat collector, generic unit, compiled op) passes its parameter gradients through before it
returns them, adds them to the layer's held sum and zeroes them in place (:meth:`HeldGrads.hand_over`).
So everything downstream — autograd's node hooks, ``AccumulateGrad`` and its hooks, ``.grad``, a
tensor the loop kept from before the block, another thread — sees zeros (review 51 R1, R2, R4: a
first design that took ``.grad`` out after each accumulation still let each of them see a pass's
raw sum). The step's records, row counts and draws proceed as without the block (a landed pass of
zeros is a landed pass); :meth:`HeldGrads.release_held` brings the records in line with ``.grad`` as
the block leaves it (a clear inside the block drops what was held, as a clear drops a gradient) and
writes ``.grad + held`` as a new tensor. Under DDP the block is refused
(:func:`bpclip_fast.engine.accumulation.accumulating`): the reducer would average the zeros.

A mixin of :class:`bpclip_fast.boundary.LayerStep` (its state: ``_held``, ``_expected``, ``holder``),
like :mod:`bpclip_fast.pass_refusals`."""

from __future__ import annotations

import weakref

import torch


def record(t):
    """``(weak reference, version)`` of a gradient tensor: what the step's records compare against."""
    return (weakref.ref(t), t._version)


class HeldGrads:
    """The held-gradient half of :class:`bpclip_fast.boundary.LayerStep`."""

    def holding(self) -> bool:
        """Whether the loop is inside ``optimizer.accumulate()``."""
        holder = self.holder
        return holder is not None and holder.active

    def hand_over(self, grads) -> None:
        """What autograd receives of the parameter gradients this backward computed, in place, before
        anything outside the engine can see them (a node's post-hook gets them as it returns):

        * a parameter this pass does not accumulate into ``.grad`` (``torch.autograd.grad`` of the
          input, ``backward(inputs=...)`` of others) gets zeros: nobody needs its gradient, which
          after the step's noise landed is the batch's clipped sum without noise (review 52: an input
          gradient's pass after the training backward showed it to a hook on the layer's node), and
          inside the block it must not join the sum either (its rows are never counted: the batch
          twice for an adversarial example's input gradient);
        * inside ``optimizer.accumulate()`` the others are added to the pass's sum, then zeroed
          (zeroed second, a tensor returned for two parameters adds once); the pass's sum joins the
          block's in the ``AccumulateGrad`` pre-hook, where the pass's rows are counted
          (:meth:`commit_held`), so a pass that raises on the way adds nothing (review 52 S1: an
          aborted and retried micro-batch had counted twice, 21 times after 20 aborts)."""
        holding = self.holding()
        held = self._pass_held
        for i, g in enumerate(grads):
            if g is None:
                continue
            if not self._lands_on(i):
                g.detach().zero_()
            elif holding:
                h = held.get(i)
                if h is None:
                    held[i] = g.detach().clone()
                else:
                    h.add_(g.detach())
                g.detach().zero_()

    def commit_held(self, i: int) -> None:
        """Parameter ``i``'s part of the pass lands (its ``AccumulateGrad`` pre-hook, checks passed)."""
        h = self._pass_held.pop(i, None)
        if h is None:
            return
        total = self._held.get(i)
        if total is None:
            self._held[i] = h
        else:
            total.add_(h)

    def _refuse_unzeroed(self, i: int, incoming) -> None:
        """A compiled layer's output reaches ``AccumulateGrad`` inside the block: it must still be the
        zeros :meth:`hand_over` left. Inductor adds a plain use's gradient into that buffer in place
        (same tensor, same version), which outside the block the sealed fingerprint finds at
        ``step()``; here ``.grad`` would hold it alone, unclipped and without noise, before then
        (review 52 S2). One device read per parameter per pass, only compiled and inside the block."""
        if bool(incoming.ne(0).any()):
            self._refuse_accumulation("weight-reuse", f"{self._param_name(i)} received a gradient that is not its "
                                      "layer's own output (the compiled graph added another use of the parameter "
                                      "to it)")

    def _lands_on(self, i: int) -> bool:
        node = self._node_of.get(i)
        if node is None:
            return False
        try:
            return torch._C._will_engine_execute_node(node)
        except RuntimeError:  # asked inside torch.autograd.grad of a parameter: a capture, refused elsewhere
            return False

    def release_held(self) -> None:
        """The end of the block: ``.grad`` becomes ``.grad + held`` (a new tensor: one the loop kept is
        not written), recorded as the layer's own where ``.grad`` was. A later landing pass in the step is
        refused (``accumulate``)."""
        if self._held:
            self.sync_with_grads()  # a clear inside the block restarts the layer and drops what it held
        held, self._held = self._held, {}
        expected = self._expected
        for i, h in held.items():
            p = self._param(i)
            g = p.grad
            rec = expected.get(i)
            ours = g is None or (rec is not None and rec[0]() is g and g._version == rec[1])
            p.grad = h if g is None else g + h
            if ours:
                expected[i] = record(p.grad)
        if self.rows > 0 or self.noised:
            self._landed_open = True

    def drop_held(self) -> None:
        self._held = {}
        self._pass_held = {}
