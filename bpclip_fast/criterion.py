"""The loss must not couple the examples of a batch: the probe of ``make_private(..., criterion=loss_fn)``.

Why. Every clipping mode clips, for each example ``i``, the gradient of the *total* loss with
respect to example ``i``'s rows (its output, its layer inputs): ``∂L/∂out_i``. The per-example bound
``Δ`` (DESIGN.md §5) holds when that gradient is a function of example ``i`` alone, that is when
``L = s·Σ_i ℓ(out_i, target_i)`` with ``s = 1`` (``loss_reduction="sum"``) or ``s = 1/B``
(``"mean"``). A loss that couples examples — InfoNCE with negatives from the batch (even against
a frozen, public encoder of the paired data), hard-example mining (the top-k per-example losses), a
class-weighted mean (its normaliser ``Σ_i w[y_i]``) — makes ``∂L/∂out_i`` depend on example ``j``:
removing ``j`` then moves every other example's clipped contribution, and one example moves the
release by more than ``Δ`` (``tests/test_coupled_loss.py`` measures 1.2–1.4·C in float64 for
InfoNCE and top-k under flat clipping).

What the probe checks. ``criterion_problems`` calls the criterion as a training loop would,
``criterion(model(*inputs), *targets)`` with the batch split by :func:`bpclip_fast.batches.split_batch`
(the label last, or ``batch_inputs`` leading model inputs), on a probe batch of ``B`` rows shaped like the loader's first
batch (the loader's ``batch_size`` rows, at least 3, at most ``MAX_ROWS``): the model runs on a
copy, without gradients, on seeded random inputs (integer tensors such as token indices kept, as
in :mod:`bpclip_fast.validate`); floating-point targets are seeded random normals, and integer
targets shaped like class labels of an output (its shape without the last dimension, or without
dimension 1 for per-pixel logits) seeded random classes below the fewest classes they fit: the
verdict then depends on no private label. Integer targets of any other shape are kept (the verdict may then depend on them: a
diagnostic of ``make_private``, not covered by ε). At this point and at two more — the first, then the last example's input
and target changed — it compares the criterion on the batch with the criterion on each example
alone (batches of one; Poisson batches of one occur, so the criterion must accept them):

1. value: ``L(batch) = s·Σ_i L(example i)``;
2. gradient: ``∂L(batch)/∂out_i = s·∂L(example i)/∂out_i`` for every example ``i`` and every
   output tensor with one row per example.

Where the batch's value and gradients are finite, each example's alone must be too (a separable
criterion's terms are the batch's): batch statistics (logits standardised over the batch, whose std
over one row is NaN) would otherwise leave the comparison without a verdict and the loss accepted.

At every point, (2) says that example ``i``'s output gradient is its own; across points, that it
did not change when another example's output or target did. Both are evaluated in float64 where
the criterion accepts it (an ``nn.Module`` criterion is copied and converted), else in the model's
dtype. Tolerance: ``√u`` relative to the scale of both sides (``u`` the unit roundoff). A separable
criterion computes each term by the same operations on the same numbers in both evaluations, so
the two sides differ by rounding only: ``k·u`` relative for ``k`` operations per term (recursive
summation), below ``√u`` for ``k`` up to ``u^(-1/2)`` (6.7·10⁷ in float64, 4096 in float32). A
coupled loss at random values moves them by their own size.

What it cannot see (the loop's responsibility, README "What a training loop may do within a
step"): a loss coupled only at values the three probe points do not reach (a branch on the batch
size above ``MAX_ROWS`` rows, a top-k with ``k`` at least the probe's rows, a tie-break, labels the
first batch's rows lack: a class weight of a class absent from the probe rows), a criterion whose
values are not finite on the probe batch (no verdict), a criterion that draws random numbers, an
``ignore_index`` or other special label value (random classes never take it), and
above all a loss the loop computes without the criterion it passed — the engine never sees the
loss of a step. Nothing is re-checked at run time: a check of the actual batch would need ``B``
extra evaluations and a device sync per step, its verdict would depend on the private values, and
a loop could still bypass it.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from . import batches as _batches, validate as _v

__all__ = ["criterion_problems", "MAX_ROWS"]

# The probe evaluates the criterion once per row and point: its rows are capped so that a criterion
# holding a large frozen network (a perceptual loss) stays affordable at make_private.
MAX_ROWS = 256

_RULE = "(rule: coupled loss)"
_ADVICE = ("the per-example bound assumes each example's loss depends on that example alone; use a loss "
           "that is a sum (loss_reduction='sum') or plain mean ('mean') of per-example terms, and for "
           "contrastive learning take the negatives from public data or from outside the batch (a "
           "memory bank of public examples), never from the other examples of the batch")


def _random_classes(targets, output, seed: int):
    """``targets`` with every integer tensor shaped like class labels of one of ``output``'s
    floating-point tensors replaced by seeded random classes: the labels of the loader's first batch
    are private, and the probe's verdict must not depend on them. Labels of ``[B, ..., K]`` logits
    have its shape without the last dimension, those of ``[B, K, d1, ...]`` logits (torch's
    cross-entropy layout: per-pixel classes) its shape without dimension 1. The classes are drawn
    below the fewest classes among all outputs the labels fit (a model may return features before
    its logits: classes of the features' width would index past the logits). Other integer tensors
    are returned as they are."""
    floats = [t for t in _v._tensors(output) if t.is_floating_point() and t.dim() >= 2]
    generator = torch.Generator().manual_seed(seed)

    def classes(shape):
        fits = [t.shape[-1] for t in floats if tuple(t.shape[:-1]) == shape]
        fits += [t.shape[1] for t in floats if tuple(t.shape[:1] + t.shape[2:]) == shape]
        return min(fits, default=0)

    def draw(t: torch.Tensor) -> torch.Tensor:
        k = 0 if t.is_floating_point() or t.dtype == torch.bool else classes(tuple(t.shape))
        if k < 1:
            return t
        return torch.randint(0, k, tuple(t.shape), generator=generator).to(t.device, t.dtype)

    return _v._map_tensors(targets, draw)


def _change_row(obj, row: int, seed: int):
    """``obj`` with example ``row`` changed: floating-point values drawn afresh, integer values (labels)
    replaced by the first other row's value that differs (a value the data has, so it stays valid)."""
    generator = torch.Generator().manual_seed(seed)

    def change(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        t = t.clone()
        if t.is_floating_point():
            t[row] = _v._random_like(t.shape[1:], t, generator)
        else:
            for other in range(t.shape[0]):
                if not torch.equal(t[other], t[row]):
                    t[row] = t[other]
                    break
        return t

    return _v._map_tensors(obj, change)


def _outputs(model: nn.Module, probe_input) -> object:
    """The model's output on ``probe_input``, detached (the probe differentiates the criterion only)."""
    with torch.no_grad():
        out = _v._call(model, probe_input)
    return _v._map_tensors(out, lambda t: t.detach())


class _Evaluation:
    """The criterion at one point: its value on the batch and on each example alone, with the gradients
    with respect to the output tensors that have one row per example."""

    def __init__(self, criterion, dtype):
        self.criterion, self.dtype = criterion, dtype

    def _cast(self, obj):
        return _v._map_tensors(obj, lambda t: t.to(self.dtype) if t.is_floating_point() else t)

    def value_and_grads(self, output, targets, batch: int):
        output, targets = self._cast(output), self._cast(targets)
        leaves = []

        def leaf(t: torch.Tensor) -> torch.Tensor:
            if t.is_floating_point() and t.dim() > 0 and t.shape[0] == batch:
                t = t.detach().clone().requires_grad_()
                leaves.append(t)
            return t

        output = _v._map_tensors(output, leaf)
        with torch.enable_grad():
            loss = self.criterion(output, *targets)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise _NotScalar(loss)
            grads = (torch.autograd.grad(loss.reshape(()), leaves, allow_unused=True)
                     if leaves and loss.requires_grad else [None] * len(leaves))
        grads = [torch.zeros_like(x) if g is None else g.detach() for x, g in zip(leaves, grads)]
        return loss.detach().reshape(()).double(), [g.double() for g in grads]


class _NotScalar(Exception):
    def __init__(self, value):
        super().__init__(value)
        self.value = value


def _float64_criterion(criterion):
    """The criterion evaluated in float64: a copy converted with ``.double()`` for an ``nn.Module`` (its
    frozen parameters too), the function itself otherwise (it may refuse float64 inputs)."""
    if isinstance(criterion, nn.Module):
        try:
            return copy.deepcopy(criterion).double()
        except Exception:  # noqa: BLE001 - a module that cannot be copied: evaluate it as it is
            return criterion
    return criterion


def _point_problem(evaluation: _Evaluation, output, targets, batch: int, scale: float, reduction: str,
                   label: str) -> str | None:
    """The comparison at one point (module docstring, checks 1 and 2); a message or None."""
    total, grads = evaluation.value_and_grads(output, targets, batch)
    singles, single_grads = [], [[] for _ in grads]
    for i in range(batch):
        rows = torch.tensor([i])
        def row(t: torch.Tensor, rows=rows) -> torch.Tensor:
            return t[rows.to(t.device)] if t.dim() > 0 and t.shape[0] == batch else t

        one, one_targets = _v._map_tensors(output, row), _v._map_tensors(targets, row)
        value, gs = evaluation.value_and_grads(one, one_targets, 1)
        singles.append(value)
        for k, g in enumerate(gs):
            single_grads[k].append(g)
    singles = torch.stack(singles)
    values = [total, *[float(g.abs().max()) for g in grads if g.numel()]]
    if not all(math.isfinite(float(v)) for v in values):
        return None  # not finite on the probe batch: no verdict (module docstring)
    alone = [*singles.tolist(), *[float(g.abs().max()) for gs in single_grads for g in gs if g.numel()]]
    if not all(math.isfinite(float(v)) for v in alone):
        # A separable criterion finite on the batch is finite on each of its terms: this one uses
        # batch statistics (a std over one row is NaN) or cannot take the Poisson batches of one.
        return (f"criterion{label}: finite on a probe batch of {batch} examples but not on an example alone "
                f"(batch statistics, such as logits standardised over the batch?) {_RULE}; its value or output "
                f"gradient depends on the other examples, and Poisson sampling draws batches of one; {_ADVICE}")
    u = math.sqrt(torch.finfo(evaluation.dtype).eps / 2)
    expect = scale * float(singles.sum())
    tol = u * (abs(float(total)) + scale * float(singles.abs().sum()))
    if abs(float(total) - expect) > tol:
        hint = ""
        other = ({"sum": 1.0 / batch, "mean": 1.0}[reduction]) * float(singles.sum())
        if abs(float(total) - other) <= tol:
            hint = (f" (it equals the {'mean' if reduction == 'sum' else 'sum'} of its per-example values: pass "
                    f"loss_reduction={'mean' if reduction == 'sum' else 'sum'!r}, the reduction the criterion has)")
        return (f"criterion{label}: its value on a probe batch of {batch} examples is {float(total):.6g}, not the "
                f"{'sum' if reduction == 'sum' else 'mean'} of its values on each example alone "
                f"({expect:.6g}){hint} {_RULE}; one example then changes the loss of the others and moves their "
                f"clipped contributions, beyond the bound the noise is scaled to; {_ADVICE}")
    for g, gs in zip(grads, single_grads):
        own = scale * torch.cat(gs)
        if float((g - own).norm()) > u * (float(g.norm()) + float(own.norm())):
            return (f"criterion{label}: an example's output gradient differs from the gradient of its own loss "
                    f"alone on a probe batch of {batch} examples {_RULE}; ∂loss/∂output_i depends on other "
                    f"examples' outputs or targets, so every example's clipped contribution moves with the others; "
                    f"{_ADVICE}")
    return None


def criterion_problems(model: nn.Module, first_batch, criterion, loss_reduction: str,
                       rows: int = 3, *, batch_inputs: int | None = None) -> list[str]:
    """Problems of ``criterion`` (rule *coupled loss*, module docstring) on a probe batch shaped like
    ``first_batch`` (one collated batch of the loader, split into model inputs and targets by
    :func:`bpclip_fast.batches.split_batch` with ``batch_inputs``) with ``rows`` examples (clamped to ``[3, MAX_ROWS]``). The model, its buffers, modes and gradients and
    the global random number generators are left as they were. A model or criterion that fails on the
    probe batch is reported as a problem."""
    if not callable(criterion):
        return [f"make_private: criterion must be callable as criterion(output, target), got "
                f"{type(criterion).__name__}"]
    try:
        example_input, targets = _batches.split_batch(first_batch, batch_inputs)
    except ValueError as exc:
        return [str(exc)]
    batch = min(max(int(rows), 3), MAX_ROWS)
    index = torch.arange(batch)
    with _v._isolated(model) as work, _v._as_torch_layers(work), \
            torch.random.fork_rng(devices=_v._cuda_devices(work)):
        work.train()
        _v._seed(_v._cuda_devices(work))
        try:
            probe_input = _v._rows_of(example_input, index, _v._SEED, "the first batch")
            base_output = _outputs(work, probe_input)
            probe_targets = _random_classes(_v._rows_of(targets, index, _v._SEED + 101, "the first batch"), base_output,
                                           _v._SEED + 151)
            points = [(base_output, probe_targets, "")]
            for row in (0, batch - 1):
                changed_input = _change_row(probe_input, row, _v._SEED + 1 + row)
                points.append((_outputs(work, changed_input), _change_row(probe_targets, row, _v._SEED + 201 + row),
                               f" (example {row} changed)"))
        except Exception as exc:  # noqa: BLE001
            return [f"criterion: could not build its probe batch of {batch} examples from the loader's first batch "
                    f"(the model failed on it: {exc!r}; {_batches.describe(first_batch, batch_inputs)}); the "
                    "criterion is checked on the model's outputs"]
        scale = 1.0 if loss_reduction == "sum" else 1.0 / batch
        try:
            evaluation = _Evaluation(_float64_criterion(criterion), torch.float64)
            try:
                evaluation.value_and_grads(*points[0][:2], batch)
            except _NotScalar:
                raise
            except Exception:  # noqa: BLE001 - a function holding float32 tensors: evaluate in the model's dtype
                dtype = next((t.dtype for t in _v._tensors(points[0][0]) if t.is_floating_point()), torch.float32)
                evaluation = _Evaluation(criterion, dtype)
            for output, point_targets, label in points:
                problem = _point_problem(evaluation, output, point_targets, batch, scale, loss_reduction, label)
                if problem:
                    return [problem]
        except _NotScalar as exc:
            shape = f" of shape {tuple(exc.value.shape)}" if isinstance(exc.value, torch.Tensor) else ""
            return [f"criterion: returned {type(exc.value).__name__}{shape} on the probe batch, not the scalar loss "
                    "of the batch; reduce it over the examples (sum or mean, as loss_reduction declares)"]
        except Exception as exc:  # noqa: BLE001
            return [f"criterion: failed on the probe batch or on a batch of one example ({exc!r}); Poisson "
                    "sampling draws batches of any size, one included, so the criterion must accept them"]
    return []
