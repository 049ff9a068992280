"""The bound fuzzer's cases for the generic exact path (bpclip_fast/generic.py, issue 26): modules
with trainable parameters and no fused layer, trained under flat/per_layer as one *generic unit*
whose per-example gradients come from the forward's own graph and are released through
``DenseExamples`` (the instantiating layers' proved bound).

A case is a :class:`fuzz_bounds.Case` whose ``kind`` is one of :data:`KINDS`; the unit reads its
input through ordinary torch ops, so every layout the fuzzer draws is legal (a sequence-first unit
gets the batch-first tensor transposed, as a view). The upstream gradients are fed to the unit's
outputs (``torch.autograd.backward(outputs, grads)``): the first output only or all of them
(an LSTM's ``h_n``/``c_n``, an attention's weights), as drawn. :func:`check` asserts, for every
example ``i``:

1. **bound** — *stored*: the very ``DenseExamples`` values the unit rounded to the dtype (recorded
   as it builds them) times the factors from their proved norm bound, in float64, ≤ C plus
   float64's own error; *removal*: ``R(D) − R(D∖{i})`` through the unit (noise off) ≤ C plus the
   two releases' rounding (:func:`fuzz_tolerances.release_error`).
2. **truth** — the release is the sum of those stored values within its rounding (``DenseExamples``
   sums ``RZ(c_i·S_i)`` over the examples in the accumulation dtype); the norm bound lies within
   its proved margin of ``‖S_i‖``; an example whose upstream gradient is zero has ``S_i = 0``
   exactly (the backward of a zero gradient through finite values adds exact zeros: any other
   example's data in ``S_i`` shows here, whatever the dtype); and for the kinds whose computation
   error is derived below (:func:`computation_error`: custom, conv1d, rmsnorm) the release equals
   ``Σ_i c_i G_i`` with ``G_i`` from float64 ``torch.func`` on batches of one of the data as stored,
   within the tolerance derived term by term as for the instantiating layers (the computation's
   error, the rounding of ``G_i`` to the dtype, RZ of ``c·S``, the factor from the bound, the
   accumulation). LSTM and MultiheadAttention have no derived error bound for torch's own
   recurrent/attention kernels here (their saturating gates and softmax turn rounding of the
   pre-activations into absolute errors that a relative count does not bound): for them the
   float64 comparison is not made, and the bound, tie, margin and exact-zero checks carry it.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
from torch import nn

from bpclip_fast import _ops, exact
from bpclip_fast import examples as examples_mod
from bpclip_fast import nn as bnn

import exact_oracle as eo
import fuzz_bounds as fb
from fuzz_tolerances import F16, F64, RZ, UNIT, V, dense_margin, factor_change, gamma, release_error, subnormal_step

KINDS = ("custom", "conv1d", "rmsnorm", "lstm", "mha")
DERIVED = ("custom", "conv1d", "rmsnorm")  # kinds whose float64 truth comparison is made


class Affine(nn.Module):
    """A layer of the user's own, unknown to the registry: ``tanh(x·scale + shift)``."""

    def __init__(self, d, dtype=None):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(d, dtype=dtype))
        self.shift = nn.Parameter(torch.empty(d, dtype=dtype))

    def forward(self, x):
        return torch.tanh(x * self.scale + self.shift)


class UserRMSNorm(nn.RMSNorm):
    """The user's own RMSNorm: a subclass, which the registry does not convert to the fused
    ``bpclip_fast.nn.RMSNorm`` (only the exact torch type is registered), so torch's RMSNorm
    computation keeps exercising the generic path (and the error derived for it below)."""


class UserMHA(nn.MultiheadAttention):
    """The user's own attention: a subclass, which the registry leaves to the generic path (a plain
    ``nn.MultiheadAttention`` is unpacked into fused Linears, bpclip_fast/layers/attention.py)."""


class UserConv1d(nn.Conv1d):
    """The user's own Conv1d: a subclass, which the registry leaves to the generic path (nn.Conv1d
    itself has a fused layer, bpclip_fast/layers/conv1d.py), so torch's Conv1d computation keeps
    exercising the generic path."""


class UserLSTM(nn.LSTM):
    """The user's own LSTM: a subclass, which the registry leaves to the generic path (a plain
    ``nn.LSTM`` is unpacked into fused Linears, bpclip_fast/layers/recurrent.py), so torch's LSTM
    keeps exercising the generic path."""


TORCH_TYPE = {"custom": Affine, "conv1d": UserConv1d, "rmsnorm": UserRMSNorm, "lstm": UserLSTM,
              "mha": UserMHA}


def plain_unit(case: fb.Case) -> nn.Module:
    """The torch module with parameters drawn from the case's seed, rounded to the case's dtype."""
    g, k = case.geometry, case.kind
    if k == "custom":
        unit = Affine(case.shape[-1], dtype=F64)
    elif k == "conv1d":
        unit = UserConv1d(g["cin"], g["cout"], g["kernel"], stride=g["stride"], padding=g["padding"],
                         dilation=g["dilation"], groups=g["groups"], bias=case.bias, dtype=F64)
    elif k == "rmsnorm":
        unit = UserRMSNorm(g["normalized"], eps=g["eps"], dtype=F64)
    elif k == "lstm":
        unit = UserLSTM(case.shape[-1], g["hidden"], num_layers=g["layers"], bias=case.bias,
                       batch_first=g["batch_first"], bidirectional=g["bidirectional"], dtype=F64)
    else:
        unit = UserMHA(case.shape[-1], g["heads"], bias=case.bias, batch_first=g["batch_first"], dtype=F64)
    gen = torch.Generator().manual_seed(case.seed + 1)
    with torch.no_grad():
        for p in unit.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
    return unit.to(case.dtype)


def _seq_first(case) -> bool:
    return case.kind in ("lstm", "mha") and not case.geometry["batch_first"]


def outputs(case: fb.Case, unit: nn.Module, x: torch.Tensor) -> list:
    """The unit's outputs that receive a gradient, each with the batch moved to dimension 0 (views):
    ``x`` is batch-first; a sequence-first unit gets it transposed."""
    xin = x.transpose(0, 1) if _seq_first(case) else x
    if case.kind == "lstm":
        out, (h, c) = unit(xin)
        outs = [out.transpose(0, 1) if _seq_first(case) else out, h.transpose(0, 1), c.transpose(0, 1)]
    elif case.kind == "mha":
        out, w = unit(xin, xin, xin, need_weights=case.geometry["need_weights"])
        outs = [out.transpose(0, 1) if _seq_first(case) else out] + ([w] if w is not None else [])
    else:
        outs = [unit(xin)]
    return outs if case.geometry.get("outputs") == "all" else outs[:1]


def inputs(case: fb.Case, unit: nn.Module):
    """(x, [g per output]) as float64 values already rounded to the dtype, batch-first."""
    gen = torch.Generator().manual_seed(case.seed)
    x = torch.stack([fb._values(k, case.shape, case.dtype, gen, other=True) for k in case.values_x])
    x = fb.make_uniform(x.to(case.dtype).double(), case.layout)
    with torch.no_grad():
        shapes = [tuple(o.shape[1:]) for o in outputs(case, copy.deepcopy(unit).double(), x[:1])]
    kinds_g = ["cancel" if kx == "cancel" else kg for kx, kg in zip(case.values_x, case.values_g)]
    gs = []
    for shape in shapes:
        g = torch.stack([fb._values(k, shape, case.dtype, gen) for k in kinds_g])
        gs.append(fb.make_uniform(g.to(case.dtype).double(), case.layout_g))
    return x, gs


class Harness(nn.Module):
    """The model around the unit: its forward is the step's (flat clipping refuses a unit called on
    its own) and returns the outputs that receive a gradient, batch-first."""

    def __init__(self, unit, case):
        super().__init__()
        self.unit, self.case = unit, case

    def forward(self, x):
        return tuple(outputs(self.case, self.unit, x))


def converted(case: fb.Case, unit: nn.Module) -> Harness:
    model = Harness(copy.deepcopy(unit), case)
    bnn.convert_model(model, clipping=case.mode, max_grad_norm=case.bound, clip_fn=case.clip_fn, gamma=case.gamma)
    assert getattr(model.unit, "_bp_generic", False), f"{case.kind} is not a generic unit"
    return model


class _Recorder(examples_mod.DenseExamples):
    seen: list = []

    def __init__(self, gw, gb, dtype):
        super().__init__(gw, gb, dtype)
        _Recorder.seen.append(self)


@contextlib.contextmanager
def recording():
    """The ``DenseExamples`` the unit builds in its backward (the values it norms and releases)."""
    saved = examples_mod.DenseExamples
    _Recorder.seen = []
    examples_mod.DenseExamples = _Recorder
    try:
        yield _Recorder.seen
    finally:
        examples_mod.DenseExamples = saved


def release(model, case, x, gs) -> torch.Tensor:
    """The unit's noise-free release on (x, gs) laid out as the case says, read in float64."""
    xl = fb.lay_out(x.to(case.dtype), case.layout, case.seed).requires_grad_()
    gl = [fb.lay_out(g.to(case.dtype), case.layout_g, case.seed + 7 + k) for k, g in enumerate(gs)]
    model.zero_grad(set_to_none=True)
    torch.autograd.backward(model(xl), gl)
    parts = []
    for name, p in model.unit.named_parameters():
        assert p.grad is not None and p.grad.dtype == case.dtype, (name, case)
        parts.append(p.grad.double().reshape(-1))
    return torch.cat(parts)


def truth_grads(case, unit, x, gs) -> torch.Tensor:
    """``[B, P]``: each example's exact gradient of ``Σ_k ⟨out_k(x_i), g_{k,i}⟩`` in float64 (batches of one)."""
    plain = copy.deepcopy(unit).double()
    params = [p for _, p in plain.named_parameters()]
    rows = []
    for i in range(x.shape[0]):
        outs = outputs(case, plain, x[i:i + 1])
        got = torch.autograd.grad(outs, params, [g[i:i + 1] for g in gs], allow_unused=True)
        rows.append(torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(got, params)]))
    return torch.stack(rows)


def stored(case, kept, b) -> fb.Stored:
    """The recorded per-example gradients ``S`` (``[B, P]`` in the dtype), their bound and the factors
    from it (exact.factors, as the unit's backward), and ``c_i·S_i`` as the release rounds it."""
    assert kept.gb is None and kept.gw.dtype == case.dtype and kept.gw.shape[0] == b, case
    mask = (True, False)
    bound = kept.bound(mask)
    factor = exact.factors(bound, case.bound, case.clip_fn, case.gamma, torch.zeros(1, dtype=torch.int64), case.dtype)
    gs = kept.gw.double()
    contrib = _ops.scale_rows(kept.gw, factor).double()
    contrib[factor == 0] = 0.0  # a dropped (non-finite) example adds exact zeros, never 0·NaN
    return fb.Stored(contrib, contrib.norm(dim=1), factor.double(), bound, gs=gs)


# ------------------------------------------------------------------------------ derived errors


def computation_error(case, unit, x, gs, gtrue) -> torch.Tensor:
    """``[B]``: a bound on ``‖S_i − G_i‖`` where ``S_i`` is torch's gradient computed in the dtype and
    rounded to it, ``G_i`` the float64 truth on the same (rounded) data; ``inf`` where not derived.
    Every rounding is taken at the dtype's unit ``u`` (torch's CPU kernels of the half types
    compute in float32 and round to the dtype, so ``u`` of the dtype covers both). Below the normal
    range torch's kernels may flush (oneDNN's bf16 dot products read subnormal operands as zero and
    flush subnormal results, whatever MXCSR says): so every operand below the dtype's smallest normal
    ``tiny`` may be read as 0, and every operation's result may be off by ``tiny``, absolutely."""
    b = x.shape[0]
    if case.kind not in DERIVED:
        return torch.full((b,), math.inf, dtype=F64)
    u, tiny = UNIT[case.dtype], torch.finfo(case.dtype).tiny

    def flushed(t):  # entries an FTZ/DAZ kernel may read as zero
        return (t.abs() < tiny).double()

    plain = copy.deepcopy(unit).double()
    g = gs[0]
    if case.kind == "custom":
        # ẑ = (x·s)(1+δ)+h)(1+δ'): |ẑ − z| ≤ γ_2(|xs| + |h|) + 2·tiny (+ |xs| for an x read as 0);
        # ŷ = tanh(ẑ): |ŷ − y| ≤ |ẑ − z| + 2u + tiny (tanh is 1-Lipschitz, |y| ≤ 1), capped at 2; then
        # 1 − ŷ² errs by ≤ 2e + e², and y·y, 1 − ·, g·(·) and the result round (≤ 4u relative, 1 − ŷ² ≤ 1):
        # e_gz ≤ |g|(2e + e² + 4u) + tiny (+ |g| for a g read as 0; each product's x read as 0: |gz·x|).
        # ∂/∂scale = Σ_t gz_t x_t (products and a sum over the ≤ B·T broadcast positions, u each),
        # ∂/∂shift = Σ_t gz_t.
        s, h = plain.scale.detach(), plain.shift.detach()
        z = x * s + h
        ez = gamma(2, u) * ((x * s).abs() + h.abs()) + 2 * tiny + (x * s).abs() * flushed(x)
        ey = (ez + 2 * u + tiny).clamp(max=2.0)
        gz = g * (1 - torch.tanh(z) ** 2)
        egz = g.abs() * (2 * ey + ey ** 2 + 4 * u + flushed(g)) + tiny
        n = b * max(1, math.prod(case.shape[:-1])) + 2
        lead = tuple(range(1, x.dim() - 1))

        def over(t):
            return t.sum(lead) if lead else t

        es = (over(egz * x.abs()) + gamma(n + 1, u) * over((gz.abs() + egz) * x.abs())
              + over((gz.abs() + egz) * x.abs() * flushed(x)) + 2 * n * tiny)
        eh = over(egz) + gamma(n, u) * over(gz.abs() + egz) + n * tiny
        return torch.cat([es, eh], 1).norm(dim=1)
    if case.kind == "conv1d":
        # a GEMM over the ≤ B·T' positions of the masked batch: γ_{n}(u) times the sums of the
        # absolute products (the same backward on |x|, |g| in float64), one more rounding to the dtype;
        # the products with an operand read as 0 (the same sums over those products only)
        absu = copy.deepcopy(plain)
        with torch.no_grad():
            absu.weight.abs_()
        params = [absu.weight] + ([absu.bias] if case.bias else [])

        def terms(xa, ga):
            rows = []
            for i in range(b):
                outs = absu(xa[i:i + 1])
                got = torch.autograd.grad(outs, params, ga[i:i + 1])
                rows.append(torch.cat([t.reshape(-1) for t in got]))
            return torch.stack(rows), int(outs.shape[-1])

        full, t_out = terms(x.abs(), g.abs())
        kept, _ = terms(x.abs() * (1 - flushed(x)), g.abs() * (1 - flushed(g)))
        n = b * t_out + case.geometry["kernel"] + 2
        return gamma(n, u) * full.norm(dim=1) + (full - kept).norm(dim=1) + math.sqrt(gtrue.shape[1]) * n * tiny
    # rmsnorm: ŷ = x·rstd·w. m = mean(x²) over k entries: relative γ_{k+1}; + eps (rounded: u·eps + sub/2);
    # rsqrt and its rounding: rstd relative ρ = ½·q/(1 − q) + 2u, q = γ_{k+2}(u) + (u·eps + k·tiny)/(m + eps)
    # (squares below the normal range: each off by < tiny, the dtype's smallest normal);
    # x̂ = x·rstd: |x̂|(ρ + u) + tiny (|x̂| for an x read as 0). ∂/∂w = Σ_t g_t x̂_t: products (a g read
    # as 0: |g x̂|) and the sum over ≤ B·T positions.
    k = math.prod(case.geometry["normalized"])
    dims = tuple(range(x.dim() - len(case.geometry["normalized"]), x.dim()))
    eps = case.geometry["eps"]
    m = x.square().mean(dims, keepdim=True)
    q = gamma(k + 2, u) + (u * eps + k * torch.finfo(case.dtype).tiny) / (m + eps)
    rho = 0.5 * q / (1 - q) + 2 * u
    xhat = x * (m + eps).rsqrt()
    exh = xhat.abs() * (rho + u + flushed(x)) + tiny
    lead = tuple(range(1, x.dim() - len(dims)))
    n = b * max(1, math.prod(case.shape[:len(case.shape) - len(dims)])) + 2

    def over(t):
        return t.sum(lead) if lead else t

    ew = (over(g.abs() * exh) + gamma(n + 1, u) * over(g.abs() * (xhat.abs() + exh))
          + over(g.abs() * flushed(g) * (xhat.abs() + exh)) + 2 * n * tiny)
    return ew.reshape(b, -1).norm(dim=1)


# ------------------------------------------------------------------------------ the check


def check(case: fb.Case, removal: bool = True) -> dict:
    """Runs the case and asserts properties 1 and 2 (module docstring). Returns the worst ratios and
    whether the float64 truth was compared."""
    assert torch.get_float32_matmul_precision() == "highest", "the margins assume full fp32 GEMMs"
    unit = plain_unit(case)
    model = converted(case, unit)
    x, gs = inputs(case, unit)
    b, bound = case.batch, model.unit._bp_noise_bound
    with recording() as seen:
        full = release(model, case, x, gs)
    assert len(seen) == 1, f"the unit built {len(seen)} DenseExamples for one backward\n{case}"
    st = stored(case, seen[0], b)
    out = {"stored": 0.0, "removal": 0.0, "truth": 0.0, "compared": False}
    finite = torch.isfinite(st.gs).all(1)
    # an example whose upstream gradients are all zero has an exactly zero gradient
    zero_g = torch.stack([g.reshape(b, -1).abs().sum(1) == 0 for g in gs]).all(0)
    # (a forward that overflowed makes 0·inf = NaN: such a row is non-finite and dropped, factor 0)
    zero_g &= finite
    assert (st.gs[zero_g] == 0).all(), \
        f"examples {zero_g.nonzero().flatten().tolist()} have zero upstream gradients but stored gradients of norm " \
        f"{st.gs[zero_g].norm(dim=1).tolist()}: another example's data\n{case}"

    # 1a. stored: what the release holds of each example, in float64
    eval_err = gamma(5, V) * st.terms
    for i in range(b):
        if st.terms[i] > bound + float(eval_err[i]) + 4 * V * bound:
            raise fb.BoundExceeded(f"example {i}: stored contribution {float(st.terms[i]):.9g} = "
                                   f"{float(st.terms[i]) / bound:.6g} x the bound {bound:.9g}\n{case}")
    out["stored"] = float(st.terms.max() / bound)
    # the norm bound: >= the stored norm, within the proved margin (non-finite rows: infinite, factor 0)
    ns = st.gs.norm(dim=1)
    terms = st.gs.shape[1]
    under = math.sqrt(terms * torch.finfo(F64).tiny)
    ok = (st.bound >= ns * (1 - 4 * V) - under) & (st.bound <= ns + dense_margin(terms, ns) + under)
    assert (ok | (~finite & ~st.bound.isfinite() & (st.factor == 0))).all(), \
        f"norm bound {st.bound.tolist()} not within its margin of the stored norm {ns.tolist()}\n{case}"

    rows = list(range(b))
    if fb._overflowed(case, st, rows, 1, full):
        out["overflow"] = True
        return out
    tie = float((full - st.contrib.sum(0)).norm())
    assert tie <= release_error(case, st, rows, 1) + 4 * V * float(full.norm()), \
        f"release off the sum of the stored contributions by {tie:.3g}\n{case}"

    # 1b. removal through the unit
    if removal:
        for i in range(b):
            keep = [j for j in rows if j != i]
            part = release(model, case, x[keep], [g[keep] for g in gs])
            if fb._overflowed(case, st, keep, 1, part):
                out["overflow"] = True
                continue
            diff = float((full - part).norm())
            tol = release_error(case, st, rows, 1) + release_error(case, st, keep, 1) + 4 * V * float(full.norm())
            if diff > bound + tol:
                raise fb.BoundExceeded(f"example {i}: removal changes the release by {diff:.9g} = {diff / bound:.6g} "
                                       f"x the bound {bound:.9g} (rounding allowance {tol:.3g})\n{case}")
            out["removal"] = max(out["removal"], diff / bound)

    # 2. the release against the float64 truth, where the computation's error is derived
    gtrue = truth_grads(case, unit, x, gs)
    delta = computation_error(case, unit, x, gs, gtrue)
    delta = torch.where(finite, delta, torch.full_like(delta, math.inf))
    # the rounding of S_i to the dtype: relative u, half a subnormal step per entry below the range
    delta = delta * (1 + UNIT[case.dtype]) + UNIT[case.dtype] * gtrue.norm(dim=1) + \
        math.sqrt(terms) * subnormal_step(case.dtype) / 2
    if delta.isinf().any():
        return out
    gap = (st.gs - gtrue).norm(dim=1)
    assert (gap <= delta + 4 * V * ns).all(), \
        f"stored per-example gradients off the truth by {gap.tolist()} > {delta.tolist()}\n{case}"
    n = gtrue.norm(dim=1)
    c = eo.clip_factor(n, case.bound, case.clip_fn, case.gamma)
    want = (c.unsqueeze(1) * gtrue).sum(0)
    worst = torch.maximum(factor_change(case, st.bound, n, case.bound),
                          factor_change(case, n + delta, n, case.bound))
    worst = torch.maximum(worst, factor_change(case, (n - delta).clamp(min=0), n, case.bound))
    rz_abs = math.sqrt(terms) * subnormal_step(case.dtype)
    per = st.factor * (delta + RZ[case.dtype] * ns) + rz_abs + worst + (st.factor - c).abs() * delta
    tol = release_error(case, st, rows, 1) + float(per.detach().sum()) + 8 * V * (float(want.norm()) + float(full.norm()))
    off = float((full - want).norm())
    if not off <= tol:
        raise fb.TruthMismatch(f"release off the float64 truth by {off:.6g} > derived tolerance {tol:.6g} "
                               f"(|truth| {float(want.norm()):.6g})\n{case}")
    out["truth"], out["compared"] = off / tol if tol > 0 else 0.0, True
    return out


def modes_of(kind: str) -> tuple:
    """The exact modes a generic unit is drawn in (generic units have no backprop bound)."""
    return ("flat", "per_layer")
