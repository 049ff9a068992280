"""The refusals a backward pass meets at a clipped layer before the layer's backward computes
anything: what it would land is readable in ``.grad`` before ``step()`` could refuse, so these cannot
wait for the step's own checks. A mixin of :class:`bpclip_fast.boundary.LayerStep` (its state: the
pass's rows and draw, ``_draw_landed``, ``_mixed``, ``_nodes``, ``refuse``, ``check_budget``), kept
apart so that the step boundary's bookkeeping reads on its own; the argument for each refusal is in
its docstring and the boundary's module docstring."""

from __future__ import annotations

import torch

from . import _ops, rules


class PassRefusals:
    """The before-the-backward half of :class:`bpclip_fast.boundary.LayerStep`."""

    def first_landing(self, ctx) -> None:
        """A forward's examples land in ``.grad`` in one backward pass at most. A second pass over a
        retained graph (``backward(retain_graph=True)`` run again, two losses of one forward, a retained
        graph's backward in a later step) would release them again, and the row count misses it where
        the forward saw part of the batch (4 + 4 rows of a batch of 8, review 19).

        The first pass whose gradients reach this layer's ``AccumulateGrad`` nodes marks every object
        that stands for the forward, and a later landing pass that finds any of them marked is
        refused there, charged, before the layer's backward computes (``rows``: its sum would land raw
        on the first release). A pass that does not land
        (``torch.autograd.grad`` or ``backward(inputs=...)`` of the input or of other layers'
        parameters), before or after, is neither marked nor refused. The objects, each of which one
        forward alone can mark: ``ctx``, its autograd context (never reused, unlike an id); the node
        whose backward recomputed the forward, ``ctx._bp_origin`` (:func:`bpclip_fast.graph_nodes.forward_origin`:
        checkpointing that recomputes the forward in each pass makes a fresh context every time);
        and for a compiled layer the compiled graph's node that runs the backward op,
        ``ctx._bp_node`` (``compiled._ForwardMark``). Marks are kept per layer (by its handle): a node
        recomputes or runs several. Any one of them can be lost where another holds (a compiled forward
        recomputed by reentrant checkpointing runs in a fresh compiled node each pass, and a tensor
        attribute does not survive an unpack that copies), so all are checked and all are marked.
        Checkpointing nested inside reentrant checkpointing makes the inner node afresh in each pass
        of the outer one: the outer nodes (``origin._bp_outer``, :func:`~bpclip_fast.graph_nodes.forward_origin`) are marked
        too."""
        if not self.enforce:
            return
        holders = [ctx]
        origin = getattr(ctx, "_bp_origin", None)
        if origin is not None:
            holders.append(origin)
            holders += origin.__dict__.get("_bp_outer", ())
        node = getattr(ctx, "_bp_node", None)
        if node is not None:
            holders.append(node)
        task, key = torch._C._current_graph_task_id(), self.layer._bp_handle
        fresh = earlier = False
        for holder in holders:
            marks = getattr(holder, "_bp_landed", None)
            landed = marks.get(key) if marks is not None else None
            if landed is None:
                fresh = True
            elif landed != task:
                earlier = True
        if not (fresh or earlier):  # this pass marked them all (a second use of the layer in the pass)
            return
        if not self.lands_now():  # a pass that lands nothing releases nothing, before or after
            return
        if earlier:  # refused now: the first release is readable in .grad, and this one would add its sum raw
            if self.on_new_pass is not None and self._gate.task != task:
                self.on_new_pass()  # first the pass's own checks: one with no batch drawn is refused uncharged
            self.check_budget("a backward")
            details = (f"{self.name}: a second backward pass reached one forward (backward(retain_graph=True) run "
                       "again, or a retained graph's backward after its step): its examples would be released twice")
            self.refuse("rows", details)
            raise RuntimeError(details)
        for holder in holders:
            marks = getattr(holder, "_bp_landed", None)
            if marks is None:
                holder._bp_landed = marks = {}
            marks[key] = task

    def lands_now(self) -> bool:
        """:meth:`_lands`, the layer's trainable parameters hooked first (unfrozen since the step armed
        it: the nodes ``_lands`` asks about)."""
        if self._hooked != self._trainable():
            self.install_hooks()
        return self._lands()

    def _lands(self) -> bool:
        """Whether this backward pass accumulates into the layer's ``.grad`` (its AccumulateGrad nodes
        run); torch refuses the question inside ``torch.autograd.grad`` of a parameter (a capture,
        refused by the tensor hooks)."""
        for node in self._nodes:
            try:
                if torch._C._will_engine_execute_node(node):
                    return True
            except RuntimeError:
                return False
        return False

    def _refuse_second_integer_backward(self) -> None:
        """Integer noise releases the layer's whole sum once: a later backward of the layer in the
        step would land its sum raw on the released integers, where ``.grad/γ`` modulo 1 shows it
        noise-free (review 46 F1, review 47 N1: a second micro-batch, or two forwards and one backward),
        and a draw per backward would release a micro-batch split whose examples move between the
        passes with one example more or less (review 47 N2: √(4m − 3)·Δ over m passes, charged Δ) — and
        so would clearing ``.grad`` between the passes, or the whole batch released m times (review 48
        G1): a landing pass after the step's first is refused whatever was cleared in between. Only
        passes that land count (``torch.autograd.grad`` of the inputs over two forwards is not a
        release: review 48 G2). Refused before the backward runs, charged (the first release was
        readable in ``.grad``)."""
        self.check_budget("a backward")
        self.refuse("integer-passes", f"{self.name}'s backward ran a second time in this step under integer_noise=True "
                    "(a micro-batch after the first, or the layer's backward twice in one pass)")
        raise RuntimeError(f"{self.name}: a second backward of this layer in one step under integer_noise=True")

    def _refuse_before_landing(self) -> None:
        """The refusals a landing pass meets before the layer's backward computes anything, because
        what it would land is readable in ``.grad`` before ``step()`` refuses (review 49):

        * **The step's draw landed and the gradients no longer all hold it** (``redraw``; banded:
          ``banded-redraw``). Cleared whole (``zero_grad``, ``p.grad = None``, zeroed in place), a
          fresh draw would release the batch once more under a charge for one (review 48 G1: the whole
          batch 64 times, a membership advantage of 0.84 where the charge allows 0.55), and the same
          draw would be the same noise on another sum. Cleared, unfrozen or landed in part (the weight's
          gradient set to ``None`` and the bias's kept, a weight frozen for the first pass,
          ``backward(inputs=[bias])``), the layer's draw counts as added, so the parameter without it
          would receive its clipped sum with no noise at all (review 49 H2).
        * **More example rows than the batch drawn** (``rows``): a layer used k times in the forward
          (added after ``make_private``) releases k clipped contributions per example under noise for
          one (review 49 H3: 2.3·C at k = 4, 37·C at k = 64), and a second backward over the batch lands
          its sum raw. Named without the counts (they would tell the batch's size).
        * **A second landing pass outside ``optimizer.accumulate()``** (``accumulate``): only the
          step's first landing pass adds the noise, so the difference of ``.grad`` read before and
          after this one would be its clipped sum with no noise (review 49 H1: an example's clipped
          gradient recovered to 4e-7 with micro-batches of B − 1 and 1). Inside the block the passes
          land where the loop cannot read them (:mod:`bpclip_fast.held_grads`). Under integer noise
          its own rule refuses every second landing pass, in the block or not (``integer-passes``).
        * **A landing pass after one that took the draw for a landing and never landed** (``redraw``):
          a hook on the layer's backward node read the pass's noised sum and returned ``None`` for the
          parameters, so nothing landed and each new pass took a fresh draw: K noisy copies of one sum
          for one charge (review 54 U1, noise down by √K). Inside the block the pass hands autograd
          zeros, so nothing was shown and a retry stays allowed.

        Charged (the step's first release was readable). Asked per layer call of a pass; ``lands_now``
        only when a condition holds (a pass that lands nothing releases nothing)."""
        over = self.batch_rows is not None and self.rows + self._pass_rows > self.batch_rows()
        cleared = self._draw_landed and (self._mixed or not self.noised) and self.integer_bits is None
        again = self._landed_open and self.integer_bits is None
        dropped = self._dropped_draw
        if not (over or cleared or again or dropped) or not self.lands_now():
            return
        self.check_budget("a backward")
        if over:
            details = (f"{self.name}: this backward pass would bring the layer's example rows in this step past the "
                       "batch drawn for it (the layer used more than once in the forward, or the batch backwarded "
                       "again)")
            self.refuse("rows", details)
            raise RuntimeError(details)
        if self._edited():
            details = rules.edited(self.name)
            self.refuse("grad-edit", details)
            raise RuntimeError(details)
        if dropped and not (cleared or self._mixed):
            details = (f"{self.name}: an earlier backward pass of this step took the step's noise for a landing "
                       "and never landed (a hook on the layer's backward node dropped its gradient, or the pass "
                       "raised after the layer computed), so its noised sum could be read; this pass would take "
                       "a fresh draw, a second release of the batch")
            self.refuse("redraw", details)
            raise RuntimeError(details)
        if not (cleared or self._mixed):
            details = (f"{self.name}: a second backward pass of this step would land on its gradient outside "
                       "optimizer.accumulate(), where .grad read before it holds the first pass's release and read "
                       "after it would show this pass's clipped sum without noise")
            self.refuse("accumulate", details)
            raise RuntimeError(details + "; run the step's micro-batches inside `with optimizer.accumulate():`")
        if self._mixed:
            details = (f"{self.name}: some of its parameters' gradients hold this step's noise and others do not "
                       "(cleared, zeroed or unfrozen on their own, or reached by another pass's backward(inputs=...)), "
                       "and this backward would land on them without noise")
        else:
            details = (f"{self.name}: its gradient held this step's noise and was cleared (zero_grad, p.grad = None "
                       "or zeroed in place), and a later backward pass in the same step would need the noise again")
        self.refuse("redraw" if self.band is None else "banded-redraw", details)
        raise RuntimeError(details + "; take one backward per step, or micro-batches without clearing the gradient "
                           "between them")

    def _edited(self) -> bool:
        """Whether a gradient of the layer was changed other than by zeroing since its pass landed: the
        rule a refusal names (``grad-edit`` rather than ``redraw``). Reads the device, on the refusal's
        path only (what ``step()`` reads with its one sync)."""
        if any(bool(flag) for flag in self.edit_checks):
            return True
        return any(k == "foreign" and p.grad is not None and bool(p.grad.ne(0).any())
                   for _, p, k in self._grad_states())

    def _refuse_std(self, rows) -> None:
        """A std outside the kernels' range (``make_private`` refuses settings that allow one,
        :mod:`bpclip_fast.engine.noise_range`): refused before anything is drawn, charged, and in words
        that name no value (the value would tell the batch's size). A backward over more rows than the
        batch drawn is the rows rule's refusal whatever the std (the rule named must not tell whether
        the std left the range: review 42)."""
        details = (f"{self.name}: this backward's noise std (noise_multiplier·Δ/rows) is outside the range the "
                   f"kernels draw in ({_ops.NOISE_STD_RULE})")
        if self.enforce:
            self.check_budget("a backward")
            if self.batch_rows is not None and int(rows) > self.batch_rows():
                self.refuse("rows", f"{self.name}'s backward saw more example rows than the batch drawn for the step")
            self.refuse("bounds", details)
        raise ValueError(details + "; use a clipping norm and noise_multiplier whose product is not so small (or "
                         "so large)")

    def _refuse_second_call(self) -> None:
        """The layer's backward called a second time in one pass (the layer used twice in the forward,
        added after ``make_private``): only the first call takes the step's draw, so the second returns
        its rows' clipped sum without noise, which a hook on its node reads before the ``AccumulateGrad``
        pre-hook refuses the sum of the two (review 52 S3). Refused before it computes, charged, where
        the pass lands on the layer (flat's book releases a layer's calls together and is exempt; a
        pass that lands nothing hands autograd zeros). "In one pass" is the set of passes whose backward
        reached the layer in this step, kept until the next step: a hook between two calls that reset
        the layer (``zero_grad()``) or ran a nested pass through it had made each call look like a
        new pass with a fresh draw, K releases of one sum for one charge (review 53 T1)."""
        if not self.lands_now():
            return
        self.check_budget("a backward")
        details = (f"{self.name}'s backward ran twice in one backward pass (the layer is used twice in the "
                   "forward); only its first use is covered by the step's noise")
        self.refuse("weight-reuse", details)
        raise RuntimeError(details)

    def _refuse_accumulation(self, rule: str, details: str) -> None:
        """In an ``AccumulateGrad`` pre-hook, before the gradient is added to ``.grad``: what arrives is
        not the layer's own output (a use of the weight outside the layer added after ``make_private``,
        a layer applied twice to one half of the batch, a tensor hook) or a foreign hook can still edit
        it. Accumulated, it would be readable before ``step()`` refused it: an unclipped contribution
        (review 50 F1: a weight's gradient of norm 709 under noise of std 1/16). Charged."""
        self.check_budget("a backward")
        self.refuse(rule, details)
        raise RuntimeError(details)
