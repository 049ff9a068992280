"""The rules a private step is checked against, and the error that names the one it broke.

One home for each rule's two halves — what the guarantee assumes, and what the training loop should
do instead — so that every refusal, wherever it is raised (the step boundary, the engine, a layer's
forward), says both the same way (:mod:`bpclip_fast.boundary`, module docstring: which refusals are
charged)."""

from __future__ import annotations

__all__ = ["RULES", "StepRefused", "edited"]

# rule -> what it protects and what to do instead (the second half of every message).
RULES = {
    "rows": ("each example reaches each clipped layer's backward exactly once per step",
             "run one backward per micro-batch of the step's batch (no retain_graph second loss, no batch fed "
             "twice), use a separate layer for each use, and keep every layer on all rows of the batch in the "
             "example dimension (no masking, flatten(0, 1) or sequence-first [T, B, d] layouts)"),
    "grad-edit": ("a clipped layer's gradient is exactly the sum of its own backward passes plus one noise draw",
                  "do not edit .grad of a private model except by zeroing it or setting it to None (zero_grad); "
                  "transform gradients inside the optimizer instead"),
    "weight-reuse": ("a clipped parameter receives gradient only from its own clipped layer",
                     "do not use a clipped layer's weight in other code (tied weights: use separate layers) and do "
                     "not register tensor hooks on private parameters"),
    "batches": ("each step uses exactly one batch of the private loader (the accountant charges one sampled "
                "batch per step)",
                "call optimizer.step() once per batch drawn; split a batch into micro-batches for accumulation"),
    "param-edit": ("the parameters do not change within a step: every backward pass of a step sees the same "
                   "weights, and only DPOptimizer.step() updates them",
                   "update the weights only through the private optimizer's step() (no manual updates, no stepping "
                   "optimizer.original_optimizer, no SAM/lookahead-style perturbation between backward passes)"),
    "captured": ("a private parameter's gradient leaves the backward only through .grad, which step() verifies",
                 "use backward() and let step() release the gradients; torch.autograd.grad is fine with respect to "
                 "inputs (adversarial examples), not to private parameters"),
    "converted": ("each private parameter's gradient is verified at the tensor make_private hooked",
                  "convert or move the model (model.to(dtype or device), .half(), .double(), .cuda()) before "
                  "make_private, not after, and do not assign a tensor of another dtype or device to a "
                  "parameter's .data"),
    "unclipped-param": ("only parameters of clipped layers are trained",
                        "freeze the parameter (requires_grad_(False)) or make the model private with it trainable "
                        "so that its layer is clipped"),
    "max-shape": ("the sensitivity Δ (and the noise std) is fixed at make_private and does not depend on the data",
                  "pad or truncate inputs to at most the declared max_input_shape, or make the model private with "
                  "a larger max_input_shape"),
    "bounds": ("the clipping bounds are the ones the noise is scaled to (fixed at make_private)",
               "do not change the clipping after make_private (attach_flat, thresholds); make a fresh model "
               "private with the bounds you want"),
    "grad-scaler": ("each example's gradient is clipped at max_grad_norm under noise σ·max_grad_norm, and no step is "
                    "skipped because of the data",
                    "use torch.autocast(dtype=torch.bfloat16), which needs no scaler (non-finite examples get clip "
                    "factor 0 with nonfinite='drop'), and call optimizer.step() without a GradScaler"),
    "banded-redraw": ("under correlated noise each step's noise row is drawn once per layer and released once",
                      "take one backward per step (or micro-batches inside optimizer.accumulate(), without zero_grad "
                      "between them), and do not "
                      "clear a layer's gradient between its backward and step()"),
    "redraw": ("each clipped layer's noise is drawn once per step and the batch released once",
               "take one backward per step (or micro-batches inside optimizer.accumulate(), without zero_grad between "
               "them) and do not clear a "
               "layer's gradient between its backward and step(); for an adversarial example's input gradient use "
               "torch.autograd.grad(loss, x), which lands nothing in .grad"),
    "accumulate": ("a step's gradient is readable once, after all of its backward passes: only the first adds the "
                   "noise",
                   "run the step's micro-batches inside `with optimizer.accumulate():` (their gradients are held "
                   "until the block ends), or take one backward per step"),
    "integer-passes": ("under integer noise each clipped layer's backward runs once per step, and its release is the "
                       "step's whole clipped sum",
                       "take one backward pass per step over the whole batch (one loss, one backward); to accumulate "
                       "micro-batches use integer_noise=False"),
    "nonfinite": ("strict non-finite mode: no example may be non-finite",
                  "clean the data, or use nonfinite='drop' (the default), which gives such examples clip factor 0"),
}


def edited(name: str) -> str:
    """The ``grad-edit`` details for a gradient found changed other than by zeroing or its backward
    (the pass that finds it and ``step()`` say it alike)."""
    return f"{name}'s gradient was changed (not zeroed, not by its backward) between its backward passes"


class StepRefused(RuntimeError):
    """A private step that could not be released. ``rule`` names the broken assumption (see
    :data:`RULES`), ``layers`` the layers or parameters concerned, ``charged`` whether the accountant
    was stepped for it (module docstring: every StepRefused is charged when an accountant exists)."""

    def __init__(self, rule: str, details: str, layers=(), charged: bool = True):
        why, instead = RULES[rule]
        names = ", ".join(layers) if layers else "the model"
        super().__init__(f"step refused ({rule}): {details} [{names}]. The privacy guarantee assumes that {why}; "
                         f"{instead}. Nothing was released"
                         + (" and the step was charged to the accountant." if charged else "."))
        self.rule, self.details, self.layers, self.charged = rule, details, list(layers), charged
