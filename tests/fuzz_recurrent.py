"""The bound fuzzer's cases for the fused recurrent layers (bpclip_fast/layers/recurrent.py, issue 26):
``nn.LSTM``/``nn.GRU``/``nn.RNN`` unpacked into ``ih``/``hh`` Linears over the time steps and converted.

A case is a :class:`fuzz_bounds.Case` whose ``kind`` is one of :data:`KINDS`; its geometry draws the
hidden size, layers, direction, ``batch_first``, ``h_0`` given or not, the nonlinearity (RNN) and
whether the final states receive a gradient. The per-example bound is each clipped Linear's (their
own fuzzing covers the Linear path on every layout and value kind); what is particular to the
recurrent layer, and asserted by :func:`check` for every example ``i``, is what the Linears are fed:

1. **rows** — row ``i`` of every Linear's input and upstream gradient is example ``i``'s alone: an
   example whose upstream gradients (output and final states) are zero has exactly zero upstream
   gradient rows in every Linear (the backward of a zero gradient through finite values adds exact
   zeros: any other example's data there would show, whatever the dtype).
2. **removal** — ``R(D) − R(D∖{i})`` through the whole layer (noise off) is at most ``C`` (flat; per_layer:
   ``C_l`` per Linear and ``C = (Σ C_l²)^½`` in all) plus the two releases' rounding. Each Linear's release
   sums, per coordinate, at most ``N = B·T`` products (plus one for the factor) in the accumulation
   unit, so errs by at most ``γ_{N+2}(u_acc)`` times the sum of its absolute terms, whose Frobenius
   norm is at most ``Σ_i c_i ‖g_i‖(‖x_i‖ + √T)`` (Cauchy–Schwarz over the steps; ``c_i ≤ 1`` for clip
   and global, ``C/γ`` for normalize), then one rounding to the dtype. It assumes the per-example
   values of the other examples do not change with the batch's size (torch's recurrences and
   GEMMs compute each row alone); the fuzzer would report a case where they do.
3. **finite** — a finite case releases finite gradients (an example made non-finite by the
   recurrence in a half type is dropped, factor 0, not released as NaN).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from bpclip_fast import nn as bnn

import fuzz_bounds as fb
from fuzz_tolerances import F64, UNIT, V, acc_unit, gamma

KINDS = ("lstm", "gru", "rnn")
TORCH_TYPE = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


class BoundExceeded(AssertionError):
    pass


def plain_layer(case: fb.Case) -> nn.Module:
    g = case.geometry
    extra = dict(nonlinearity=g["nonlinearity"]) if case.kind == "rnn" else {}
    layer = TORCH_TYPE[case.kind](case.shape[-1], g["hidden"], num_layers=g["layers"], bias=case.bias,
                                  batch_first=g["batch_first"], bidirectional=g["bidirectional"], dtype=F64, **extra)
    gen = torch.Generator().manual_seed(case.seed + 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
    return layer.to(case.dtype)


def inputs(case: fb.Case, layer: nn.Module):
    """Batch-first ``x``, ``h_0`` (or None, ``[L·D, B, H]``) and the upstream gradients ``[g_out, g_h(, g_c)]``
    (the states' gradients zero unless the case feeds them), all rounded to the dtype."""
    gen = torch.Generator().manual_seed(case.seed)
    g = case.geometry
    d, t = (2 if g["bidirectional"] else 1), case.shape[0]
    states = 2 if case.kind == "lstm" else 1
    b = case.batch

    def per_example(kinds, shape, other=False):
        if not b:
            return torch.zeros((0, *shape), dtype=F64).to(case.dtype)
        return torch.stack([fb._values(k, shape, case.dtype, gen, other=other) for k in kinds]).to(case.dtype)

    x = per_example(case.values_x, case.shape, other=True)
    h0 = ([per_example(case.values_x, (g["layers"] * d, g["hidden"]), other=True).transpose(0, 1)
           for _ in range(states)] if g["h0"] else None)
    grads = [per_example(case.values_g, (t, d * g["hidden"]))]
    for _ in range(states):
        s = per_example(case.values_g, (g["layers"] * d, g["hidden"])).transpose(0, 1)
        grads.append(s if g["outputs"] == "all" else torch.zeros_like(s))
    return x, h0, grads


def _run(layer, case, x, h0, grads):
    xin = x if case.geometry["batch_first"] else x.transpose(0, 1)
    state = None if h0 is None else (tuple(h0) if case.kind == "lstm" else h0[0])
    out, last = layer(xin, state)
    outs = [out if case.geometry["batch_first"] else out.transpose(0, 1),
            *(last if isinstance(last, tuple) else (last,))]
    torch.autograd.backward(outs, grads)


def release(model, case, x, h0, grads, record=None):
    """``{clipped Linear: (∇W, ∇b)}`` in float64 (noise off); ``record``: filled with each Linear's
    ``(input, upstream gradient)`` as it saw them."""
    model.zero_grad(set_to_none=True)
    handles = []
    if record is not None:
        for _, lin in bnn.clipped_layers(model):
            def hook(mod, args, out, _lin=lin):
                record[_lin] = [args[0].detach().clone(), None]
                out.register_hook(lambda gr, _l=_lin: record[_l].__setitem__(1, gr.detach().clone()))
            handles.append(lin.register_forward_hook(hook))
    try:
        _run(model, case, x, h0, grads)
    finally:
        for h in handles:
            h.remove()
    return {lin: tuple(p.grad.double() if p is not None and p.grad is not None else None
                       for p in (lin.weight, lin.bias)) for _, lin in bnn.clipped_layers(model)}


def _norm(parts) -> float:
    return math.sqrt(sum(float(p.pow(2).sum()) for p in parts if p is not None))


def release_error(case, lin, xl, gl, rows, grads) -> float:
    """Module docstring, 2: for the examples ``rows`` of one Linear."""
    if not rows:
        return 0.0
    t = xl.shape[1]
    c_max = 1.0 if case.clip_fn != "normalize" else max(1.0, lin.max_grad_norm / case.gamma)
    xs = xl[rows].double().flatten(1).norm(dim=1)
    gs = gl[rows].double().flatten(1).norm(dim=1)
    terms = float((c_max * gs * (xs + math.sqrt(t))).sum())
    return gamma(len(rows) * t + 2, acc_unit(case.dtype)) * terms + UNIT[case.dtype] * _norm(grads)


def check(case: fb.Case) -> dict:
    layer = plain_layer(case)
    model = bnn.convert_model(copy.deepcopy(layer), clipping=case.mode, max_grad_norm=case.bound,
                              clip_fn=case.clip_fn, gamma=case.gamma)
    x, h0, grads = inputs(case, layer)
    b = case.batch
    rec: dict = {}
    full = release(model, case, x, h0, grads, rec)
    out = {"removal": 0.0}
    for lin, parts in full.items():
        assert all(p is None or bool(torch.isfinite(p).all()) for p in parts), f"non-finite release\n{case}"

    # 1. rows: a zero-gradient example feeds exact zero rows to every Linear
    for i in range(b):
        if case.values_g[i] == "zero":
            for lin, (_, gl) in rec.items():
                assert gl is not None and not bool(gl[i].any()), \
                    f"{lin.layer_name}: example {i}'s upstream gradient is zero but its row is not\n{case}"

    # 2. removal through the whole layer
    rows = list(range(b))
    total_bound = max(lin.noise_bound for lin in full)
    for i in range(b):
        keep = [j for j in rows if j != i]
        part = release(model, case, x[keep], None if h0 is None else [h[:, keep] for h in h0],
                       [grads[0][keep]] + [s[:, keep] for s in grads[1:]])
        total_sq, total_tol = 0.0, 0.0
        for lin in full:
            xl, gl = rec[lin]
            diff = _norm([a - c for a, c in zip(full[lin], part[lin]) if a is not None])
            tol = (release_error(case, lin, xl, gl, rows, full[lin])
                   + release_error(case, lin, xl, gl, keep, part[lin]) + 4 * V * _norm(full[lin]))
            if diff > lin.max_grad_norm + tol:
                raise BoundExceeded(f"example {i}, {lin.layer_name}: removal changes its release by {diff:.9g} = "
                                    f"{diff / lin.max_grad_norm:.6g} x C_l = {lin.max_grad_norm:.9g} (rounding "
                                    f"allowance {tol:.3g})\n{case}")
            total_sq += diff * diff
            total_tol += tol
        total = math.sqrt(total_sq)
        if total > total_bound + total_tol:
            raise BoundExceeded(f"example {i}: removal changes the release by {total:.9g} = "
                                f"{total / total_bound:.6g} x C = {total_bound:.9g}\n{case}")
        out["removal"] = max(out["removal"], total / total_bound)
    return out
