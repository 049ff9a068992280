"""Every problem of the model and the optimizer, found at once before anything is changed (the
module checks and probes of :mod:`bpclip_fast.validate`, the criterion probe of
:mod:`bpclip_fast.criterion`, the optimizer's parameters), and each layer's Δ fixed from the probe's
shapes: a Δ taken from each batch would make the noise std depend on the data."""

from __future__ import annotations

import torch

from .. import criterion as _criterion, registry, validate as _validate
from ._common import first_input, to_device


def model_problems(inner, optimizer, data_loader, max_input_shape, probe, clipping, criterion=None,
                    loss_reduction="mean", rows=3) -> dict:
    """Every problem of the model and the optimizer at once (raised as one ``ValueError``) before
    anything is changed; returns ``{layer: input shape}`` of the probe forward (Δ is fixed from it)."""
    problems = _validate.static_problems(inner, clipping)
    shapes, example = {}, None
    if max_input_shape is not None:
        p0 = next(inner.parameters(), None)
        example = torch.zeros((1, *max_input_shape), dtype=p0.dtype if p0 is not None else None,
                              device=p0.device if p0 is not None else None)
    else:
        dataset = data_loader.dataset
        try:
            example = to_device(first_input(data_loader.collate_fn([dataset[0]])), inner)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"make_private: could not build a probe input from the dataset's first example "
                            f"({exc!r}); pass max_input_shape=(per-example input shape) instead")
    if example is not None:
        try:
            twice, shapes = _validate.probe(inner, example)
            if not probe:
                problems += twice  # the dynamic probes report reuse themselves
        except Exception as exc:  # noqa: BLE001
            problems.append(f"make_private: the probe forward failed ({exc!r}); the sensitivity of each layer "
                            "is fixed from it, so the model must run on one example (or on max_input_shape)")
    if probe:
        problems += dynamic_problems(inner, data_loader)
    if criterion is not None:
        problems += criterion_problems(inner, data_loader, criterion, loss_reduction, rows)
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
    return problems + [f"{name}: frozen, but holds a gradient from earlier training, which an optimizer would "
                       "apply without clipping or noise; clear it first (model.zero_grad())"
                       for name, p in inner.named_parameters() if id(p) not in owned and p.grad is not None]


def dynamic_problems(inner, data_loader) -> list[str]:
    """:func:`bpclip_fast.validate.dynamic_problems` on the first batch of the user's loader (its
    structure and shapes only: the probes replace floating-point values by random ones)."""
    try:
        batch = next(iter(data_loader))
    except Exception as exc:  # noqa: BLE001
        return [f"make_private: could not draw a first batch for the dynamic probes ({exc!r}); pass "
                "probe=False to skip them"]
    return _validate.dynamic_problems(inner, to_device(first_input(batch), inner))


def criterion_problems(inner, data_loader, criterion, loss_reduction, rows) -> list[str]:
    """:func:`bpclip_fast.criterion.criterion_problems` on the structure of the loader's first batch,
    with ``rows`` (the plan's public expected batch size) examples."""
    try:
        batch = next(iter(data_loader))
    except Exception as exc:  # noqa: BLE001
        return [f"make_private: could not draw a first batch to check the criterion ({exc!r})"]
    return _criterion.criterion_problems(inner, to_device(batch, inner), criterion, loss_reduction, rows)


def fix_sensitivities(layers, shapes: dict, declared: bool) -> None:
    """Fixes every layer's Δ before training (``nn._Clipped.set_max_input_shape``), from the probe
    shapes: a Δ taken from each batch would make the noise std depend on the data."""
    problems = []
    for name, layer in layers:
        if layer.max_input_shape is not None:
            continue  # declared on the layer itself
        shape = shapes.get(name)
        if shape is None:
            if layer._shape_dependent(None):
                problems.append(f"{name}: no probe forward reached it, and its sensitivity depends on its input "
                                f"shape ({layer._shape_rule()}); call {name}.set_max_input_shape(...) first")
            continue
        if layer._shape_dependent(shape) and not declared:
            problems.append(f"{name}: its sensitivity depends on its input shape ({layer._shape_rule()}), so it "
                            "must not be taken from a sampled example; pass max_input_shape=(largest per-example "
                            "input shape) to make_private, and pad or truncate inputs to at most that shape")
            continue
        layer.set_max_input_shape(shape[1:])
    if problems:
        raise ValueError("make_private: the noise scale would depend on the data:\n  - " + "\n  - ".join(problems))
