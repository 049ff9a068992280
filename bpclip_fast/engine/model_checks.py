"""Every problem of the model and the optimizer, found at once before anything is changed (the
module checks and probes of :mod:`bpclip_fast.validate`, the criterion probe of
:mod:`bpclip_fast.criterion`, the optimizer's parameters), and each layer's Δ fixed from the probe's
shapes: a Δ taken from each batch would make the noise std depend on the data."""

from __future__ import annotations

from .. import batches, criterion as _criterion, modes, registry, validate as _validate
from ._common import to_device


def model_problems(inner, optimizer, data_loader, max_input_shape, probe, clipping, criterion=None,
                    loss_reduction="mean", rows=3, batch_inputs=None) -> dict:
    """Every problem of the model and the optimizer at once (raised as one ``ValueError``) before
    anything is changed; returns ``{layer: input shape}`` of the probe forward (Δ is fixed from it).
    Every probe splits the loader's batches by :func:`bpclip_fast.batches.split_batch`."""
    problems = _validate.static_problems(inner, clipping)
    shapes, example, first, callable_ = {}, None, None, True
    try:
        first = data_loader.collate_fn([data_loader.dataset[0]])
    except Exception as exc:  # noqa: BLE001
        if max_input_shape is None:
            problems.append(f"make_private: could not build a probe input from the dataset's first example "
                            f"({exc!r}); pass max_input_shape=(per-example input shape) instead")
    try:
        example = batches.probe_input(first, batch_inputs, max_input_shape, next(inner.parameters(), None))
        if max_input_shape is None and example is not None:
            example = to_device(example, inner)
    except ValueError as exc:  # the split or the shapes do not fit the batch: the other probes would fail alike
        problems.append(str(exc))
        callable_ = False
    if example is not None:
        try:
            twice, shapes = _validate.probe(inner, example, clipping in modes.EXACT)
            if not probe:
                problems += twice  # the dynamic probes report reuse themselves
        except TypeError as exc:  # the model does not take this split: the other probes would fail alike
            problems.append(batches.call_failed(exc, inner, first, batch_inputs, "the probe forward"))
            callable_ = False
        except Exception as exc:  # noqa: BLE001
            problems.append(f"make_private: the probe forward failed ({exc!r}); the sensitivity of each layer "
                            "is fixed from it, so the model must run on one example (or on max_input_shape)")
    if probe and callable_:
        problems += dynamic_problems(inner, data_loader, batch_inputs, clipping)
    if criterion is not None and callable_:
        problems += criterion_problems(inner, data_loader, criterion, loss_reduction, rows, batch_inputs)
    problems += optimizer_problems(inner, optimizer)
    if problems:
        raise ValueError("make_private: the model cannot be trained privately as it is:\n  - "
                         + "\n  - ".join(problems))
    return shapes


def optimizer_problems(inner, optimizer) -> list[str]:
    """Parameters an optimizer would update without clipping or noise: not in the module, or
    frozen or outside the clipped layers with a gradient left from earlier training."""
    names = {id(p): name for name, p in inner.named_parameters()}
    problems = [f"optimizer: a parameter of shape {tuple(p.shape)} is not part of the module; it would be "
                "trained without clipping or noise"
                for group in optimizer.param_groups for p in group["params"] if id(p) not in names]
    owned = {id(p) for m in inner.modules() if registry.clipped_by_conversion(m)
             for p in m.parameters(recurse=False) if p.requires_grad}
    owned |= {id(p) for _, u in registry.generic_units(inner) for p in u.parameters() if p.requires_grad}
    owned |= {id(p) for _, c, _ in registry.composites(inner) for p in c.parameters() if p.requires_grad}
    return problems + [f"{name}: frozen, but holds a gradient from earlier training, which an optimizer would "
                       "apply without clipping or noise; clear it first (model.zero_grad())"
                       for name, p in inner.named_parameters() if id(p) not in owned and p.grad is not None]


def dynamic_problems(inner, data_loader, batch_inputs=None, clipping=None) -> list[str]:
    """:func:`bpclip_fast.validate.dynamic_problems` on the model inputs of the user's loader's first
    batch (its structure and shapes only: the probes replace floating-point values by random ones)."""
    try:
        batch = next(iter(data_loader))
    except Exception as exc:  # noqa: BLE001
        return [f"make_private: could not draw a first batch for the dynamic probes ({exc!r}); pass "
                "probe=False to skip them"]
    try:
        inputs = batches.split_batch(batch, batch_inputs)[0]
    except ValueError as exc:
        return [str(exc)]
    try:
        return _validate.dynamic_problems(inner, to_device(inputs, inner), clipping)
    except TypeError as exc:
        return [batches.call_failed(exc, inner, batch, batch_inputs, "the dynamic probes")]


def criterion_problems(inner, data_loader, criterion, loss_reduction, rows, batch_inputs=None) -> list[str]:
    """:func:`bpclip_fast.criterion.criterion_problems` on the structure of the loader's first batch,
    with ``rows`` (the plan's public expected batch size) examples."""
    try:
        batch = next(iter(data_loader))
    except Exception as exc:  # noqa: BLE001
        return [f"make_private: could not draw a first batch to check the criterion ({exc!r})"]
    return _criterion.criterion_problems(inner, to_device(batch, inner), criterion, loss_reduction, rows,
                                         batch_inputs=batch_inputs)


def fix_sensitivities(layers, shapes: dict, declared: bool) -> None:
    """Fixes every layer's Δ before training (``nn._Clipped.set_max_input_shape``), from the probe
    shapes: a Δ taken from each batch would make the noise std depend on the data."""
    problems = []
    for name, layer in layers:
        if layer.max_input_shape is not None:
            continue  # declared on the layer itself
        shape = shapes.get(name)
        if shape is None:
            if layer._bp_shape_dependent(None):
                problems.append(f"{name}: no probe forward reached it, and its sensitivity depends on its input "
                                f"shape ({layer._bp_shape_rule()}); call {name}.set_max_input_shape(...) first")
            continue
        if layer._bp_shape_dependent(shape) and not declared:
            problems.append(f"{name}: its sensitivity depends on its input shape ({layer._bp_shape_rule()}), so it "
                            "must not be taken from a sampled example; pass max_input_shape=(largest per-example "
                            "input shape) to make_private, and pad or truncate inputs to at most that shape")
            continue
        layer.set_max_input_shape(shape[1:])
    if problems:
        raise ValueError("make_private: the noise scale would depend on the data:\n  - " + "\n  - ".join(problems))
