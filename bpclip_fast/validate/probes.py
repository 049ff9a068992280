"""The dynamic probes' rules 1 to 4 (example rows, batch independence, buffers, gradient
ownership), each reading the records of one or two passes.

Apart from the passes so that each rule's tolerance sits next to its proof and its message; rule 5
(reuse) is in forward.py, shared with the engine's one-example probe.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import registry
from .probe_input import _perturbed
from .probe_pass import _Call, _Pass, _trainable_layers


def _example_rows_problems(reference: _Pass, batch: int, labels: dict[str, str],
                           reported: set[str] = frozenset()) -> list[str]:
    """Probe 1: every trainable layer's input has the probe's examples as its first dimension (an
    Embedding's index of one shared row after its expansion, :mod:`bpclip_fast.broadcast`).
    ``reported``: layers whose expansion was refused already, with the same advice."""
    problems, reported = [], set(reported)
    for c in reference.calls:
        if c.input is None or c.name in reported or (c.input.dim() > 0 and c.input.shape[0] == batch):
            continue
        reported.add(c.name)
        first = c.input.shape[0] if c.input.dim() else "none"
        problems.append(
            f"{labels[c.name]}: its input has shape {tuple(c.input.shape)}, whose first dimension ({first}) is not "
            f"the {batch} examples of the probe batch (rule: example rows); the layer clips each row of its first "
            "dimension as one example, so an example spread over several rows gets the bound once per row (or one "
            "row holds several examples); keep the examples in the first dimension: a Linear takes [B, *, d] "
            "directly (no flatten(0, 1) of the batch), and sequences stay batch-first ([B, T, d], not [T, B, d])"
            + (_BROADCAST_HINT if first == 1 and c.input.dim() > 1 and not c.input.is_floating_point() else ""))
    return problems + _unit_rows_problems(reference, batch, labels)


def _unit_rows_problems(reference: _Pass, batch: int, labels: dict[str, str]) -> list[str]:
    """Probe 1 for the generic units: the path clips row ``i`` along each input's and output's batch
    dimension as example ``i`` (:func:`bpclip_fast.generic.batch_dims`); each must hold the probe's
    examples there. At training time a unit's backward sees only sizes, and a position or feature
    dimension equal to the batch size passes it."""
    problems, reported = [], set()
    advice = ("the generic exact path clips row i of the batch dimension (dimension 0; 1 for modules with "
              "batch_first=False and for a recurrent layer's final states) of the module's first tensor input and "
              "of every output as example i; keep the examples there (return [B, ...] outputs from a batch-first "
              "module; add a tensor without examples, such as a position table, to the examples' tensor inside "
              "the module rather than returning it)")
    for u in reference.units:
        if u.name in reported:
            continue
        if u.error is not None:
            why = u.error
        elif u.rows != batch:
            why = f"its input's batch dimension has {u.rows} rows, not the {batch} examples of the probe batch"
        else:
            bad = [(shape, d) for shape, d, got in u.outputs if got and (len(shape) <= d or shape[d] != batch)]
            if not bad:
                continue
            shape, d = bad[0]
            why = (f"its output of shape {shape} does not hold the {batch} examples of the probe batch in its batch "
                   f"dimension {d}")
        reported.add(u.name)
        problems.append(f"{labels[u.name]}: {why} (rule: example rows); {advice}")
    return problems


# An index tensor of one row in a batch of B that private training cannot look up per example
# (bpclip_fast.broadcast: the expansion refused by validate.shared_index, or the call's rows unknown):
# broadcast after the lookup, its gradient arrives summed over the examples.
_BROADCAST_HINT = ("; an index of one row broadcast over the batch (Hugging Face's position_ids [1, T]) must be "
                   "given per example: pass it expanded to the batch, e.g. model(input_ids, "
                   "position_ids=torch.arange(T).expand(B, T))")


# Probe 2 compares the other examples' values between two passes that differ in one example. Both
# passes run the same kernels on tensors of the same shapes (and the same dropout masks), and a
# GEMM or convolution computes each row from that row alone, so the other rows would be bitwise
# equal but for the summation order, which may depend on memory alignment (CPU BLAS) or on atomics
# (GPU backward): a difference of a few rounding errors of the tensor's largest entry. An example
# that really reaches another one moves it by a fraction 1/B of its scale (B is small here).
_ROW_TOLERANCE = 64  # in units of the dtype's machine epsilon, relative to the tensor's largest entry


def _rows_differ(a: torch.Tensor | None, b: torch.Tensor | None, changed_row: int, batch: int) -> bool:
    """Whether any row but ``changed_row`` of ``a`` and ``b`` differs beyond rounding."""
    if a is None or b is None:
        return (a is None) != (b is None)
    if a.shape != b.shape:
        return True
    if a.dim() == 0 or a.shape[0] != batch or a.numel() == 0:
        return False  # rows that are not examples: probe 1 reports the layer
    if not a.is_floating_point():
        a, b = a.long(), b.long()
    diff = (a - b).abs()
    diff[changed_row] = 0
    tolerance = _ROW_TOLERANCE * torch.finfo(a.dtype).eps * torch.maximum(a.abs().max(), b.abs().max()) \
        if a.is_floating_point() else 0
    return bool(diff.max() > tolerance)


def _mixing_problems(probe_input, reference: _Pass, batch: int, run, labels: dict[str, str]) -> list[str]:
    """Probe 2: changing one example (the first, then the last) changes nothing of the other examples."""
    found: dict[tuple[int, int], tuple[str, str]] = {}  # (call index, 0 input / 1 gradient) -> (layer, what)
    output_mixes = False
    for row in sorted({0, batch - 1}):
        changed = run(_perturbed(probe_input, row), batch)
        for index, (a, b) in enumerate(zip(reference.calls, changed.calls)):
            if a.name != b.name:  # another example decided which layers run
                found.setdefault((index, 0), (a.name, "input"))
                break
            if _rows_differ(a.input, b.input, row, batch):
                found.setdefault((index, 0), (a.name, "input"))
            if _rows_differ(a.grad, b.grad, row, batch):
                found.setdefault((index, 1), (a.name, "output gradient"))
        output_mixes |= len(reference.outputs) != len(changed.outputs) or any(
            _rows_differ(a, b, row, batch) for a, b in zip(reference.outputs, changed.outputs))
    advice = ("compute every statistic within one example (GroupNorm/LayerNorm instead of batch "
              "statistics, bpclip_fast.fix_model(model) swaps BatchNorm for GroupNorm; attention within a sequence, nothing like h - h.mean(0) over the batch)")
    if found:
        (name, what), *rest = [found[k] for k in sorted(found)]
        where = "before this layer" if what == "input" else "after this layer (the backward brings it back here)"
        also = list(dict.fromkeys(f"{labels[n]} {w}" for n, w in rest))
        more = f"; also affected: {', '.join(also[:4])}{', ...' if len(also) > 4 else ''}" if also else ""
        return [f"{labels[name]}: its {what} changed when another example of the probe batch changed (rule: batch "
                f"independence); examples mix {where}, so one example moves the other examples' clipped "
                f"contributions and the per-example bound no longer holds{more}; {advice}"]
    if output_mixes:
        return [f"{labels['']} (model output): an example's output changed when another example of the probe batch "
                "changed (rule: batch independence); examples mix after the last trainable layer, so a loss on "
                f"these outputs mixes examples' gradients; {advice}"]
    return []


def _buffer_snapshot(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor, torch.Tensor]]:
    return [(name, m, key, b, b.detach().clone()) for name, m in model.named_modules()
            for key, b in m._buffers.items() if b is not None]


def _restore_buffers(snapshot) -> None:
    with torch.no_grad():
        for _, m, key, b, saved in snapshot:
            m._buffers[key] = b  # the same tensor object, in case forward assigned a new one
            b.copy_(saved)


def _buffer_problems(snapshot, labels: dict[str, str]) -> list[str]:
    """Probe 3: no buffer changes in one training-mode forward (and backward)."""
    problems = []
    for name, m, key, _, saved in snapshot:
        now = m._buffers.get(key)
        if now is not None and now.shape == saved.shape and now.dtype == saved.dtype and torch.equal(now, saved):
            continue
        problems.append(
            f"{labels[name]}: buffer {name + '.' if name else ''}{key} changed in one training-mode forward pass "
            "(rule: buffers); it is updated from the data in forward and released (with the model or its "
            "state_dict) without noise; keep it constant during private training (compute it from public data, "
            "or update it only outside training mode) or drop it")
    return problems


def _own_gradients(layer: nn.Module, calls: list[_Call]):
    """``(own, scale, terms)``: the parameter gradients the layer computes from its own calls' inputs
    and output gradients; for each, a bound on the Frobenius norm of ``Σ|gradient|·|input|``
    (``√taps·‖g‖·‖x‖`` for the weight, taps the kernel positions; ``√rows·‖g‖`` for the bias); and
    the number of terms each entry sums (rows, or batch·positions, per call, plus one per call)."""
    names = [n for n in ("weight", "bias") if getattr(layer, n, None) is not None]
    own = {n: torch.zeros_like(getattr(layer, n)) for n in names}
    scale = dict.fromkeys(names, 0.0)
    kind = registry.layer_type(layer)
    taps = kind.taps(layer)
    terms = 0
    for c in calls:
        if c.input is None or c.grad is None:
            continue  # the output did not reach the loss: no gradient from this call
        with torch.enable_grad():
            leaves = {n: getattr(layer, n).detach().requires_grad_() for n in names}
            out = kind.plain(layer, c.input, leaves, *c.extra, **c.kwargs)
            grads = torch.autograd.grad((out * c.grad).sum(), list(leaves.values()), allow_unused=True)
        for n, gr in zip(names, grads):
            if gr is not None:
                own[n] += gr
        rows = c.grad.numel() // max(layer.weight.shape[0], 1)
        g_norm = float(c.grad.double().norm())
        x_norm = (kind.multiplier_norm(layer, c.input, *c.extra, **c.kwargs) if kind.multiplier_norm is not None
                  else float(c.input.double().norm()))
        scale["weight"] += math.sqrt(taps) * g_norm * x_norm
        if "bias" in scale:
            scale["bias"] += math.sqrt(rows) * g_norm
        terms += rows + 1
    return own, scale, terms


def _rounding(p: torch.Tensor) -> float:
    """The unit roundoff for ``p``'s gradients; on a GPU float32 GEMMs and convolutions may use TF32."""
    eps = torch.finfo(p.dtype).eps
    return max(eps, 2.0 ** -10) if p.device.type == "cuda" and p.dtype == torch.float32 else eps


def _ownership_problems(model: nn.Module, reference: _Pass, labels: dict[str, str]) -> list[str]:
    """Probe 4: each trainable layer's parameter gradient is exactly what it computes from its own calls.

    Both sides sum the same products ``gradient·input``, in possibly different orders: each entry is
    within ``terms·u·Σ|gradient|·|input|`` of the exact sum (recursive summation bound, u the unit
    roundoff), so their difference has a Frobenius norm below ``2·terms·u`` times the scale of
    ``_own_gradients`` (with a factor 2 of margin here). A use of the parameter elsewhere adds a
    contribution of the gradient's own size, orders of magnitude above that.
    """
    if not reference.grads:
        return []  # nothing reached the output with a gradient
    problems = []
    for name, layer in _trainable_layers(model):
        calls = [c for c in reference.calls if c.name == name]
        own, scale, terms = _own_gradients(layer, calls)
        foreign = []
        for pname, p in layer.named_parameters(recurse=False):
            if not p.requires_grad or pname not in own:
                continue
            total = reference.grads.get(id(p))
            total = torch.zeros_like(p) if total is None else total
            tolerance = 4 * (terms + 1) * _rounding(p) * scale[pname]
            if float((total - own[pname]).norm()) > tolerance:  # NaN (a model non-finite on the probe): no verdict
                foreign.append(f"{name + '.' if name else ''}{pname}")
        if foreign:
            problems.append(
                f"{labels[name]}: the gradient of {', '.join(foreign)} is not the layer's own (rule: gradient "
                "ownership): it differs from what the layer computes from its own inputs and output gradients, so "
                "the parameter is also used outside this layer's forward (in plain code such as "
                "F.linear(h, enc.weight.t()), by another module, or by a second layer sharing it), and that use "
                "would be released without clipping; give each use its own layer with its own parameters "
                "(untie the weights)")
    return problems
