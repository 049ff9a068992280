"""The tolerances of the bound fuzzer (tests/fuzz_bounds.py), each derived from the dtype and the
computation: unit roundoffs times counts of roundings (Higham's γ_k), subnormal steps where a value
may leave the normal range, and the margins the proofs in csrc/exact.cpp and bpclip_fast/exact.py
give the layers' norm bounds. None is tuned to what happened to pass."""

from __future__ import annotations

import copy
import math

import torch

from bpclip_fast import exact

import exact_oracle as eo

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
DTYPES = (F64, F32, BF16, F16)
# Unit roundoff of round-to-nearest, and the relative error of rounding toward zero (scale_rows).
UNIT = {F64: 2.0 ** -53, F32: 2.0 ** -24, BF16: 2.0 ** -8, F16: 2.0 ** -11}
RZ = {F64: 2.0 ** -52, F32: 2.0 ** -23, BF16: 2.0 ** -7, F16: 2.0 ** -10}
V = UNIT[F64]


def acc_unit(dtype) -> float:
    """The unit roundoff the kernels accumulate in: float64 for float64 data, float32 otherwise
    (torch's CPU GEMMs, sums and normalisations of the half types run in float32)."""
    return V if dtype == F64 else UNIT[F32]


def gamma(k: float, u: float) -> float:
    """γ_k(u) = k·u/(1 − k·u), the bound on the relative error of k roundings (Higham)."""
    k = max(float(k), 1.0)
    if k * u >= 0.5:
        return math.inf
    return k * u / (1.0 - k * u)


def positions(case: Case, plain: nn.Module, x: torch.Tensor) -> int:
    """T, the most products one parameter entry sums per example (its positions)."""
    if case.kind in ("linear", "hf_conv1d"):
        return max(1, math.prod(case.shape[:-1]))
    if case.kind == "conv1d":
        with torch.no_grad():
            return copy.deepcopy(plain).double()(torch.zeros((1, *case.shape), dtype=F64)).shape[-1]
    if case.kind == "conv":
        with torch.no_grad():
            out = copy.deepcopy(plain).double()(torch.zeros((1, *case.shape), dtype=F64))
        return out.shape[-1] * out.shape[-2]
    if case.kind == "conv3d":
        with torch.no_grad():
            return math.prod(copy.deepcopy(plain).double()(torch.zeros((1, *case.shape), dtype=F64)).shape[2:])
    if case.kind in ("layer_norm", "rms_norm"):
        return max(1, math.prod(case.shape[:len(case.shape) - len(case.geometry["normalized"])]))
    if case.kind == "group_norm" or case.kind.startswith("instance_norm"):
        return max(1, math.prod(case.shape[1:]))
    if case.kind in ("embedding", "embedding_bag"):
        return max(1, math.prod(case.shape))
    return 1


def release_error(case: Case, st: Stored, rows, T: int) -> float:
    """A bound on ‖R(S) − Σ_{i∈S} C̃_i‖ for the layer's release R(S) of the examples ``rows``: each
    coordinate sums at most N = |S|·T products (plus one for the factor) in u_acc, so errs by at most
    γ_{N+2}(u_acc) times the sum of its absolute terms, whose Frobenius norm is at most Σ_i terms_i;
    then one rounding to the dtype (u of the dtype, relative)."""
    if not rows:
        return 0.0
    n = len(rows)
    ua = acc_unit(case.dtype)
    if st.kept or case.kind not in ("linear", "conv", "conv1d", "hf_conv1d", "conv3d") and case.mode != "backprop":
        count = n + 2  # a GEMV / index_add over the examples of already-formed per-example values
    else:
        count = n * T + 2
    terms = float(st.terms[rows].sum())
    exact_sum = float(st.contrib[rows].sum(0).norm())
    relative = (gamma(count, ua) * terms * (1 + UNIT[case.dtype])
                + UNIT[case.dtype] * (exact_sum + gamma(count, ua) * terms))
    # Below the normal range rounding is absolute: half a subnormal step of the dtype for the one
    # rounding to the dtype (the output), and one step of the accumulation dtype per operation.
    coords = st.contrib.shape[1]
    absolute = math.sqrt(coords) * (subnormal_step(case.dtype) / 2 + count * subnormal_step(
        F64 if case.dtype == F64 else F32))
    return relative + absolute


def subnormal_step(dtype) -> float:
    """The spacing of ``dtype``'s subnormal numbers (its smallest positive value)."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps


def underflow_margin(case: Case, T: int, d: int, p: int, sums) -> torch.Tensor:
    """What csrc/exact.cpp's bound adds for the GEMMs' underflow, both methods at once, from
    ``sums = (M, A1, B1)`` (:func:`bounded_terms`): ghost's ``√`` of the terms of ``E`` beyond
    ``(γ_d + γ_p + γ_dγ_p)M²`` (which ``eps·P²`` covers), ``2M(κ_d(1+γ_p)B1 + κ_p(1+γ_d)A1) +
    2κ_dκ_p(T·M + A1·B1)``, and instantiation's ``√(τ(A1+B1)√(dp)M) + (1+γ_T)√(2Tτ(T+1)(1+γ_T)√(dp)M)``;
    τ the accumulation dtype's smallest normal, each with the proof's own slack (1 + w)(1 + 2^-40),
    here 1 + 1e-9."""
    if T == 1:
        return torch.zeros_like(sums[0])
    u = acc_unit(case.dtype)
    tau = torch.finfo(F64 if case.dtype == F64 else F32).tiny
    M, A1, B1 = (t * (1 + 1e-9) for t in sums)
    gd, gp, gT = gamma(d, u), gamma(p, u), gamma(T, u)

    def kappa(k, g):
        return tau * math.sqrt(k) + (1 + g) * 0.5 * math.sqrt(2 * k * tau * (k + 1) * (1 + g))

    kd, kp = kappa(d, gd), kappa(p, gp)
    ghost = (2 * M * (kd * (1 + gp) * B1 + kp * (1 + gd) * A1) + 2 * kd * kp * (T * M + A1 * B1)).sqrt()
    root_dp = math.sqrt(d * p)
    inst = (tau * (A1 + B1) * root_dp * M).sqrt() + (1 + gT) * (2 * T * tau * (T + 1) * (1 + gT) * root_dp * M).sqrt()
    return (ghost + inst) * (1 + 1e-9)


def bounded_terms(case: Case, T: int, d: int, p: int, xn: torch.Tensor, gn: torch.Tensor):
    """``(P, √p·X, (M, A1, B1))`` as csrc/exact.cpp builds them: from upper bounds of the position norms
    (``xn``, ``gn``: exact float64, ``[n, positions]``), which where ``T > 1`` are the accumulation
    dtype's sums of ``k`` squares inflated by ``1 + 2γ_{k+2}(u)`` plus ``3k·τ`` for underflow (τ its
    smallest normal; at ``T = 1`` fp64 data adds ``3k·τ`` too), and sums over the positions in double
    (here with the bias 1 always, and
    ``1 + 1e-12`` for the code's own slack)."""
    if T > 1:
        acc = F64 if case.dtype == F64 else F32
        u, tau = UNIT[acc], torch.finfo(acc).tiny
        xn = (xn.square() * (1 + 2 * gamma(d + 2, u)) + 3 * d * tau).sqrt()
        gn = (gn.square() * (1 + 2 * gamma(p + 2, u)) + 3 * p * tau).sqrt()
    elif case.dtype == F64:  # the kernel's own double sums add 3k·τ for fp64 squares that underflow
        tau = torch.finfo(F64).tiny
        xn = (xn.square() + 3 * d * tau).sqrt()
        gn = (gn.square() + 3 * p * tau).sqrt()
    rows = (xn.square() + 1).sqrt()
    slack = 1 + 1e-12
    return ((gn * rows).sum(1) * slack, math.sqrt(p) * rows.sum(1) * slack,
            ((xn * gn).sum(1) * slack, xn.sum(1) * slack, gn.sum(1) * slack))


def norm_margin(case: Case, T: int, d: int, p: int, P: torch.Tensor, n: torch.Tensor,
                pX: torch.Tensor, sums) -> torch.Tensor:
    """How far a Linear/Conv2d norm bound may exceed the exact norm ``n``, from the proof in
    csrc/exact.cpp (both methods at once): the computed ``sq ≤ (n + γ_T(u)P)² + eps·P²`` (instantiation;
    ghost: ``eps = e1 + γ_{T²}(v)(1 + e1)``), times ``grow``, plus ``eps·P²`` and ``κ·P``
    (``κ = γ_T(u) + γ_T(v) + r``, r the rounding toward zero of c·g to the accumulation dtype), and the
    subnormal term ``2K·q·√p·X`` (K = 2^60, q the accumulation dtype's subnormal step; ``pX`` is
    ``√p·X``); the layer's spread is at most ours inflated by ``2γ_{d+p+T+4}(u)``.
    So ``bound ≤ √grow·(n + (γ_T(u) + √(2 eps))·P') + κ·P' + 2Kq·pX``, plus the GEMMs' underflow
    terms (:func:`underflow_margin`)."""
    u = acc_unit(case.dtype)
    acc = F64 if case.dtype == F64 else F32
    r = RZ[acc]
    e1 = (1 + gamma(d, u)) * (1 + gamma(p, u)) * (1 + u) - 1
    eps = e1 + gamma(T * T, V) * (1 + e1)
    if T == 1:  # the code's eps: the seven roundings of (a a)(b b), the formula's eight, fp64's 3k·τ addition
        e1 = (1 + gamma(d + 1, u)) * (1 + gamma(p + 1, u)) * (1 + u) ** 7 - 1
        eps = e1 + gamma(8, V) * (1 + e1)
    kappa = gamma(T, u) + gamma(T, V) + r
    groups = case.geometry.get("groups", 1)  # the kernel adds up the channel groups' sq (G - 1 additions)
    grow = 1.0 / ((1 - u) * (1 - gamma(max(T * T, d * p) + p + 2 + groups - 1, V)))
    Pp = P * (1 + 2 * gamma(d + p + T + 4, u)) * (1 + 4 * V)
    subnormal = 2.0 * 2.0 ** 60 * subnormal_step(acc) * pX * (1 + 4 * gamma(d + p + T + 4, u))
    relative = (math.sqrt(grow) * (gamma(T, u) + math.sqrt(2 * eps)) + kappa) * Pp
    lift = 0.0
    if T == 1 and case.dtype == F64:
        # the position norms' 3k·τ (bounded_terms) raise each group's a·b above ‖x‖‖g‖ by at most this
        tau = torch.finfo(F64).tiny
        lift = (math.sqrt(3 * p * tau) * sums[1] + math.sqrt(3 * d * tau) * sums[2] +
                groups * 3 * math.sqrt(d * p) * tau) * math.sqrt(grow) * (1 + 1e-9)
    return (math.sqrt(grow) - 1) * n + relative + subnormal + lift + underflow_margin(case, T, d, p, sums)


def dense_margin(terms: int, n: torch.Tensor) -> torch.Tensor:
    """How far DenseExamples'/RowExamples' bound ``√(ŝ·grow)`` may exceed the stored norm: the double
    sum of ``terms`` exact squares (γ_terms(v)), ``grow = 1 + (terms + 5)·2^-52`` (both use
    ``grow(terms + 1)`` for their fp64 underflow term, whose own size is the caller's ``under``) and
    three roundings."""
    return n * ((1 + gamma(terms, V)) * (1 + (terms + 5) * 2.0 ** -52) * (1 + V) ** 3 - 1)


def normalisation_error(case: Case, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``[B]``: a bound on ‖G_stored − G_true‖ for LayerNorm/GroupNorm's affine gradients, where the
    layer computes x̂ = (x − μ)·rstd in u_acc (float32 for the half types) and rounds the
    per-example gradients to the dtype. Per normalised set of k entries: |μ̂ − μ| ≤ γ_k·√m2,
    |var̂ − var| ≤ γ_{2k+4}·m2 (m2 the mean square), so rstd errs relatively by at most
    1/√(1 − q) − 1 + 3u with q = γ_{2k+4}·m2/(var + eps) (infinite for q ≥ 1/2: the set is too
    ill-conditioned to compare with float64, and the bound checks alone apply); both statistics are
    then rounded to the dtype (torch's CPU kernels return them in it); each x̂ entry then errs by
    rstd·|μ̂ − μ| + |x̂|·(rstd's error) + 2u|x̂|, and Σ_t g_t x̂_t by Σ|g_t|·err_t + γ_T(u)Σ|g_t||x̂_t|."""
    u = acc_unit(case.dtype)
    b = x.shape[0]
    rms = case.kind == "rms_norm"  # μ = 0 exactly (the kernel reads a zero mean), var is m2
    acc = F64 if case.dtype == F64 else F32
    if case.kind in ("layer_norm", "rms_norm"):
        k = math.prod(case.geometry["normalized"])
        sets = x.reshape(b, -1, k)
    else:
        groups = case.geometry["groups"] if case.kind == "group_norm" else case.geometry["channels"]
        sets = x.reshape(b, groups, -1)
        k = sets.shape[-1]
    eps = case.geometry["eps"] if rms else 1e-5
    m2 = sets.square().mean(-1, keepdim=True)
    mu = torch.zeros_like(m2) if rms else sets.mean(-1, keepdim=True)
    var = m2 if rms else sets.var(-1, unbiased=False, keepdim=True)
    rstd = (var + eps).rsqrt()
    # RMSNorm: m2 is a sum of k squares (γ_{k+2}), whose underflowing squares lose k subnormal steps
    q = ((gamma(k + 2, u) * m2 + k * subnormal_step(acc)) if rms else gamma(2 * k + 4, u) * m2) / (var + eps)
    rel = torch.where(q < 0.5, (1 - q.clamp(max=0.5)).rsqrt() - 1 + 3 * u, torch.full_like(q, math.inf))
    xhat = (sets - mu) * rstd
    # torch's CPU native_layer_norm/native_group_norm return the statistics in the data's dtype: the
    # mean and rstd the per-example gradients read are rounded once more, by the dtype's u
    # (RMSNorm's rstd stays in the accumulation dtype: the extra rounding is a valid, loose bound)
    ud = UNIT[case.dtype]
    rel = (1 + rel) * (1 + ud) - 1
    dmu = (gamma(k, u) * m2.sqrt() * (1 + ud) + ud * mu.abs()
           + (k + 2) * subnormal_step(acc) / 2 + subnormal_step(case.dtype) / 2)  # subnormal x: absolute
    if rms:
        dmu = torch.zeros_like(dmu)
    finite = rel.nan_to_num(posinf=0.0)
    err = rstd * (1 + finite) * dmu + xhat.abs() * finite + 2 * u * xhat.abs()
    err = torch.where(rel.isinf().expand_as(err), torch.full_like(err, math.inf), err)
    err, xhat = err.reshape(x.shape), xhat.reshape(x.shape)
    ga = g.abs()
    if case.kind in ("layer_norm", "rms_norm"):  # sums over the leading positions
        dims = tuple(range(1, x.dim() - len(case.geometry["normalized"])))
    else:  # sums over the spatial positions
        dims = tuple(range(2, x.dim()))
    T = max(1, math.prod(x.shape[d] for d in dims))

    def over(t):  # (t.sum(()) would sum every dim)
        return t.sum(dims) if dims else t

    ew = over(torch.where(ga == 0, torch.zeros_like(err), ga * err))  # a zero gradient entry adds nothing
    acc_w, acc_b = over(ga * xhat.abs()), over(ga)
    ew = ew.reshape(b, -1).norm(dim=1) + gamma(T + 2, u) * acc_w.reshape(b, -1).norm(dim=1)
    eb = gamma(T + 2, u) * acc_b.reshape(b, -1).norm(dim=1)
    return ew + (eb if (case.bias or case.kind == "group_norm") and not rms else 0)


def example_error(case: Case, x: torch.Tensor, g: torch.Tensor, gtrue: torch.Tensor) -> torch.Tensor:
    """``[B]``: a bound on ‖G_stored − G_true‖ for the instantiating layers: the computation's
    error (:func:`normalisation_error`; an embedding row sums its positions' gradients in u_acc; the
    added parameters' gradients are g itself), then one rounding to the dtype."""
    b = x.shape[0]
    # rounding to the dtype: relative, and below the normal range half a subnormal step per entry
    # (and one step of the accumulation dtype per summed product)
    T = positions(case, None, x) + 2
    out_round = UNIT[case.dtype] * gtrue.norm(dim=1) + math.sqrt(gtrue.shape[1]) * (
        subnormal_step(case.dtype) / 2 + T * subnormal_step(F64 if case.dtype == F64 else F32))
    if case.kind in ("layer_norm", "group_norm", "rms_norm") or case.kind.startswith("instance_norm"):
        return normalisation_error(case, x, g) * (1 + UNIT[case.dtype]) + out_round
    if case.kind == "embedding":
        T = max(1, math.prod(case.shape))
        gs = g.reshape(b, T, -1).norm(dim=2).sum(1)
        return gamma(T + 1, acc_unit(case.dtype)) * gs * (1 + UNIT[case.dtype]) + out_round
    if case.kind == "embedding_bag":
        # a row entry sums w_t·g_{i,d} over the bag's T entries (sum: w = 1, Σ|w| ≤ T; mean: w = 1/|bag|
        # rounded, Σ|w| ≤ 1): the products, 1/|bag| and the sum are T + 2 roundings of u_acc, relative
        # to Σ_t |w_t|·‖g_i‖; max writes g_i's entries as they are (no arithmetic)
        T = max(1, math.prod(case.shape))
        weight = {"sum": T, "mean": 1, "max": 0}[case.geometry["mode"]]
        gs = weight * g.reshape(b, -1).norm(dim=1)
        return gamma(T + 2, acc_unit(case.dtype)) * gs * (1 + UNIT[case.dtype]) + out_round
    return torch.zeros(b, dtype=F64)


def factor_change(case: Case, bound: torch.Tensor, n: torch.Tensor, c: float) -> torch.Tensor:
    """max |f(b') − f(n)|·n over the bounds b' the layer's factor may act as: how much taking the
    factor from the layer's bound instead of the exact norm moves an example's clipped gradient
    (exact_oracle.clip_factor on both). exact.factors rounds the bound up to the factor dtype (fp32,
    fp64 for fp64 data) and clip_rows compares it with C' = RN(C(1 − η_1)), η_1 = 2^-50
    (csrc/include/bpclip_fast/clip.h), then rounds the factor: so b' ranges over b(1 ± ε) with
    ε = 4 u_fac + 2^-49 (global flips there); and factors below exact.FACTOR_FLOOR are 0 (the
    subnormal part of csrc/exact.cpp's proof holds for c >= 2^-60 only: an example whose bound
    exceeds 2^60·C is dropped, not clipped)."""
    eps = 4 * acc_unit(case.dtype) + 2.0 ** -49
    fn = eo.clip_factor(n, c, case.clip_fn, case.gamma)
    worst = torch.zeros_like(n)
    for b in (bound * (1 - eps), bound, bound * (1 + eps)):
        fb = eo.clip_factor(b, c, case.clip_fn, case.gamma)
        fb = torch.where(fb < exact.FACTOR_FLOOR, torch.zeros_like(fb), fb)
        worst = torch.maximum(worst, (fb - fn).abs() * n)
    return worst
