"""The step boundary: the one place that decides whether a private step may be released.

A step's release is, per clipped layer, ``Σ_i c_i + N(0, σ²Δ²)`` with ``‖c_i‖ ≤ Δ`` a function of
example ``i`` alone (DESIGN.md §5). This module owns every piece of state that sentence depends on,
so that ``DPOptimizer.step()`` can verify it before anything is released:

* **One draw per gradient.** Each clipped layer holds this step's Philox key ``(seed, offset)``.
  The first backward pass whose output lands in a *fresh* gradient (none, or one that was zeroed)
  adds the draw; later passes into the same gradient add none (under ``integer_noise=True`` a later
  backward of the layer in the step is refused instead, ``integer-passes``: its sum would land raw
  on the released integers). A landing pass that would need the draw again because the gradient
  that held it was cleared (``zero_grad``, ``p.grad = None``, zeroed in place) is refused, charged
  (``redraw``): the cleared gradient was readable, so a fresh draw would be a second release of the
  batch charged as one (review 48 G1: the whole batch 64 times reached a membership advantage of
  0.84 where the charge allows 0.55), and the same draw would be the same noise on other sums. A
  draw that never landed (a pass of ``torch.autograd.grad`` of the inputs, a refused step re-armed)
  is replaced by a fresh one (:func:`redraw_seed`), never the same again. The later passes of a
  step add their sums to the first one's release as they are, so a second landing pass is refused
  unless the passes run inside ``optimizer.accumulate()``, where what they compute for the
  parameters stays in the engine until the block ends (:mod:`bpclip_fast.held_grads`; review 49
  H1). The parameters may not change between the passes of a step (version counters; ``param-edit``), so a
  manual update cannot release a draw twice either.
* **The gradient is exactly the layer's own backward outputs.** After every accumulation a
  post-accumulate-grad hook records the gradient tensor (weak reference) and its version counter.
  Any other write — an in-place edit (version), a replacement (identity) — is seen by the next
  backward or by ``step()``. The only edit allowed is zeroing (``zero_grad(set_to_none=False)``,
  ``p.grad.zero_()``): the layer then starts afresh (a later landing backward in the step is
  refused, ``redraw``; ``step()`` adds a fresh draw to the zeros), and ``step()``
  verifies on the device that the gradient really was zero (one ``any()`` per edited gradient,
  read with one sync, only when such an edit happened). A pre-hook on each parameter's
  ``AccumulateGrad`` node checks that what is accumulated is the very tensor (same object, same
  version) the layer's backward returned: a contribution from plain code (a tied weight used in
  ``F.linear``) or from a tensor hook makes a different tensor, refused there, charged, before it is
  accumulated (review 50 F1: an unclipped use's gradient had been readable in ``.grad`` until
  ``step()``), and so is a foreign hook found on the parameter. Compiled, a use the compiler adds in
  place into the layer's output keeps the tensor: its bits are compared at ``step()`` (one sync),
  after it was readable (open).
* **Row accounting.** Each layer counts the example rows of its backward passes since its
  gradient was created. The count must be 0 (no contribution) or the number of rows of the batch
  drawn for the step: two backward passes over one forward, the same rows fed twice, a layer
  reused within or across micro-batches, a data-dependent subset of the rows (which breaks the
  mean-loss rule), ``flatten(0, 1)`` or a sequence-first layout all give another count. A count
  past the batch, or a second landing pass over one forward, is refused at the backward that would
  make it, before it computes (its sum would be readable in ``.grad`` before ``step()``).
  (Counting cannot see the same *half* of a batch fed twice: the user's loop must split the
  batch into disjoint micro-batches. Between the passes of a micro-batched step the gradient's
  bits are fingerprinted, so a write through ``p.grad.data`` — invisible to version counters — is
  caught too.)

Refusals and the accountant
---------------------------
A refused step releases no gradient (every ``.grad`` is set to ``None``), but the refusal itself is
observable. A refusal that can depend on the values of the batch is therefore *charged*: the
accountant is stepped as if the step had been taken, so the ε reported covers the step's sampling
and Gaussian mechanism. (The one bit "refused" is not itself noised; the charged rules exist to
catch broken training loops, which should fail on the first step for every batch alike.) Only two
refusals are provably independent of the data and not charged: the number of batches the loop
drew since the last step (a count of ``next()`` calls) and the privacy budget (a function of the
public accountant). Every :class:`StepRefused` is charged.
"""

from __future__ import annotations

import math

import torch

from . import _ops, integer_noise
from .band_step import BandRelease
from .data import derive_seed
from .fingerprint import fingerprint
from .held_grads import HeldGrads
from .held_grads import record as _record
from .layer_hooks import LayerHooks
from .pass_refusals import PassRefusals
from .rules import RULES, StepRefused

__all__ = ["StepRefused", "LayerStep", "PassGate", "RULES"]  # the rules: .rules


_OURS = frozenset(("ours",))


def redraw_seed(seed: int, offset: int, k: int) -> int:
    """The Philox key of the ``k``-th draw (k ≥ 1) of one step and layer: independent of the first."""
    return derive_seed(seed, "redraw", offset, k)


class PassGate:
    """The backward pass (autograd graph task) whose once-per-pass checks (``LayerStep.on_new_pass``)
    already ran, shared by one engine's layers: the later layers of the pass skip the call. Written
    by the check itself, before it may raise, as before (a refused pass is not re-checked)."""

    __slots__ = ("task", "passes")

    def __init__(self):
        self.task = None
        self.passes = 0  # backward passes since the layers were last armed (a step, or a refused one)


class LayerStep(LayerHooks, BandRelease, PassRefusals, HeldGrads):
    """One clipped layer's part of the current step (see the module docstring).

    ``enforce=False`` (layers armed by :func:`bpclip_fast.nn.arm_noise` without the engine): only
    the noise is managed — once per arming — and nothing is checked.
    """

    def __init__(self, layer, name: str, *, enforce: bool, mean_loss_batch: float | None = None):
        self.layer = layer
        self.name = name
        self.enforce = enforce
        self.mean_loss_batch = mean_loss_batch  # loss_reduction="mean": B̄ (see bpclip_fast/engine/__init__.py); None: sum
        self.key = None           # (seed, offset) of this step's draw
        self.noised = False       # the current gradient holds the draw
        self.rows = 0             # example rows of the backward passes since the gradient was created
        # The backward pass in progress (autograd graph task): its rows and draw count once its
        # output lands in .grad (a pass of torch.autograd.grad(loss, x) never lands).
        self._task = None
        self._tasks: set = set()  # every pass whose backward reached the layer this step (kept through resets)
        self._pass_rows = 0
        self._pass_noised = False
        self._pass_landed: set = set()
        # Flat clipping: the books (one per forward) whose releases reached this layer's gradient
        # since it was created; every layer holding a contribution must hold the same books.
        self.books: set = set()
        self._pass_books: set = set()
        # Adaptive thresholds (bpclip_fast.adaptive): per threshold of this layer, the examples its
        # backward passes found unclipped, on the device; landed and restarted with the rows.
        self.counting = False
        self.counts = None
        self._pass_counts = None
        self.violations: list[tuple[str, str]] = []
        # Device bools, read at step() with one sync: "a gradient we restarted from was not zero",
        # "a gradient changed between two passes without a version change (a .data write)".
        self.edit_checks: list[torch.Tensor] = []
        self.reuse_checks: list[torch.Tensor] = []  # device flags: a sealed output changed in place (compiled)
        self._expected: dict[int, tuple] = {}      # param index -> record of .grad after our last write
        self._fingerprints: dict[int, torch.Tensor] = {}  # param index -> bits of .grad after a partial pass
        self._param_versions = None  # the parameters' versions at the step's first backward pass
        self.batch_rows = None       # callable: rows of the batch drawn for the step (set by the engine)
        self._produced: dict[int, tuple] = {}      # param index -> record of what our backward returned
        self._nodes = []
        self._node_of: dict = {}  # param index -> its hooked AccumulateGrad node
        self._handles = []
        self._ours = frozenset()  # ids of our hook handles (foreign hooks are any others)
        # param index -> weak reference to its AccumulateGrad node's pre-hook dict (ours and any other)
        self._node_prehooks: dict[int, object] = {}
        self._hooked = None
        self._draws = 0           # draws of this step handed out so far (take_draw)
        self._draw_landed = False  # a pass of this step landed a draw; clearing .grad does not undo it
        self._mixed = False        # some trainable gradients hold the layer's contribution, others not
        self._landed_open = False  # a pass of this step landed where the loop can read it (outside accumulate())
        self._draw_shown = False   # the pass's draw went to a landing pass outside accumulate() (its sum readable)
        self._dropped_draw = False  # a pass of this step took such a draw and never landed
        self.holder = None         # set by the engine: whether the loop is inside optimizer.accumulate()
        self._held: dict = {}      # param index -> the sum its passes computed inside accumulate() (held_grads)
        self._pass_held: dict = {}  # the same, of the pass in progress: joins _held when the pass lands
        self.on_refuse = None     # set by the engine: charges, discards and raises StepRefused
        self.after_backward = None  # DistributedRecorder under DDP
        self.on_new_pass = None     # set by the engine: refuses a backward after a second batch was drawn
        self._gate = PassGate()     # the engine's (shared with on_new_pass); this one never skips a call
        # Correlated noise (bpclip_fast.banded), set by the engine: the layer's rows, the row of the
        # step's batch, and the row made by this pass's draw until the backward returns it.
        self.band = None
        self.band_row = None
        self.band_std = None
        self._band_due = None
        self.budget = None          # set by the engine: raises PrivacyBudgetError unless a charge is covered
        self.std_span = None        # set by the engine: (σ, span), every std of the run in σΔ·span (engine.noise_range)
        self.checked_shape = None   # set by the engine: the max_input_shape whose Δ that range was checked at
        # integer_noise=True (bpclip_fast.integer_noise), set by the engine: the grid's bits g; the draw
        # of this pass is released into the tensors the backward returns (produced), not by the op.
        self.integer_bits = None
        self._integer_due = None
        self._integer_landed = False  # a pass of this step landed its release; clearing .grad does not undo it

    # ------------------------------------------------------------------ parameters and hooks
    @property
    def params(self):
        # Read through the module's parameter dict: Module.__getattr__ made this property a tenth
        # of the host time of a ViT step (it is asked ~20 times per layer per step). A weight that
        # is no longer a registered parameter is read as an attribute, as before.
        layer = self.layer
        if "_bp_slots" in layer.__dict__:  # a generic unit (bpclip_fast.generic): all of its parameters
            return list(layer._bp_params())
        ps = layer._parameters
        w = ps["weight"] if "weight" in ps else layer.weight
        b = ps["bias"] if "bias" in ps else getattr(layer, "bias", None)
        return [w] if b is None else [w, b]

    def _param(self, i):
        """``self.params[i]`` without building the list (asked by every gradient hook): the same
        reads, and the same error for a bias hook of a layer whose bias is gone."""
        layer = self.layer
        if "_bp_slots" in layer.__dict__:
            return layer._bp_params()[i]
        ps = layer._parameters
        w = ps["weight"] if "weight" in ps else layer.weight
        if i == 0:
            return w
        b = ps["bias"] if "bias" in ps else getattr(layer, "bias", None)
        if b is None or i != 1:
            raise IndexError("list index out of range")
        return b

    def _trainable(self, params=None):
        return tuple([p.requires_grad for p in (self.params if params is None else params)])  # no generator frame

    def _param_name(self, i) -> str:
        names = self.layer.__dict__.get("_bp_names")
        return f"{self.name}.{names[i] if names is not None else ('weight' if i == 0 else 'bias')}"

    # ------------------------------------------------------------------ the gradient's state
    def _grad_states(self, params=None):
        """Per parameter that trains or holds a gradient: 'none', 'ours' (exactly what we left) or
        'foreign'. (A layer frozen for a while keeps the gradient it holds: not a restart.)"""
        states = []
        expected = self._expected
        for i, p in enumerate(self.params if params is None else params):
            if not p.requires_grad and p.grad is None:
                continue
            g = p.grad
            if g is None:
                states.append((i, p, "none"))
                continue
            rec = expected.get(i)  # _same_tensor, inline: asked per parameter at every pass and step
            states.append((i, p, "ours" if rec is not None and rec[0]() is g and g._version == rec[1]
                           else "foreign"))
        return states

    def _restart(self) -> None:
        self.drop_held()
        self.rows = 0
        self.noised = False
        self.books = set()
        self.counts = None
        self._task = None

    def sync_with_grads(self, params=None) -> bool:
        """Brings the bookkeeping in line with the gradients as they are now. Returns True if the
        layer holds a contribution (its gradients are ours), False if it starts afresh."""
        states = self._grad_states(params)
        kinds = {k for _, _, k in states}
        self._mixed = False
        if kinds == _OURS:
            if self._fingerprints:  # only in steps of several passes
                for i, p, _ in states:
                    fp = self._fingerprints.pop(i, None)
                    if fp is not None:
                        self.edit_checks.append(fingerprint(p.grad).ne(fp))
            return True
        if "ours" in kinds:  # some gradients kept, others edited or dropped: no consistent state
            self.violations.append(("grad-edit", f"only some of {self.name}'s gradients were cleared or edited"))
            self._mixed = True
            return True
        for i, p, k in states:  # all None or edited: start afresh; an edited one must have been zeroed
            if k == "foreign":
                self.edit_checks.append(p.grad.ne(0).any())
                self._expected[i] = _record(p.grad)
        self._fingerprints.clear()
        self._restart()
        return False

    def params_moved(self, params=None) -> bool:
        """Whether a parameter changed since the step's first backward pass (records it then)."""
        versions = tuple([(p._version, p.data_ptr())  # data_ptr: a rebound p.data
                          for p in (self.params if params is None else params)])
        if self._param_versions is None:
            self._param_versions = versions
            return False
        return versions != self._param_versions

    # ------------------------------------------------------------------ called by the layer
    def _begin_pass(self, task) -> None:
        """The checks of a backward pass's first visit to this layer, in the order they always ran:
        re-hook what trains now, close the previous pass, the engine's once-per-pass checks, the
        parameters unmoved, the gradients as we left them. The parameters are read once for all of
        them (nothing between the checks can rebind them; install_hooks reads them itself,
        on_new_pass raises or returns). Per layer, not per pass: each layer's records
        must be read when its own backward starts, since code running earlier in the same pass (a
        hook on an activation) may still edit its gradient before then."""
        params = self.params
        trainable = tuple([p.requires_grad for p in params])
        if self._hooked != trainable:
            self.install_hooks()  # unfrozen within the step: hook what trains now
        # the last pass took a draw for a landing and never landed: a hook on the layer's node saw its
        # noised sum and dropped it (or the pass raised after the layer computed)
        self._dropped_draw = self._dropped_draw or (self._pass_noised and self._draw_shown)
        if self._pass_landed:
            self.close_pass(params)
        if self.on_new_pass is not None and self._gate.task != task:
            self.on_new_pass()
        if self.params_moved(params):
            self.refuse("param-edit", f"{self.name}'s parameters changed between backward passes of one step")
        self.sync_with_grads(params)
        self._task, self._pass_rows, self._pass_noised, self._pass_books = task, 0, False, set()
        self._pass_counts = None
        self._integer_due = None  # a draw whose tensors never reached produced() is not carried into a new pass
        self._pass_held = {}      # a pass that never landed (it raised on the way) adds nothing to the block's sum

    def begin_backward(self, rows: int, sensitivity: float, again_ok: bool = False):
        """``(seed, offset, std, d, scale)`` for one backward pass over ``rows`` example rows:
        clip at ``C/d``, add noise of std ``std`` (0: none), multiply ``[∇W, ∇b]`` by ``scale``.
        ``again_ok``: a second call of the layer in one pass is released with the first (flat's book)."""
        second = False
        if self.enforce:
            task = torch._C._current_graph_task_id()
            if task != self._task:  # a new backward pass (a second use of the layer in one pass is not)
                second = task in self._tasks  # the pass was current before: a reset in between
                self._begin_pass(task)
                self._tasks.add(task)
            else:
                second = True
            second = second and not again_ok
            self._pass_rows += int(rows)
            self._refuse_before_landing()
        else:
            self.rows += int(rows)
        if self.mean_loss_batch is None:
            d, scale = 1.0, 1.0
        else:
            # loss_reduction="mean": proof in bpclip_fast.engine (clip at C/d, noise σΔ/d, times d/B̄).
            d = float(max(int(rows), 1))
            scale = d / float(self.mean_loss_batch)
        if self.integer_bits is not None and self.enforce and self.key is not None and self.lands_now():
            if self._integer_landed or self._pass_noised:
                self._refuse_second_integer_backward()
            self._integer_landed = True
        if second:  # after the rules that name the case more closely (rows past the batch, integer passes)
            self._refuse_second_call()
        if self.noised or self._pass_noised or self.key is None:
            return 0, 0, 0.0, d, scale
        std = float(self.layer._bp_noise_multiplier) * float(sensitivity)
        if not (std >= 0 and math.isfinite(std)):
            raise ValueError(f"{self.name}: noise_multiplier must be finite and >= 0, got "
                             f"{self.layer._bp_noise_multiplier!r}")
        if self.band is None and not _ops.noise_std_ok(std / d):  # banded: σΔ/B̄, of no batch's size
            self._refuse_std(rows)
        if self.enforce:
            self._pass_noised = True
            self._draw_shown = self.lands_now() and not self.holding()  # its sum leaves the op as it is
        else:
            self.noised = True
        seed, offset = self.take_draw()
        if std == 0:
            return 0, 0, 0.0, d, scale
        if self.band is not None:  # the release goes out un-noised from the op; produced() makes w_t into it
            self._band_due = self._band_noise(self._band_std(std * scale / d))
            return 0, 0, 0.0, d, scale
        if self.integer_bits is not None:  # the op returns the clipped sum; produced() releases it through integers
            self._integer_due = integer_noise.Due(seed, offset, self.layer._bp_noise_multiplier, sensitivity,
                                                  self.integer_bits, self.mean_loss_batch or 1.0)
            return 0, 0, 0.0, d, scale
        return seed, offset, std / d, d, scale

    def take_draw(self):
        """``(seed, offset)`` of the next draw of this step: the step's own for the first, then a fresh
        one (:func:`redraw_seed`) each time a draw was taken and never landed (a pass that reached no
        ``.grad``, a refused step re-armed), or at ``step()`` for a gradient cleared after its draw
        landed (noise on zeros; a landing backward there is refused, :meth:`_refuse_before_landing`). Code
        outside ``step()`` may have seen a discarded draw's gradient: a fresh one keeps the two from
        sharing noise."""
        seed, offset = self.key
        k, self._draws = self._draws, self._draws + 1
        return (seed if k == 0 else redraw_seed(seed, offset, k)), offset

    def joined(self, book_id: int) -> None:
        """A flat release of book ``book_id`` reached this layer in the current pass."""
        if self.enforce:
            self._pass_books.add(book_id)

    def count(self, unclipped: torch.Tensor) -> None:
        """Adds this backward's unclipped examples (one entry per threshold of the layer) to the pass."""
        if self.enforce and self.counting:
            self._pass_counts = unclipped if self._pass_counts is None else self._pass_counts + unclipped

    def produced(self, grads) -> None:
        """Records the tensors the backward returns for (weight, bias), for the AccumulateGrad check;
        under correlated noise, first makes the row this pass drew into them; under integer noise,
        first releases this pass's draw into them (in place, before anything records them); then
        hands autograd zeros where the pass lands nothing and inside ``optimizer.accumulate()``
        (:meth:`~bpclip_fast.held_grads.HeldGrads.hand_over`)."""
        integer_due = self._integer_due
        if integer_due is not None:
            self._integer_due = None
            integer_noise.release(self.params, grads, integer_due)
        due = self._band_due
        if due is not None:
            self._band_due = None
            row, std = due
            if self.band.made(row):  # made meanwhile (a fallback or a charge): never release it un-noised
                self._refuse_redraw(row)
            if self._reaches_grad():
                self.make_band(row, std, grads)
        if not self.enforce:
            return
        self.hand_over(grads)  # inside accumulate() and for a pass that lands nothing here: zeros
        for i, g in enumerate(grads):
            if g is not None:
                self._produced[i] = _record(g)

    def seal_produced(self) -> None:
        """Adds the bits' fingerprint to the records of what this backward produced, for the compiled
        path (:mod:`bpclip_fast.compiled`): there the traced graph, not autograd, adds the gradient of a
        plain use of the weight to our op's output, and inductor writes that sum into our output's
        buffer in place (``buf6 = buf3  # reuse``): the same tensor object at the same version."""
        for i, rec in list(self._produced.items()):
            t = rec[0]()
            if t is not None and len(rec) == 2:
                self._produced[i] = (*rec, fingerprint(t))

    def check_budget(self, what: str) -> None:
        """Before anything that may end in a charged refusal: the engine's budget must cover the charge
        (else ``PrivacyBudgetError``, not charged; engine ``_budget_covers``)."""
        if self.budget is not None:
            self.budget(f"{what} ({self.name})")

    def refuse(self, rule: str, details: str) -> None:
        """A refusal found inside a forward (the input is larger than the fixed Δ allows)."""
        if self.on_refuse is not None:
            self.on_refuse(rule, details, [self.name])

    # ------------------------------------------------------------------ called at the step boundary
    def arm(self, key) -> None:
        """This step's draw; a new step starts with no rows counted and the draw pending. Re-armed
        for the same step (after a refusal), the draws already handed out stay taken: the next
        batch gets a fresh draw, never one a refused batch's gradient held."""
        if self.enforce and self._hooked != self._trainable():
            self.install_hooks()  # a parameter was frozen or unfrozen since: hook what trains now
        same_step = key == self.key
        self.key = key
        self._restart()
        self.violations.clear()
        self.edit_checks.clear()
        self.reuse_checks.clear()
        self._produced.clear()
        self._fingerprints.clear()
        self._param_versions = None
        if not same_step:
            self._draws = 0
        self._pass_landed = set()
        self._band_due = None
        self._integer_due = None
        self._integer_landed = False
        self._draw_landed = False
        self._landed_open = False
        self._tasks = set()
        self._pass_noised = False
        self._draw_shown = False
        self._dropped_draw = False

    def cleared(self) -> None:
        """The private optimizer's zero_grad just cleared (or zeroed) this layer's gradients (held ones
        too: what it held inside ``accumulate()``)."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._expected[i] = _record(p.grad)
        self._restart()

    def record_released(self) -> None:
        """After a release: the gradients as they are now are public; accumulating onto them later is
        post-processing of a release."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._expected[i] = _record(p.grad)

    def discard(self) -> None:
        self._band_due = None
        self.drop_held()
        for p in self.params:
            p.grad = None
        self._expected.clear()
        self._produced.clear()
