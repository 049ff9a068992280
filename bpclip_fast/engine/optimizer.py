"""``DPOptimizer``: the wrapped optimizer, whose ``step()`` is one step of the privacy analysis
(module docstring of :mod:`bpclip_fast.engine`), in named phases."""

from __future__ import annotations

import torch

from ..graph_nodes import untraced
from . import accumulation, budget, checkpoint, guards, refusal, thresholds
from ._common import NO_PICKLE, accounting
from .verify import fallback_noise, verify


class DPOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer; ``step()`` is one step of the privacy analysis (see the module docstring).

    Delegates ``param_groups``, ``state``, ``defaults`` to ``original_optimizer``, so learning-rate
    schedulers work. ``state_dict()`` also holds the engine's state (accountant, counters, seed).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, engine):
        # torch.optim.Optimizer.__init__ is deliberately not called: the wrapped optimizer owns the state.
        self.original_optimizer = optimizer
        self.engine = engine

    # -- delegation
    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.original_optimizer.param_groups = value

    @property
    def state(self):
        return self.original_optimizer.state

    @state.setter
    def state(self, value):
        self.original_optimizer.state = value

    @property
    def defaults(self):
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.original_optimizer.defaults = value

    def add_param_group(self, param_group):
        raise RuntimeError("DPOptimizer: parameter groups cannot be added after make_private (they would be "
                           "trained without clipping or noise); build the optimizer with all of them first")

    def __getstate__(self):
        raise TypeError(NO_PICKLE.format("DPOptimizer"))

    def __repr__(self):
        return f"DPOptimizer({self.original_optimizer!r})"

    def state_dict(self):
        return checkpoint.optimizer_state(self)

    def load_state_dict(self, state_dict):
        checkpoint.load_optimizer_state(self, state_dict)

    @untraced
    def zero_grad(self, set_to_none: bool = True):
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        guards.after_zero_grad(self.engine)

    def accumulate(self):
        """``with optimizer.accumulate():`` around the backward passes of one step's micro-batches. Inside
        it ``.grad`` stays unset (``None``) while the engine holds what the passes land; at its end the
        whole step's gradient is in ``.grad``, as one backward over the batch would leave it. Outside it
        a second landing backward in a step is refused (rule ``accumulate``): reads of ``.grad``
        between micro-batches would show their clipped sums without noise."""
        return accumulation.accumulating(self.engine)

    # torch.amp.GradScaler then leaves the gradients alone and hands itself to step(grad_scaler=...),
    # which refuses it before anything is released (its own unscale_ would edit the noised gradients).
    _step_supports_amp_scaling = True

    # -- the step
    @untraced
    def step(self, closure=None, grad_scaler=None):
        """The step boundary: every check passes before anything is released; a refusal discards
        the step (``StepRefused``, charged unless it cannot depend on the data)."""
        accumulation.refuse_step_inside(self.engine)
        if grad_scaler is not None:
            self._refuse_grad_scaler()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_budget()
        self._check_batches()
        pending = self._verify()
        self._fallback_noise(pending)
        new_thresholds = self._propose_thresholds()
        self._inner_step()
        self._charge()
        self._adapt_thresholds(new_thresholds)
        self._rearm()
        return loss

    def _refuse_grad_scaler(self):
        """GradScaler: refused, before anything is released by the step. Charged when a batch was
        drawn: the noise is added in the backward, so the batch's noised gradient was in ``.grad``
        (readable by the loop) before the scaler called ``step()``; uncharged, a loop that reads it and
        catches the refusal would get every batch's release for free."""
        self._check_budget()  # first: the refusal below may be charged
        drawn = budget.drawn(self.engine)
        refusal.refuse(self.engine, [(
            "grad-scaler",
            "torch.amp.GradScaler is not supported: it multiplies the loss by its scale before the backward, so "
            "each example's gradient would be clipped at max_grad_norm/scale while the noise stays at "
            "σ·max_grad_norm, and it skips steps whose gradients overflow, a decision that depends on the data"
            + ("; the backward passes of the batch drawn already ran (their noised gradients were in .grad), so "
               "the step is charged" if drawn else ""), [])], charged=drawn > 0)

    def _check_budget(self):
        """Before anything charged: a step the budget cannot hold is refused, uncharged (the loader's
        gate keeps the batches delivered within it)."""
        engine = self.engine
        if budget.covers(engine):
            return
        eps_now = engine.get_epsilon(engine.delta)
        refusal.discard(engine, self.original_optimizer)
        raise accounting().PrivacyBudgetError(
            f"DPOptimizer.step() refused: after this step ε would exceed max_epsilon={engine.max_epsilon:g} at "
            f"δ={engine.delta:g} (spent so far: ε={eps_now:.4g} over {engine.steps} steps). The gradients of this "
            "step were discarded and nothing was updated.")

    def _check_batches(self):
        """Exactly one batch drawn since the last step: more were drawn and may have been used
        (charged, one step each); none depends only on the loop (not charged)."""
        engine = self.engine
        delivered = budget.drawn(engine)
        if delivered > 1:
            refusal.refuse(engine, [("batches", f"{delivered} batches were drawn from the private data loader "
                                     "since the last step", [])])
        if delivered != 1:
            refusal.discard(engine, self.original_optimizer)
            raise RuntimeError(
                f"DPOptimizer.step(): {delivered} batches were drawn from the private data loader since the last "
                "step; every step must use exactly one (the accountant assumes one fresh sampled batch per step). "
                "To accumulate gradients, split one batch into micro-batches (with optimizer.accumulate(): for x_mb "
                "in x.split(m): loss(model(x_mb)).backward()) and step once; for a larger batch raise the loader's batch_size. "
                "The gradients of this step were discarded (this refusal depends only on the loop, not on the "
                "data, and is not charged).")

    def _verify(self):
        """Every rule of the step boundary (:func:`verify.verify`); any problem refuses the step."""
        problems, pending = verify(self.engine, self.original_optimizer)
        if problems:
            refusal.refuse(self.engine, problems)
        return pending

    def _fallback_noise(self, pending):
        """Draw ``t`` for the layers whose gradient does not hold it."""
        fallback_noise(self.engine, pending)

    def _propose_thresholds(self):
        """Adaptive thresholds: the next values from this step's noisy counts (``None`` when fixed),
        computed before the release so that nothing after it can fail half-way."""
        return thresholds.proposed(self.engine)

    def _adapt_thresholds(self, new_thresholds):
        """The proposed thresholds become the layers' bounds for the next step."""
        thresholds.adopt(self.engine, new_thresholds)

    def _inner_step(self):
        """The release: the wrapped optimizer applies the clipped, noised gradients."""
        self.original_optimizer.step()

    def _charge(self):
        """The accountant is charged for the step, and the step counter (the noise key) advances."""
        budget.charge(self.engine)
        self.engine._steps += 1

    def _rearm(self):
        """A fresh step: the batch count restarts, each layer records what it released and is armed
        with draw ``t + 1``."""
        engine = self.engine
        engine._delivered_at_step = engine._counter.delivered
        for st in engine._steps_of:
            st.record_released()
        engine._arm()
