"""Empirical privacy audits: an ε lower bound measured on training runs of the real code.

What runs is the library itself — ``PrivacyEngine.make_private``, the clipped layers and their
kernels, the private loader's sampler, the noise stream, ``DPOptimizer.step()`` and the
accountant — on a model and data crafted so that a chosen example (a *canary*) is as visible as
the guarantee allows. Nothing of the mechanism is re-implemented here: this module only builds the
data, runs an ordinary training loop, reads the released updates and scores them. If the code adds
less noise than it claims (a sensitivity divided by the batch size, a halved std, a draw skipped
after a gradient was zeroed in place), the released updates show it and the lower bound rises
above the claimed ε.

White-box gradient canaries
---------------------------
The audited model (:class:`CanaryModel`) is ``L`` parallel bias-optional ``Linear(width, classes)``
heads, head ``l`` reading slice ``l`` of an input ``[B, L, width]``; an example is ``(x, v)`` and
its loss is the linear ``⟨v, model(x)⟩``, so its gradient at head ``l`` is ``v_l x_lᵀ`` (bias
``v_l``) whatever the weights. Canary ``j`` has ``x_l = R·e_{a_j}`` and ``v_l = R·e_{b_j}`` in every
head with ``R`` ten times the clipping bounds: every mode clips it to exactly its bound (backprop:
``C_g·C_x`` per head, plus the bias; flat: ``C`` over all heads; per_layer: ``C_l`` per head), in a
direction of its own pair ``(a_j, b_j)`` (with a bias, an output of its own: the bias gradient is
``v``). An *excluded* canary is replaced by the accountant's neighbour of it (:func:`_excluded`):
a null example (``x = v = 0``) for add/remove, whose gradient is exactly zero in every mode, so
the release is distributed as if the example were absent (``bpclip_fast.engine``: the release is
``(1/B̄)(Σ_i c_i + noise)`` with ``c_i`` a function of example ``i`` alone) while the dataset size,
hence the sample rate the accountant is told, stays fixed; the canary with its loss negated for
replace-one (zCDP), ``2Δ`` away.

The score reads every step
--------------------------
Training uses plain SGD (``lr``, no momentum, no weight decay); after every step the auditor
reads the released gradient (white box; :mod:`bpclip_fast.audit.noise` checks that it is what
moved the parameters). It whitens each layer's coordinates by the noise std the engine *claims*
for that layer (``σ_l Δ_l``, over ``B̄`` for a mean loss) and projects on canary ``j``'s whitened contribution ``w_j`` (measured once
through a noise-free copy of the real layers): under the claim, the projection is
``N(μ_j·[j in the batch], 1)`` with ``μ_j = ‖w_j‖``. With sample rate ``q`` the step's
log-likelihood ratio ``log(1 − q + q·exp(μ_j y − μ_j²/2))`` is added to the score (for ``q = 1`` a
monotone function of the projection). Any score is a valid attack: the bounds of
:mod:`bpclip_fast.audit.stats` hold whatever it is; this one is the most powerful against the
claimed mechanism. Under correlated noise (``noise="banded"``) the score and the residual check
read the release through the engine's band coefficients (:mod:`bpclip_fast.audit.score`, :mod:`bpclip_fast.audit.noise`).

Verdict
-------
A report is a violation when the lower bound exceeds the claimed ε, when the residual noise check
(:mod:`bpclip_fast.audit.noise`: the released noise against the claimed Gaussian) finds less noise
than claimed or correlated draws, or when a canary's contribution exceeds the bound its noise is
scaled to (``canary_reach > 1``).

Modes
-----
* :func:`one_run` — Steinke, Nasr, Jagielski (NeurIPS 2023): ``m`` canaries, each included with
  probability ½, one training run; guesses on the highest and lowest scores.
* :func:`many_run` — one canary, many short runs with and without it (and ``fillers`` ordinary
  examples that never touch the canary's coordinates); Clopper–Pearson on a threshold chosen on a
  held-out part of the runs. The tight check of a single step.

Training loops (``loop``): ``"plain"`` (zero_grad, backward, step); ``"inplace-zero"`` (the same with
``zero_grad(set_to_none=False)``: each step's backward lands on the last release zeroed in place,
which must restart the layer and take the step's draw); ``"micro-batches"`` (two micro-batches
accumulated into one step inside ``optimizer.accumulate()``). A loop that clears a gradient between two backward passes of one step is
refused by the engine (``redraw``), so it is not one to audit.
"""

from __future__ import annotations

import functools
import math
import secrets
import time
import warnings
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .. import nn as bnn
from . import stats
from .noise import NoiseCheck
from .score import Scorer as _Scorer, groups as _groups
from .noise_free import NoiseFree

MODES = ("backprop", "flat", "per_layer")
ACCOUNTANTS = ("rdp", "pld", "zcdp")
LAYERS = ("linear", "conv")
LOOPS = ("plain", "inplace-zero", "micro-batches")
NOISES = ("independent", "banded")
_OVERSHOOT = 10.0  # canary magnitude over the clipping bounds: every mode clips it to its bound


class CanaryModel(nn.Module):
    """``L`` parallel heads, ``Linear(width, classes)`` or a 1×1 ``Conv2d(width, classes)`` on a 1×1
    image (the same gradient ``v xᵀ`` through the convolution's kernels); input ``[B, L, width]``,
    output ``[B, L, classes]``."""

    def __init__(self, heads: int, width: int, classes: int, bias: bool, layer: str = "linear"):
        super().__init__()
        self.conv = layer == "conv"
        make = (lambda: nn.Conv2d(width, classes, 1, bias=bias)) if self.conv else \
            (lambda: nn.Linear(width, classes, bias=bias))
        self.heads = nn.ModuleList(make() for _ in range(heads))

    def forward(self, x):
        if self.conv:
            return torch.stack([head(x[:, i, :, None, None]).flatten(1) for i, head in enumerate(self.heads)], dim=1)
        return torch.stack([head(x[:, i]) for i, head in enumerate(self.heads)], dim=1)


def linear_loss(out: torch.Tensor, v: torch.Tensor, reduction: str) -> torch.Tensor:
    """``⟨v_i, out_i⟩`` per example, reduced over the batch (mean or sum)."""
    per_example = (out * v).flatten(1).sum(1)
    return per_example.mean() if reduction == "mean" else per_example.sum()


@dataclass(frozen=True)
class Settings:
    """One audited configuration. ``clip`` is flat's ``C``, per_layer's total ``C`` (split as
    ``C/√L``), or backprop's ``input_clip = grad_clip``. ``seed``: makes inclusion, fillers and the
    noise reproducible (an explicit noise seed: for tests and reruns, never for real training).
    ``noise``/``bands``: ``make_private``'s (``"banded"``: correlated noise over ``bands`` steps, cyclic
    Poisson sampling; :func:`_check_banded` for what it needs of the other settings)."""

    mode: str = "flat"
    accountant: str = "rdp"
    noise_multiplier: float = 2.0
    steps: int = 1
    batch_size: int | None = None   # default: the whole dataset (q = 1)
    heads: int = 2
    layer: str = "linear"
    width: int = 64
    classes: int = 16
    bias: bool = False
    clip: float = 1.0
    loss_reduction: str = "mean"
    loop: str = "plain"
    fillers: int = 0
    delta: float = 1e-5
    confidence: float = 0.95
    lr: float = 1.0
    seed: int | None = None
    noise: str = "independent"
    bands: int = 1

    def check(self, what: str) -> None:
        for name, allowed in (("mode", MODES), ("accountant", ACCOUNTANTS), ("loop", LOOPS), ("layer", LAYERS),
                              ("loss_reduction", ("mean", "sum")), ("noise", NOISES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{what}: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("steps", "heads", "width", "classes", "bands"):
            value = getattr(self, name)
            if int(value) != value or value < 1:
                raise ValueError(f"{what}: {name} must be a positive integer, got {value!r}")
        if int(self.fillers) != self.fillers or self.fillers < 0:
            raise ValueError(f"{what}: fillers must be a non-negative integer, got {self.fillers!r}")
        for name in ("noise_multiplier", "clip", "lr"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{what}: {name} must be a positive finite number, got {value!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"{what}: delta must be in (0, 1), got {self.delta!r}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"{what}: confidence must be in (0, 1), got {self.confidence!r}")
        if self.noise == "independent" and self.bands != 1:
            raise ValueError(f"{what}: bands={self.bands} needs noise='banded' (independent noise has one band)")


def _check_banded(s: Settings, what: str, n: int) -> None:
    """What correlated noise needs of an audit with ``n`` examples (canaries and fillers): the engine's
    own conditions (rdp/pld, a row drawn once per step), each batch drawn from one of ``bands``
    groups of ``n/bands`` (so ``bands·batch_size ≤ n``, and ``n`` a multiple of ``bands``: the remainder
    would never be sampled, a canary among it never scored), and at least ``bands`` steps, so that
    every group — every canary — has a step of its own (the claim composes ``ceil(steps/bands)``)."""
    if s.noise != "banded":
        return
    b = s.bands
    why = None
    if s.accountant == "zcdp":
        why = "its accounting is the Poisson reduction of the rdp and pld accountants; use accountant='rdp' or 'pld'"
    elif n % b:
        why = (f"the {n} examples (canaries and fillers) must be a multiple of bands={b}: cyclic Poisson sampling "
               f"never samples the remainder; add {b - n % b} fillers")
    elif (s.batch_size or n) * b > n:
        why = (f"each batch is drawn from one group of n/bands = {n // b} examples, so batch_size must be at most "
               f"{n // b}, got {s.batch_size or n}" + (" (the default: the whole dataset)" if not s.batch_size else ""))
    elif s.steps < b:
        why = (f"steps must be at least bands={b} (got {s.steps}): step t samples group t mod bands, and a canary "
               "of a group no step visits has no score")
    if why is not None:
        raise ValueError(f"{what}: noise='banded' with bands={b}: {why}")


# The defaults of each audit (also the CLI's): one step of the whole dataset. One run at δ = 1e-5 with
# σ = 2 claims ε = 2.17 (rdp), within the 4.57 that 1000 canaries can certify. Many runs test the
# claim at δ = 1e-2, where a few thousand runs resolve a factor 2 in the noise (σ = 1.5: claimed
# 1.63, halved noise measured 2.1 with 4000 runs; see tests/test_audit_empirical.py).
ONE_RUN_DEFAULTS = Settings()
MANY_RUN_DEFAULTS = Settings(noise_multiplier=1.5, delta=1e-2, fillers=15)


# ---------------------------------------------------------------------------------------------- data
def _canary(s: Settings, pair, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = pair
    x = torch.zeros(s.heads, s.width, dtype=dtype)
    v = torch.zeros(s.heads, s.classes, dtype=dtype)
    x[:, a] = _OVERSHOOT * s.clip
    v[:, b] = _OVERSHOOT * s.clip
    return x, v


def _fillers(s: Settings, n: int, gen: torch.Generator, dtype, avoid=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ordinary examples of random size around the bounds (some clipped, some not); with ``avoid =
    (a, b)`` their inputs are 0 at feature ``a`` and their loss vectors 0 at output ``b``, so their
    gradient is 0 wherever the canary's is not."""
    x = torch.randn(n, s.heads, s.width, generator=gen, dtype=torch.float64)
    v = torch.randn(n, s.heads, s.classes, generator=gen, dtype=torch.float64)
    x *= s.clip * torch.rand(n, 1, 1, generator=gen, dtype=torch.float64) * 2 / math.sqrt(s.width)
    v *= s.clip * torch.rand(n, 1, 1, generator=gen, dtype=torch.float64) * 2 / math.sqrt(s.classes)
    if avoid is not None:
        x[:, :, avoid[0]] = 0
        v[:, :, avoid[1]] = 0
    return x.to(dtype), v.to(dtype)


def _pairs(s: Settings, m: int, what: str):
    """Canary ``j``'s (input feature, output) pair: distinct for every canary, so that the canaries'
    contributions are orthogonal (one canary's inclusion does not move another's score). With a bias
    the bias gradient is ``v`` itself, so every canary needs an output of its own."""
    if s.bias:
        if m > s.classes:
            raise ValueError(f"{what}: with bias=True each of the {m} canaries needs its own output (the bias "
                             f"gradient is the loss vector v), but classes = {s.classes}; set classes >= canaries "
                             "(a small width keeps the model small), or bias=False")
        return [(j % s.width, j) for j in range(m)]
    if m > s.width * s.classes:
        raise ValueError(f"{what}: {m} canaries need {m} distinct (input, output) pairs but width·classes = "
                         f"{s.width * s.classes}; raise width or classes, or use fewer canaries")
    return [(j % s.width, (j // s.width) % s.classes) for j in range(m)]


# ---------------------------------------------------------------------------------------------- training
def _private(s: Settings, x: torch.Tensor, v: torch.Tensor, noise_seed, probe: bool = True):
    """``(engine, model, optimizer, loader)``: a fresh CanaryModel made private by the real engine
    (``probe``: its dynamic probes of the model, which release nothing; many-run runs them once)."""
    from ..engine import InsecureSeedWarning, PrivacyEngine

    model = CanaryModel(s.heads, s.width, s.classes, s.bias, s.layer).to(x.dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=s.lr)
    batch = s.batch_size or len(x)
    loader = DataLoader(TensorDataset(x, v), batch_size=batch)
    engine = PrivacyEngine(s.accountant)
    if s.mode == "backprop":
        clipping = dict(input_clip=s.clip, grad_clip=s.clip)
    else:
        clipping = dict(clipping=s.mode, max_grad_norm=s.clip)
    with warnings.catch_warnings():  # an explicit seed warns that it is insecure: here it is the point
        warnings.filterwarnings("ignore", category=InsecureSeedWarning)
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=s.noise_multiplier,
            loss_reduction=s.loss_reduction, poisson_sampling=s.accountant != "zcdp", noise_seed=noise_seed,
            probe=probe, noise=s.noise, bands=s.bands, **clipping)
    return engine, model, optimizer, loader


def _backward(s: Settings, model, xb, vb) -> None:
    if len(xb):
        linear_loss(model(xb), vb, s.loss_reduction).backward()


def _one_step(s: Settings, model, optimizer, xb, vb) -> None:
    """One step of the training loop ``s.loop`` on the batch ``(xb, vb)`` (possibly empty)."""
    optimizer.zero_grad(set_to_none=s.loop != "inplace-zero")
    if s.loop == "micro-batches":
        half = (len(xb) + 1) // 2
        with optimizer.accumulate():
            _backward(s, model, xb[:half], vb[:half])
            _backward(s, model, xb[half:], vb[half:])
    else:
        _backward(s, model, xb, vb)
    optimizer.step()


def _params(model):
    """The clipped layers' parameters in the order of :func:`contributions` and :func:`_noise_scale`."""
    return [p for _, layer in bnn.clipped_layers(model) for p in (layer.weight, layer.bias) if p is not None]


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in _params(model)])


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
                      for p in _params(model)])


def _noise_scale(s: Settings, engine, model, batch: int) -> torch.Tensor:
    """Per coordinate of the flattened parameters: the std of the noise the engine claims to add to
    the update (``lr·σ_l·Δ_l``, over ``B̄`` for a mean loss)."""
    scale = []
    for _, layer in bnn.clipped_layers(model):
        std = float(layer._bp_noise_multiplier) * float(layer.sensitivity) * s.lr
        if s.loss_reduction == "mean":
            std /= batch
        for p in (layer.weight, layer.bias):
            if p is not None:
                scale.append(torch.full((p.numel(),), std, dtype=torch.float64))
    return torch.cat(scale)


def noise_free(model) -> NoiseFree:
    """A noise-free copy of the private ``model``'s real layers (its own dtype) whose ``release`` is
    the clipped sum of a batch under the sum loss, in the units of the bounds. The canary model's
    gradients do not depend on the weights, so one copy serves every step and run."""
    mode = bnn.clipped_layers(model)[0][1]._bp_clipping
    return NoiseFree(model, mode, "sum", None, lambda out, w: linear_loss(out, w, "sum"), dtype=None)


def contributions(shadow: NoiseFree, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Sparse ``[n, P]``: each example's clipped contribution, alone, to the flattened parameter
    gradient (``shadow``: :func:`noise_free`). Sparse because a canary touches a few coordinates of
    many (one output row and its bias per layer)."""
    rows, cols, vals, size = [], [], [], 0
    for i in range(len(x)):
        r = torch.cat(shadow.release(x[i:i + 1], v[i:i + 1])).double()
        nz = r.nonzero().squeeze(1)
        rows.append(torch.full_like(nz, i))
        cols.append(nz)
        vals.append(r[nz])
        size = r.numel()
    indices = torch.stack([torch.cat(rows), torch.cat(cols)])
    return torch.sparse_coo_tensor(indices, torch.cat(vals), (len(x), size), check_invariants=True).coalesce()


def _scorer(s: Settings, engine, model, canary_x, canary_v, batch: int, rate: float):
    """``(scorer, reach, check)``: the scorer for canaries ``(canary_x, canary_v)``, the ratio of each
    canary's contribution to its bound (1: the full bound; below 1 the audit loses power, above 1
    the noise does not cover it), and the residual noise check (:mod:`bpclip_fast.audit.noise`)."""
    shadow = noise_free(model)
    raw = contributions(shadow, canary_x, canary_v)
    rows, cols = raw.indices()
    scale = _noise_scale(s, engine, model, batch)
    share = s.lr / (batch if s.loss_reduction == "mean" else 1)  # a contribution's share of an update
    whitened = raw.values() * share / scale[cols]
    mu = torch.zeros(len(canary_x), dtype=torch.float64).index_add_(0, rows, whitened ** 2).sqrt()
    if not bool((mu > 0).all()):
        raise RuntimeError("audit: a canary has no contribution through the model (is a layer frozen?)")
    names = [f"{name}.{kind}" for name, layer in bnn.clipped_layers(model)
             for kind, p in (("weight", layer.weight), ("bias", layer.bias)) if p is not None]
    sizes = [p.numel() for p in _params(model)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    params = [(name, slice(a, a + n)) for name, a, n in zip(names, starts, sizes)]

    def expected(xb, vb):
        if len(xb) == 0:
            return torch.zeros(sum(sizes), dtype=torch.float64)
        return torch.cat(shadow.release(xb, vb)).double() * share

    band = claimed_band(engine)
    check = NoiseCheck(expected, scale, params, band)
    return _Scorer(rows, cols, whitened / mu[rows], mu, scale, rate, band), _reach(model, raw), check


def claimed_band(engine) -> tuple:
    """The band the engine claims its noise follows (``(1.0,)``: independent noise): its own
    ``band_coefficients``, read from the engine as the noise std is read from the layers, so that a
    recursion that departs from them shows in the whitened residuals."""
    return tuple(float(v) for v in engine.band_coefficients) if engine.bands != 1 else (1.0,)


def _reach(model, raw: torch.Tensor) -> torch.Tensor:
    """Each canary's contribution over the bound the noise is scaled to (1: the full bound). Exact
    modes: ``‖c‖/C`` (flat's ``C``; per_layer's ``(Σ_l C_l²)^½``). Backprop, whose layers are noised
    separately: ``(Σ_l (‖c_l‖/Δ_l)²/L)^½``, 1 when the canary reaches every layer's ``Δ_l``."""
    layers = [layer for _, layer in bnn.clipped_layers(model)]
    rows, cols = raw.indices()
    m = raw.shape[0]
    if layers[0].exact:
        sq = torch.zeros(m, dtype=torch.float64).index_add_(0, rows, raw.values() ** 2)
        return sq.sqrt() / float(layers[0]._bp_noise_bound)
    sizes = [sum(p.numel() for p in (layer.weight, layer.bias) if p is not None) for layer in layers]
    layer_of = torch.repeat_interleave(torch.arange(len(layers)), torch.tensor(sizes))
    delta = torch.tensor([float(layer.sensitivity) for layer in layers], dtype=torch.float64)
    sq = torch.zeros(m * len(layers), dtype=torch.float64).index_add_(
        0, rows * len(layers) + layer_of[cols], (raw.values() / delta[layer_of[cols]]) ** 2)
    return sq.view(m, len(layers)).mean(1).sqrt()


def _train(s: Settings, engine, model, optimizer, loader, scorer: _Scorer, check: NoiseCheck) -> None:
    steps = 0
    check.new_run()
    scorer.new_run()
    if len(scorer.coefficients) > 1:  # a fresh loader: its partition into groups
        scorer.group = _groups(loader, len(scorer.mu))
    while steps < s.steps:
        for xb, vb in loader:
            if len(scorer.coefficients) > 1 and loader.counter.last_t != steps:
                # the whitening and the groups take step k to be row k of the block begun at row 0
                raise RuntimeError(f"audit: step {steps} used batch {loader.counter.last_t}, not batch {steps}")
            before = _flat_params(model)
            _one_step(s, model, optimizer, xb, vb)
            # The released gradient, read exactly (a float32 parameter difference rounds away an
            # update below the parameters' ulp); the check confirms it is what moved the parameters.
            update = _flat_grads(model) * s.lr
            check.applied(before, _flat_params(model), update, torch.finfo(_params(model)[0].dtype).eps)
            scorer.add(update, steps)
            check.add(update, xb, vb)
            steps += 1
            if steps == s.steps:
                scorer.finish()
                return


def _isolated(audit):
    """Leaves the caller's state as it was: torch's global RNG (the canary model's initialisation
    draws from it) and the intra-op threads (one while the audit runs: the model is tiny, and one
    thread is faster than several)."""
    @functools.wraps(audit)
    def run(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[]):
                return audit(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return run


def _seeds(s: Settings):
    """``(numpy seed for inclusion, torch generator for fillers, noise seed or None)``."""
    if s.seed is None:
        return secrets.randbits(63), torch.Generator().manual_seed(secrets.randbits(63)), None
    return s.seed, torch.Generator().manual_seed(s.seed + 1), s.seed + 2


def _common(s: Settings, engine, claimed: float, started: float) -> dict:
    return {"mode": s.mode, "accountant": s.accountant, "noise_multiplier": s.noise_multiplier,
            "effective_noise_multiplier": float(engine.effective_noise_multiplier), "steps": s.steps,
            "sample_rate": float(engine.accounting_sample_rate), "loop": s.loop, "loss_reduction": s.loss_reduction,
            "heads": s.heads, "delta": s.delta, "confidence": s.confidence, "claimed_epsilon": claimed,
            "noise_kind": s.noise, "bands": s.bands, "band_coefficients": list(claimed_band(engine)),
            "settings": asdict(s), "seconds": round(time.perf_counter() - started, 3)}


def _excluded(s: Settings, cx, cv, keep):
    """The examples of the canary slots: a canary where ``keep``, else its neighbour as the
    accountant defines neighbours — add/remove (rdp, pld): a null example (``x = v = 0``: gradient
    exactly 0, as if absent, with the dataset size fixed); replace-one (zcdp): the canary with its
    loss negated (``v → −v``), which moves the release by ``2Δ``, the move replace-one charges. (A
    null example there would only test a ``Δ`` move, and the paper's convention of charging ``Δ``
    would pass unseen.)"""
    if s.accountant == "zcdp":
        return cx, torch.where(keep, cv, -cv)
    return cx * keep, cv * keep


_REACH_TOL = 1e-5  # the canaries' contribution is measured in the model's float32
_BAND_TOL = 1e-12  # ‖c‖₂² of float64 coefficients normalised to 1: b ≤ 64 terms, each rounded by ~1e-16


def _verdict(report: dict, reach: torch.Tensor, check: NoiseCheck) -> dict:
    """Adds the canaries' reach and the noise check, and the verdict: a violation when the bound
    exceeds the claim, when the released noise is less (or more correlated) than claimed, when a
    canary's contribution exceeds the bound its noise is scaled to, or when the claimed band is not
    one the banded proof covers (whitening by it would hide what it costs)."""
    report["canary_reach"] = float(reach.max())
    report["canary_reach_min"] = float(reach.min())
    report["noise"] = check.result()
    report["violation_reasons"] = [reason for reason, bad in (
        ("bound above the claim", report["epsilon_lower_bound"] > report["claimed_epsilon"]),
        ("noise below the claim: " + ", ".join(report["noise"]["under_noised"]), bool(report["noise"]["under_noised"])),
        ("correlated noise: " + ", ".join(report["noise"]["correlated"]), bool(report["noise"]["correlated"])),
        ("noise not Gaussian", report["noise"]["not_gaussian"]),
        ("parameters moved by other than the released gradient", bool(report["noise"]["misapplied"])),
        ("a canary's contribution exceeds its bound", report["canary_reach"] > 1 + _REACH_TOL),
        # the proof's columns have norm ≤ ‖c‖₂ = 1 (bpclip_fast.banded); more moves y by more than Δ
        ("the claimed band's norm exceeds 1", sum(v * v for v in report["band_coefficients"]) > 1 + _BAND_TOL),
        # the proof needs each example's steps at least b apart: the loader separates them by `bands`
        ("the claimed band is longer than the loader's separation", len(report["band_coefficients"]) > report["bands"]))
        if bad]
    report["violation"] = bool(report["violation_reasons"])
    return report


def _bound(result) -> dict:
    """The statistics' result with its ε named for what it is."""
    out = result.to_dict()
    out["epsilon_lower_bound"] = out.pop("epsilon")
    return out


# ---------------------------------------------------------------------------------------------- audits
def _start(what: str, settings: Settings, overrides: dict, size_name: str, size, minimum: int):
    """``(settings, start time, seeds)`` of an audit, its arguments checked."""
    s = replace(settings, **overrides)
    s.check(what)
    if int(size) != size or size < minimum:
        raise ValueError(f"{what}: {size_name} must be an integer ≥ {minimum}, got {size!r}")
    return s, time.perf_counter(), _seeds(s)


@_isolated
def one_run(settings: Settings | None = None, *, canaries: int = 1000, guess_counts=None, return_scores=False,
            **overrides) -> dict:
    """Steinke–Nasr–Jagielski one-run audit (module docstring); returns the report (see :func:`line`),
    with every canary's score and inclusion when ``return_scores``."""
    s, started, (np_seed, gen, noise_seed) = _start("one_run", settings or ONE_RUN_DEFAULTS, overrides,
                                                    "canaries", canaries, 2)
    included = np.random.default_rng(np_seed).random(canaries) < 0.5
    dtype = torch.float32
    pairs = _pairs(s, canaries, "one_run")
    cx, cv = zip(*(_canary(s, pair, dtype) for pair in pairs))
    cx, cv = torch.stack(cx), torch.stack(cv)
    _check_banded(s, "one_run", canaries + s.fillers)
    keep = torch.as_tensor(included)[:, None, None]
    x, v = _excluded(s, cx, cv, keep)
    if s.fillers:
        fx, fv = _fillers(s, s.fillers, gen, dtype)
        x, v = torch.cat([x, fx]), torch.cat([v, fv])
    engine, model, optimizer, loader = _private(s, x, v, noise_seed)
    batch = s.batch_size or len(x)
    scorer, reach, check = _scorer(s, engine, model, cx, cv, batch, float(engine.accounting_sample_rate))
    _train(s, engine, model, optimizer, loader, scorer, check)
    claimed = float(engine.get_epsilon(s.delta))
    result = stats.one_run_audit(scorer.scores.numpy(), included, delta=s.delta, confidence=s.confidence,
                                 guess_counts=guess_counts)
    report = _verdict({"audit": "one-run", "canaries": canaries, **_common(s, engine, claimed, started),
                       **_bound(result)}, reach, check)
    if return_scores:
        report.update(scores=scorer.scores.tolist(), included=included.tolist())
        if scorer.group is not None:
            report.update(groups=scorer.group.tolist())
    return report


@_isolated
def many_run(settings: Settings | None = None, *, runs: int = 4000, split: float = 0.25, return_scores=False,
             **overrides) -> dict:
    """Many-run audit: ``runs`` independent runs, half with the canary and half without (module
    docstring); returns the report (see :func:`line`), with the scores when ``return_scores``.
    ``split``: the fraction of each side's runs that chooses the threshold (the rest bound ε); a
    quarter gave the best bounds on simulated Gaussian scores (a threshold needs fewer runs to
    place than the Clopper–Pearson bounds need to be tight)."""
    s, started, (np_seed, gen, noise_seed) = _start("many_run", settings or MANY_RUN_DEFAULTS, overrides,
                                                    "runs", runs, 4)
    dtype = torch.float32
    _check_banded(s, "many_run", 1 + s.fillers)
    pair = (0, 0)
    cx, cv = _canary(s, pair, dtype)
    scores = {True: [], False: []}
    order = np.random.default_rng(np_seed).permutation(np.arange(runs) % 2 == 0)
    scorer = engine = None
    for r, with_canary in enumerate(order):
        fx, fv = _fillers(s, s.fillers, gen, dtype, avoid=pair)
        cx_r, cv_r = _excluded(s, cx[None], cv[None], torch.tensor(bool(with_canary)))
        x, v = torch.cat([cx_r, fx]), torch.cat([cv_r, fv])
        seed = None if noise_seed is None else noise_seed + r
        engine, model, optimizer, loader = _private(s, x, v, seed, probe=r == 0)
        batch = s.batch_size or len(x)
        if scorer is None:  # the canary's contribution does not depend on the weights (linear loss)
            scorer, reach, check = _scorer(s, engine, model, cx[None], cv[None], batch,
                                           float(engine.accounting_sample_rate))
        _train(s, engine, model, optimizer, loader, scorer, check)
        scores[bool(with_canary)].append(float(scorer.scores[0]))
    claimed = float(engine.get_epsilon(s.delta))
    rng = np.random.default_rng(None if s.seed is None else s.seed + 3)
    result = stats.many_run_audit(np.array(scores[True]), np.array(scores[False]), delta=s.delta,
                                  confidence=s.confidence, split=split, rng=rng)
    report = _verdict({"audit": "many-run", "runs": runs, "fillers": s.fillers,
                       **_common(s, engine, claimed, started), **_bound(result)}, reach, check)
    if return_scores:
        report.update(scores_in=scores[True], scores_out=scores[False])
    return report


def line(report: dict) -> str:
    """The report in one line: the bound with its confidence beside the claimed ε, the power, the
    released noise against the claimed, and the verdict."""
    verdict = ("VIOLATION (" + "; ".join(report["violation_reasons"]) + ")" if report["violation"]
               else "consistent with the claim")
    size = (f"{report['canaries']} canaries" if report["audit"] == "one-run" else f"{report['runs']} runs")
    lo, hi = report["noise"]["std_interval"]
    band = f", banded b={report['bands']}" if report.get("bands", 1) != 1 else ""
    return (f"{report['audit']} audit ({report['mode']}, {report['accountant']}{band}, σ={report['noise_multiplier']:g}, "
            f"{report['steps']} step{'s' if report['steps'] != 1 else ''}, q={report['sample_rate']:.3g}): "
            f"ε ≥ {report['epsilon_lower_bound']:.3f} at {report['confidence']:.0%} confidence (δ={report['delta']:g}) "
            f"vs claimed ε = {report['claimed_epsilon']:.3f} (power: {size} certify at most ε = {report['power']:.3f}); "
            f"noise std {report['noise']['std_ratio']:.3f} of claimed ({lo:.3f}-{hi:.3f}); canary reach "
            f"{report['canary_reach']:.4f}; {verdict}.")
