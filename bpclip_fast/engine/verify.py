"""Every check of the step boundary that ``step()`` runs before it releases anything (the rules and
their argument: module docstring of :mod:`bpclip_fast.boundary`), and the fallback draw for the
layers that do not hold theirs."""

from __future__ import annotations

import torch

from .. import _ops, integer_noise, rules
from . import correlated, distributed, refusal
from .guards import any_outside, outside_params, owned_ids


def verify(engine, optimizer):
    """``(problems, pending)`` with problems as ``(rule, details, names)`` (the first one names the
    refusal: the order below is the rules' precedence) and ``pending[l]`` whether layer ``l`` still
    needs its draw (no backward reached it, or its gradient was cleared since)."""
    problems = _outside_problems(engine, optimizer)
    step_problems, layer_problems, pending, checks = _layer_records(engine)
    problems += step_problems
    layer_problems += engine._mode.step_problems(engine._steps_of)  # flat: every layer reached holds the same releases
    problems += _edited(checks)
    problems += layer_problems
    problems += _nonfinite_problems(engine)
    if engine.distributed and distributed.any_rank(bool(problems)) and not problems:  # every process decides alike
        problems.append(("rows", "another process refused this step", []))
    return problems, pending


def _outside_problems(engine, optimizer):
    """Gradients on parameters outside the clipped layers (of the model, or only in the optimizer)."""
    clipped = owned_ids(engine)
    if not any_outside(engine._inner, clipped, trainable=False) and not any(
            p.grad is not None for group in optimizer.param_groups for p in group["params"] if id(p) not in clipped):
        return []  # the names below cost a walk of the model; they are needed only for a refusal
    names = {id(p): name for name, p in engine._inner.named_parameters()}
    outside = outside_params(engine) + [
        (names.get(id(p), f"a parameter of shape {tuple(p.shape)}"), p)
        for group in optimizer.param_groups for p in group["params"] if id(p) not in clipped]
    return [("unclipped-param", f"{name} has a gradient but is not in a clipped layer made "
             "private (frozen at make_private and unfrozen since?)", [name])
            for name in dict.fromkeys(name for name, p in outside if p.grad is not None)]


def _layer_records(engine):
    """Closes every layer's pass and reads its records: ``(problems, layer problems, pending, checks)``,
    ``checks`` the device flags of gradients edited, replaced or accumulated over passes."""
    rows = engine._counter.last_rows
    problems, layer_problems, pending, checks = [], [], [], []
    for st in engine._steps_of:
        params = st.params  # read once per layer: nothing below rebinds them
        st.close_pass(params)
        hooked = st.foreign_hooks(params)
        if hooked:
            problems.append(("grad-edit", f"gradient hooks on {', '.join(hooked)} (tensor, post-accumulate or "
                             "AccumulateGrad pre-hooks can rewrite a private gradient); remove them", [st.name]))
        if st.params_moved(params):
            problems.append(("param-edit", f"{st.name}'s parameters changed since the step's first backward pass",
                             [st.name]))
        holds = st.sync_with_grads(params)
        pending.append(not (holds and st.noised))
        if st.rows not in (0, rows):  # before the layer's own violations: reuse also mixes its gradient
            layer_problems.append(("rows", f"{st.name}'s backward passes saw {st.rows} example rows in this step, "
                                   f"the batch drawn for it has {rows}", [st.name]))
        layer_problems += [(rule, details, [st.name]) for rule, details in dict.fromkeys(st.violations)]
        checks += [(st.name, flag, "edit") for flag in st.edit_checks]
        checks += [(st.name, flag, "reuse") for flag in st.reuse_checks]
    return problems, layer_problems, pending, checks


def _edited(checks):
    """The layers whose gradient an edit check flagged (one sync, only in steps that have checks)."""
    if not checks:
        return []
    flags = torch.stack([flag.to("cpu") for _, flag, _ in checks]).tolist()
    bad = dict.fromkeys((name, kind) for (name, _, kind), b in zip(checks, flags) if b)
    return [("weight-reuse", f"{name}'s gradient is not its layer's own output: the compiled graph added another "
             "use of the parameter to it (the parameter is used outside the layer); use it only through its layer",
             [name]) if kind == "reuse" else
            ("grad-edit", rules.edited(name) + " or after them", [name])
            for name, kind in bad]


def _nonfinite_problems(engine):
    """``nonfinite="raise"``: any non-finite value the layers met refuses the step."""
    if engine.nonfinite != "raise":
        return []
    counts = engine.nonfinite_counts()
    bad = [name for name, c in counts.items() if any(c)]
    if not bad:
        return []
    return [("nonfinite", "non-finite values reached " + ", ".join(f"{n} {counts[n]}" for n in bad), bad)]


def fallback_noise(engine, pending) -> None:
    """Adds draw ``t`` to the layers whose gradient does not hold it (no backward reached them in
    this step, e.g. a skipped empty batch, or their gradient was cleared after the backward)."""
    if engine.distributed:
        pending = distributed.broadcast_flags(pending)
    for st, todo in zip(engine._steps_of, pending):
        if not todo:
            continue
        if st.band is not None:
            if not correlated.fallback(engine, st):
                refusal.refuse(engine, [("banded-redraw", f"{st.name}'s gradient was cleared after its backward "
                                         "added this step's correlated noise row, which is drawn once (a new row "
                                         "would release the past steps' noise again); do not clear a layer's "
                                         "gradient between its backward and step()", [st.name])])
            continue
        layer = st.layer
        seed, offset = st.take_draw()
        if st.integer_bits is not None:  # the integer release of what each gradient holds (zeros where none)
            due = integer_noise.Due(seed, offset, engine.gradient_noise_multiplier, layer.sensitivity, st.integer_bits,
                                    st.mean_loss_batch or 1.0)
            integer_noise.release_into(st.params, due)
            st.noised = True
            continue
        # Every rank adds the same draw divided by W: the value DDP's average would have given.
        std = engine.gradient_noise_multiplier * layer.sensitivity
        if st.mean_loss_batch is not None:
            std /= st.mean_loss_batch
        std /= engine.world_size
        if "_bp_slots" in layer.__dict__:  # a generic unit: the release's one [P] draw, split alike
            params = [p for p in layer._bp_params() if p.requires_grad]
            if params:  # a unit frozen whole has nothing to noise, as a fused layer frozen whole
                draw = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
                _ops.philox_noise_(draw, seed, offset, std, accumulate=True)
                for p, piece in zip(params, draw.split([p.numel() for p in params])):
                    p.grad = piece.view(p.shape).clone() if p.grad is None else p.grad.add_(piece.view(p.shape))
            st.noised = True
            continue
        for p, off in ((layer.weight, offset), (layer.bias, offset + 1)):
            if p is None or not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            _ops.philox_noise_(p.grad, seed, off, std, accumulate=True)
        st.noised = True
