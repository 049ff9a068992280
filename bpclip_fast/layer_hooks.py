"""The hooks a clipped layer's step puts on its parameters, a mixin of
:class:`bpclip_fast.boundary.LayerStep` (its state: ``_handles``, ``_nodes``, ``_node_of``, ``_ours``,
``_node_prehooks``, ``_produced``, ``_expected``, ``_fingerprints``, the pass's rows and draw), kept
apart so that the step boundary's bookkeeping reads on its own: what each hook checks, and why, is in
its docstring and the boundary's module docstring (the gradient is exactly the layer's own backward
outputs)."""

from __future__ import annotations

import torch

from .fingerprint import fingerprint
from .graph_nodes import accumulate_node, untraced
from .held_grads import record as _record
from .rules import StepRefused


def _same_tensor(record, t) -> bool:
    """Whether ``t`` is the tensor ``record = (weakref, version)`` describes, unmodified."""
    return record is not None and t is not None and record[0]() is t and t._version == record[1]


class LayerHooks:
    """The parameter-hook half of :class:`bpclip_fast.boundary.LayerStep`."""

    def install_hooks(self) -> None:
        """Post-accumulate hooks (record what .grad holds) and AccumulateGrad pre-hooks (check what
        is accumulated is our own output). The AccumulateGrad nodes are kept alive here: autograd
        reuses a live node for every later graph, so the hooks stay attached — and so does any
        pre-hook the loop adds to such a node after ours, which runs after ours and before the
        accumulation, where it could replace or edit what is accumulated; the node's pre-hook dict
        (shared by every Python pre-hook of the node) is kept to see those (``_foreign_hooks_on``)."""
        self.remove_hooks()
        self._hooked = self._trainable()
        for i, p in enumerate(self.params):
            if not p.requires_grad:
                continue
            node = accumulate_node(p)
            self._nodes.append(node)
            self._node_of[i] = node
            self._handles.append(p.register_hook(untraced(self._make_tensorhook(i, node))))
            prehook = node.register_prehook(untraced(self._make_prehook(i)))
            self._handles.append(prehook)
            self._node_prehooks[i] = prehook.hooks_dict_ref
            self._handles.append(p.register_post_accumulate_grad_hook(untraced(self._make_posthook(i))))
        self._ours = frozenset(h.id for h in self._handles)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._nodes, self._ours = [], [], frozenset()
        self._node_of = {}
        self._node_prehooks = {}

    def _make_tensorhook(self, i, node):
        """Runs whenever this parameter's gradient is computed. If it is not going to be accumulated
        into ``.grad`` it is being captured (``torch.autograd.grad(loss, params)``): handed to the
        caller unverified, maybe without the draw. Refused before it leaves the backward."""
        def tensorhook(grad):
            try:
                lands = torch._C._will_engine_execute_node(node)
            except RuntimeError:  # torch refuses the question inside autograd.grad(): a capture
                lands = False
            if not lands:
                self.check_budget("torch.autograd.grad of a private parameter")
                if self._replaced(i, node):
                    p = self.params[i]
                    self.refuse("converted", f"{self._param_name(i)} is now {p.dtype} on {p.device}: its tensor was "
                                "replaced after make_private, and the gradient goes to the new tensor's .grad, which "
                                "the engine did not hook")
                self.refuse("captured", f"torch.autograd.grad asked for {self._param_name(i)}'s gradient")
                from_step = "a private parameter's gradient requested from torch.autograd.grad"
                raise StepRefused("captured", from_step, [self.name], charged=False)
            return None
        return tensorhook

    def _replaced(self, i, node) -> bool:
        """Whether parameter ``i`` accumulates into another node than the hooked one: torch gives a
        parameter a new AccumulateGrad node when its data changes dtype or device (``module.to``,
        ``.half()``, ``.cuda()``, a ``.data`` assignment), so its gradient no longer reaches the
        hooked node, which looks like a capture from inside the backward."""
        return accumulate_node(self.params[i]) is not node

    def _make_prehook(self, i):
        def prehook(grad_outputs):
            incoming = grad_outputs[0]
            if self._foreign_hooks_on(i):
                self._refuse_accumulation("grad-edit", f"a gradient hook other than the engine's on "
                                          f"{self._param_name(i)} (it can rewrite the gradient unseen)")
            if incoming is None:  # nothing accumulates (a flat collector with no entry for this layer)
                return None
            record = self._produced.pop(i, None)
            if not _same_tensor(record, incoming):
                self._refuse_accumulation(
                    "weight-reuse", f"{self._param_name(i)} received a gradient that is not its layer's own output "
                    "(the parameter is used outside the layer, or a tensor hook changed its gradient)")
            elif len(record) > 2:  # sealed (seal_produced): the bits must be those our op returned
                if self.holding():  # inside accumulate(): zeros, checked now (they land before step())
                    self._refuse_unzeroed(i, incoming)
                else:
                    self.reuse_checks.append(fingerprint(incoming).ne(record[2]))
            if not self._pass_landed:  # the pass's contribution lands now: its rows and draw count once
                self._draw_landed = self._draw_landed or self._pass_noised
                self._landed_open = self._landed_open or not self.holding()
                self.rows += self._pass_rows
                self.noised = self.noised or self._pass_noised
                self.books |= self._pass_books
                if self._pass_counts is not None:
                    self.counts = self._pass_counts if self.counts is None else self.counts + self._pass_counts
                self._pass_rows, self._pass_noised, self._pass_books = 0, False, set()
                self._pass_counts = None
            if self._pass_held:
                self.commit_held(i)
            self._pass_landed.add(i)
            return None
        return prehook

    def close_pass(self, params=None) -> None:
        """A pass must land on all of the layer's trainable parameters or on none (a pass restricted
        with ``backward(inputs=[bias])`` would add rows and no draw to the others)."""
        if self._pass_landed and self._pass_landed != {
                i for i, p in enumerate(self.params if params is None else params) if p.requires_grad}:
            self.violations.append(("rows", f"a backward pass reached only some of {self.name}'s parameters "
                                    "(backward(inputs=...) or torch.autograd.grad on some of them)"))
        self._pass_landed = set()

    def foreign_hooks(self, params=None) -> list[str]:
        """Parameters carrying gradient hooks other than ours: a tensor hook or a post-accumulate hook
        can rewrite the gradient where our records cannot see it (one registered before ours runs
        first, and we would record its result as the layer's own)."""
        return [self._param_name(i) for i, p in enumerate(self.params if params is None else params)
                if self._foreign_hooks_on(i, p)]

    def _foreign_hooks_on(self, i, p=None) -> bool:
        # Set containment over the hook dicts' keys (their handle ids): one C-level pass each, asked
        # per parameter per backward pass and again at step(). The AccumulateGrad node's pre-hooks:
        # the dict our pre-hook went into (one per node; gone with the node, and then so are its hooks).
        p = self._param(i) if p is None else p
        ours = self._ours
        node_ref = self._node_prehooks.get(i)
        node_hooks = node_ref() if node_ref is not None else None
        return not (ours.issuperset(getattr(p, "_post_accumulate_grad_hooks", None) or ())
                    and ours.issuperset(getattr(p, "_backward_hooks", None) or ())
                    and ours.issuperset(node_hooks or ()))

    def _make_posthook(self, i):
        def posthook(p):
            self.landed(i)
            if self.after_backward is not None:
                self.after_backward.touched(self, i)
        return posthook

    def landed(self, i) -> None:
        """Records ``.grad`` of parameter ``i`` as written by its layer (or by DDP's reducer)."""
        g = self._param(i).grad
        if g is None:  # an undefined gradient reached AccumulateGrad: nothing landed
            return
        self._expected[i] = _record(g)
        # A pass over part of the batch: a write through ``p.grad.data`` bypasses the version counter,
        # so the bits are summed now and compared when the next pass starts or the block ends (one
        # read of the gradient, only after such a pass).
        if self.batch_rows is not None and 0 < self.rows + self._pass_rows < self.batch_rows():
            self._fingerprints[i] = fingerprint(g)
        else:
            self._fingerprints.pop(i, None)
