"""The sensitivity audit: each example's exact contribution to the release, and the noise drawn, against the bounds.

``sensitivity(model, (x, y), engine=engine)`` measures, through the model's own clipped layers and
kernels, how far each example of a batch moves each clipped layer's released gradient, and compares
it with the bound the noise is scaled to (DESIGN.md §5): backprop, each layer's ``Δ_l =
layer.sensitivity``; per_layer, each layer's ``C_l = layer.max_grad_norm`` and the whole ``C =
layer.noise_bound = (Σ_l C_l²)^½``; flat, one ``C = layer.noise_bound`` for the concatenation of all
layers. It then measures the noise the layers actually draw against ``σ·Δ_l``. Three checks of the
contributions, one of the noise:

* **removal** (float64): ``R(S) − R(S∖{i})`` for every ``i``, the precise test of batch-independence;
* **alone** (the model's own dtype): each example's release as a batch of one;
* **adversarial** (``adversarial_steps > 0``): a search for inputs that push one example's
  contribution up;
* **noise**: per layer, the std of the noise the training path draws, with a confidence interval.

Why removal
-----------
The accountant assumes add/remove neighbours: the release of a step is ``R(S) + N(0, σ²Δ²)`` and
the sensitivity is ``sup ‖R(S) − R(S∖{i})‖`` over batches ``S`` and members ``i``. The audit
computes exactly that difference, ``R(S) − R(S∖{i})`` for every ``i`` (B + 1 backward passes, each
the release of its batch: the sum of the clipped layers' parameter gradients, noise off), and the
contribution ``R(S ∪ {z}) − R(S)`` of each adversarial input ``z``. Nothing is assumed about how the
layers compute: an example that moved another example's clipped gradient (a batch-dependent clip,
batch statistics, a loss that is not a sum of per-example terms) shows up in the difference as it
would in the released gradient. Where this batch keeps the bound anyway, the mixing still shows as a
gap between the removal and the example's release alone (both in float64, beyond twice the removal's
tolerance): the report then notes that examples mix.

Training mode
-------------
The copies run in training mode, the mode the released gradients are computed in: a module that
mixes the batch only when ``self.training`` (a hand-written batch norm) is invisible in eval mode.
Every pass starts from the same state of the torch generators (CPU and the model's CUDA device;
the caller's states are restored afterwards), which is a coupling of the B + 1 passes only if the
training forward draws nothing from them:

* a training forward that leaves the generators' state unchanged runs as is (``training ==
  "train"``);
* one that draws (dropout) cannot be coupled by a common seed: removing example ``i`` shifts the
  random numbers of every later example (and of every later layer), so ``R(S) − R(S∖{i})`` would
  mix other examples' mask changes into ``i``'s contribution. Dropout (torch's ``_DropoutNd``
  modules, which act on each entry alone and mix nothing) is turned off and the rest of the model
  stays in training mode (``"train, dropout off"``);
* randomness that remains (a functional ``F.dropout``, noise injection) makes the audit fall back to
  eval mode (``"eval"``), with a note: mixing that happens only in training mode is then not tested.

Then the full batch is released twice: the two must agree within the removal's tolerance (rounding
only: a GPU's atomics may reorder sums); a larger drift (state the generators do not hold, a
counter in a module) also falls back to eval mode, with a note.

Units
-----
Under ``loss_reduction="sum"`` the release is ``Σ_i c_i + N(0, σ²Δ²)``: the difference is in the
units of Δ. Under ``"mean"`` the engine's layers compute ``(1/B̄)(Σ_i c_i + N(0, σ²Δ²))`` (the
proof in :mod:`bpclip_fast.engine`): the copy's layers get the engine's own step state,
``boundary.LayerStep(enforce=False, mean_loss_batch=B̄)`` with no key armed, so ``begin_backward``
draws no noise but clips at ``C/d`` with the backward's own ``d`` and scales by ``d/B̄``, exactly as
in training; the release is then multiplied by ``B̄`` (in float64), the factor between the noise
std in the release (``σΔ/B̄``) and ``σΔ``. Either way a ratio ``‖contribution‖/Δ`` above 1 means the
noise is too small for that example.

Removal: arithmetic and tolerance
---------------------------------
The removal runs on a deep copy of the model (clipped layers drop their engine step when copied;
the engine's forward pre-hook pickles as a no-op; flat clipping's book-keeping is copied with the
model and checked to belong to the copy), cast to float64 by default. The kernels are the same as
in training, in double. Each coordinate of a release is a sum of at most ``N = (B + 1)·T`` products
(``T``: the most positions one example has at a clipped layer, its output size over its channels);
with unit roundoff ``u`` its error is at most ``γ_N ≈ N·u`` times the sum of the absolute terms,
which the triangle inequalities of the bounds keep within ``(B + 1)·Δ`` (up to the cancellation
inside one example's gradient, and the ``O(depth·u)`` relative error of each example's own
activations). The difference of two releases therefore errs by at most about ``2·N·(B + 1)·u·Δ``;
the audit uses ``tol = max(1e-9, 64·N·(B + 1)·u)`` (a factor 32 of margin for depth and
cancellation): about ``1e-9`` in float64 for the models here, so a ratio ``≤ 1 + tol`` is an honest
pass. The report also gives the rounding actually observed (the release of the batch minus that of
the same batch in reverse order, in bound units). In float32 (``dtype=None`` on a float32 model) the
same formula gives a tolerance near 1: only gross violations are resolved, hence the next check.

Alone, in the model's own dtype
-------------------------------
The kernels have separate float32/bfloat16/float16 paths, which a float64 copy never runs. A second
copy in the model's own dtype releases each example as a batch of one, ``R({i})``: that release
carries only example ``i``'s own rounding, so it can be held to a tolerance of the dtype's order
instead of the removal's ``(B + 1)²·T·u``. Its error: the kernels store the clipped values so that
the bound holds *after* rounding (backprop's clipped inputs and upstream gradients,
``csrc/include/bpclip_fast/clip.h``; the exact modes' factors from rounded-up norm bounds,
:mod:`bpclip_fast.exact`). What follows is a GEMM over the example's ``T`` positions, accumulated in
``u_acc`` (float32 for the half types, as torch's GEMMs and our kernels accumulate them; float64
for float64): each coordinate errs by at most ``γ_T(u_acc)`` times the sum of its absolute terms,
whose norm the bound's own triangle inequalities keep within Δ (backprop: ``‖Σ_t |g̃_t||x̃_t|ᵀ‖ ≤
Σ_t ‖g̃_t‖‖x̃_t‖ ≤ Δ``; the exact modes up to the cancellation between one example's positions);
then at most two roundings to the dtype (the output, the mean-loss scale ``1/B̄``) and ``×B̄`` in
float64. So ``‖R({i})‖/Δ ≤ 1 + T·u_acc/(1 − T·u_acc) + 3u``; the audit uses
``native_tol = max(1e-12, 32·T·u_acc + 4·u)`` (margin 32 on the GEMM term, for the cancellation):
``3e-4`` for float32 at ``T = 196``, so a 10% over-clip of the float32 kernels is plain, where the
removal's float32 tolerance (about 0.8 on a conv net) hides it. The float64 removal stays the
precise test of batch-independence; a row reports both (``ratio``: removal; ``alone``: this check).

Noise
-----
The contributions are compared with the bound the noise is *claimed* to be scaled to; the noise
itself is measured too. The copy in the model's own dtype gets each private layer's σ
(``layer.noise_multiplier``, what training draws with) and is armed as a training step is:
:func:`bpclip_fast.nn.arm_noise` gives each layer's ``LayerStep(enforce=False, mean_loss_batch=B̄)``
a Philox key, so the real forward and backward draw the noise by the training path
(``begin_backward`` → the kernels' Philox noise, scaled as in training). The noisy release of the
audited batch minus its noise-free release, in bound units, is under the claim a vector of i.i.d.
``N(0, s²)`` coordinates with ``s = σ·Δ_l`` (σ the engine's ``gradient_noise_multiplier``, or the
layer's own without an engine; ``Δ_l = layer.sensitivity``, the noise bound ``C`` in the exact
modes). With ``n`` coordinates (``P_l`` per draw, ``draws`` noisy releases with fresh keys, enough
for 2048 coordinates per layer, at most 64), ``n·ŝ²/s² ~ χ²_n`` for the true std ``s``: the ratio
``ŝ/(σΔ_l)`` comes with the interval ``[ŝ/(σΔ_l)·√(n/χ²_{n,1−a/2}), ŝ/(σΔ_l)·√(n/χ²_{n,a/2})]`` for
the true ratio, ``a = 1e-6`` over the number of intervals (Bonferroni: each layer, and each of its
weight and bias alone, so a parameter left without noise is seen). A layer whose interval lies
below 1 is under-noised (status ``"under"``, the report fails); above 1, over-noised (``"over"``,
a note: a utility loss, not a privacy one). A layer whose claimed σ is 0 (a DistributedDataParallel
rank other than 0, whose layers leave the draw to rank 0; a converted model never armed) is
reported as ``"σ = 0"``. The rounding of the two releases in the model's dtype adds
``O(u·‖R‖)`` per coordinate, negligible against ``σΔ`` unless σ is tiny; it can only inflate ``ŝ``.
The copy's noise key is an explicit seed (``noise_seed``): that noise is never released.

The report is not private
-------------------------
The report holds data-dependent values: each unit's largest contribution norm and the batch
indices attaining it, the adversarial inputs' ratios, the observed rounding, the measured noise std
(the noisy minus noise-free release of the audited batch), and with ``keep_contributions`` every
example's contribution vector. None of it is covered by the privacy guarantee of the training run:
do not publish a report made on private data.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .. import nn as bnn
from .adversarial import _adversarial
from .drawn_noise import _noise
from .noise_free import NoiseFree, _Generators, _delta, _norms, _on, _units, layer_params
from .sensitivity_args import _check_batch, _check_layers, _reduction, _unwrap
from .sensitivity_report import NoiseRow, SensitivityReport, SensitivityRow

__all__ = ["sensitivity", "SensitivityReport", "SensitivityRow", "NoiseRow"]

# One concern a module: the report's records (sensitivity_report), the argument checks (sensitivity_args),
# the release with noise off (noise_free; also the empirical audit's measure), the noise drawn
# (drawn_noise), the adversarial search (adversarial). Patch a name where it is defined: a patch of its
# import here reaches only the calls made from this module.


# ------------------------------------------------------------------------------ the audit


def sensitivity(model: nn.Module, batch, loss_fn=None, *, engine=None, loss_reduction: str | None = None,
                mean_batch_size: float | None = None, adversarial_steps: int = 0, starts: int = 2,
                scales=(10.0, 100.0), step_size: float = 0.5, dtype=torch.float64,
                keep_contributions: bool = False, noise_draws: int | None = None,
                noise_seed: int = 0) -> SensitivityReport:
    """Audits each example's contribution to the release of ``model`` on ``batch``, and the noise
    its layers draw (module docstring).

    ``model``: made private by :class:`bpclip_fast.PrivacyEngine` (possibly DDP-wrapped), or any
    module whose trainable layers are clipped layers; it and ``engine`` are not changed (the audit
    runs on copies: no gradient, step state, noise draw or accountant charge; the torch generators'
    states are restored). ``engine``: gives the loss reduction, ``B̄`` and the claimed σ; without it
    ``loss_reduction`` (default ``"sum"``) and, for ``"mean"``, ``mean_batch_size``. ``batch``:
    ``(inputs, targets)``. ``loss_fn(outputs, targets)``: the training criterion (default
    cross-entropy with the reduction in use).
    ``adversarial_steps``: gradient-ascent steps on the input of one example from each start: the
    ``starts`` examples of largest ratio and their copies scaled by ``scales``; the direction comes
    from a plain-torch surrogate of the model, every iterate is evaluated through the real layers.
    ``dtype``: of the removal copy (float64 default; ``None`` keeps the model's); the alone check and
    the noise run in the model's own dtype. ``keep_contributions``: also return every removal
    contribution vector, ``report.contributions[unit name]`` (``[B, P]``). ``noise_draws``: noisy
    releases of the batch (default: enough for 2048 coordinates per layer, at most 64; 0: no noise
    measurement). ``noise_seed``: the copy's Philox seed.

    The report holds data-dependent values and is not covered by the privacy guarantee: do not
    publish it for private data.
    """
    start = time.perf_counter()
    inner = _unwrap(model)
    _, mode = _check_layers(inner, engine)
    reduction, mean_batch = _reduction(engine, loss_reduction, mean_batch_size)
    x, y = _check_batch(batch)
    if loss_fn is None:
        loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    elif not callable(loss_fn):
        raise TypeError(f"sensitivity: loss_fn must be callable, got {type(loss_fn).__name__}")
    if int(adversarial_steps) < 0:
        raise ValueError(f"sensitivity: adversarial_steps must be >= 0, got {adversarial_steps}")
    if noise_draws is not None and int(noise_draws) < 0:
        raise ValueError(f"sensitivity: noise_draws must be >= 0 or None, got {noise_draws}")
    audit = NoiseFree(inner, mode, reduction, mean_batch, loss_fn, dtype, training=True)
    with _Generators(audit.layers[0]._bp_param_device()).fork():  # the caller's generator states come back
        return _audit(inner, engine, audit, mode, reduction, mean_batch, loss_fn, x, y, start,
                      adversarial_steps=int(adversarial_steps), starts=int(starts), scales=tuple(scales),
                      step_size=float(step_size), keep_contributions=keep_contributions, noise_draws=noise_draws,
                      noise_seed=int(noise_seed))


def _audit(inner, engine, audit, mode, reduction, mean_batch, loss_fn, x0, y0, start, *, adversarial_steps, starts,
           scales, step_size, keep_contributions, noise_draws, noise_seed):
    x, y = _on(audit, x0, y0)
    audit.shapes = {}

    def shape(module, args):  # each layer's input shape: the Δ of a layer whose Δ was never fixed
        audit.shapes.setdefault(id(module), tuple(args[0].shape))

    hooks = [m.register_forward_pre_hook(shape) for m in audit.layers]
    training, note = audit.settle(x, y)
    full = audit.release(x, y)
    for h in hooks:
        h.remove()
    units = _units(audit, mode)
    b = x.shape[0]
    u_round = torch.finfo(audit.dtype).eps / 2
    tol = max(1e-9, 64 * (b + 1) * audit.positions * (b + 1) * u_round)
    # The same batch again must give the same release up to rounding (atomics on a GPU reorder sums);
    # more is randomness or state the generators do not hold: removal in training mode would be noise.
    drift = max(n / u[2] for n, u in zip(_norms(units, full, audit.release(x, y)), units))
    if drift > tol and audit.model.training:
        audit.model.eval()
        training, note = "eval", (f"the copies ran in eval mode: in training mode the release of the batch moved by "
                                  f"{drift:.3g} of the bound between two passes; mixing that happens only in training "
                                  "mode is not tested")
        full = audit.release(x, y)
    # ---- removal (float64): R(S) − R(S∖{i})
    rev = audit.release(x.flip(0), y.flip(0))
    rounding = max((n / u[2] for n, u in zip(_norms(units, full, rev), units)), default=0.0)
    norms, kept = _removal(audit, units, full, x, y, keep_contributions)
    # ---- alone, in the model's own dtype (the same copy when the removal already runs in it)
    native = audit
    if audit.dtype != _model_dtype(inner):
        native = NoiseFree(inner, mode, reduction, mean_batch, loss_fn, None, training=True)
        native.follow(audit)
    xn, yn = _on(native, x0, y0)
    alone = _alone(native, units, xn, yn)
    native_u = torch.finfo(native.dtype).eps / 2
    acc_u = torch.finfo(torch.float64 if native.dtype == torch.float64 else torch.float32).eps / 2
    native_tol = max(1e-12, 32 * native.positions * acc_u + 4 * native_u)
    rows = []
    for u, (name, ks, bound, symbol, checked) in enumerate(units):
        frozen = all(full[k] is None for k in ks)
        ratios, alone_ratios = norms[u] / bound, alone[u] / bound
        top, top_alone = float(ratios.max()), float(alone_ratios.max())
        failed = [check for check, bad in (("removal", top > 1 + tol), ("alone", top_alone > 1 + native_tol)) if bad]
        rows.append(SensitivityRow(
            name=name, bound=float(bound), symbol=symbol, largest=float(norms[u].max()), ratio=top,
            examples=[int(i) for i in torch.nonzero(ratios >= top - tol).reshape(-1)] if not frozen else [],
            saturated=int(((ratios - 1).abs() <= tol).sum()),
            status="frozen" if frozen else ("exceeded" if failed else "ok") if checked else "info",
            alone=None if frozen else top_alone,
            alone_examples=[] if frozen else [int(i) for i in torch.nonzero(alone_ratios >= top_alone - native_tol)
                                                                  .reshape(-1)],
            failed=failed if checked and not frozen else []))
    notes = [note] if note else []
    # A contribution that is a function of its example alone is the same removed from the batch as
    # released alone; a gap is mixing (DESIGN.md §5), a note even where this batch keeps the bound.
    # Compared in the removal's dtype: the model's own rounds its norm bounds up (a smaller factor).
    alone_removal = alone if native is audit else _alone(audit, units, x, y)
    gap = [float(((norms[u] - alone_removal[u]).abs() / unit[2]).max()) for u, unit in enumerate(units)]
    mixed = [u for u in range(len(units)) if rows[u].status != "frozen" and gap[u] > 2 * tol]
    if mixed:
        notes.append(f"examples mix: at {', '.join(units[u][0] for u in mixed)} an example's removal from the batch "
                     f"and its release alone differ by up to {max(gap[u] for u in mixed):.3g} of the bound (its "
                     "contribution depends on the other examples)")
    if mode == "flat" and audit.layers[0]._bp_flat.max_grad_norm != units[0][2]:
        notes.append(f"flat clipping clips at {audit.layers[0]._bp_flat.max_grad_norm:g}, the noise is scaled to "
                     f"{units[0][2]:g}")
    # ---- the noise the layers draw
    deltas = [_delta(layer, audit) for layer in audit.layers]
    noise, draws, structure = _noise(native, inner, engine, deltas, xn, yn, noise_draws, noise_seed, notes)
    adversarial = {}
    if adversarial_steps:
        adversarial = _adversarial(audit, units, rows, norms, full, x, y, adversarial_steps, starts, scales,
                                   step_size, tol)
    return SensitivityReport(
        mode=mode, examples=b, loss_reduction=reduction, mean_batch_size=mean_batch, dtype=str(audit.dtype),
        tol=tol, rounding=rounding, native_dtype=str(native.dtype), native_tol=native_tol, training=training,
        rows=rows, noise=noise, noise_draws=draws, noise_structure=structure, adversarial=adversarial, notes=notes,
        seconds=time.perf_counter() - start,
        contributions={k: torch.stack(v) for k, v in kept.items()} if kept is not None else None)


def _removal(audit, units, full, x, y, keep_contributions):
    """``([unit, example] norms of R(S) − R(S∖{i}), {unit: [contribution vectors]} or None)``."""
    b = x.shape[0]
    norms = torch.zeros(len(units), b, dtype=torch.float64)
    kept = {name: [] for name, *_ in units} if keep_contributions else None
    keep = torch.ones(b, dtype=torch.bool, device=x.device)
    for i in range(b):
        keep[i] = False
        other = audit.release(x[keep], y[keep]) if b > 1 else [None if f is None else torch.zeros_like(f) for f in full]
        keep[i] = True
        norms[:, i] = torch.tensor(_norms(units, full, other), dtype=torch.float64)
        if kept is not None:
            for name, ks, *_ in units:
                parts = [full[k] - other[k] for k in ks if full[k] is not None]
                kept[name].append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64))
    return norms, kept


def _alone(copy_, units, x, y):
    """``[unit, example]``: the norm of each example's release as a batch of one."""
    out = torch.zeros(len(units), x.shape[0], dtype=torch.float64)
    for i in range(x.shape[0]):
        out[:, i] = torch.tensor(_norms(units, copy_.release(x[i:i + 1], y[i:i + 1])), dtype=torch.float64)
    return out


def _model_dtype(inner):
    return layer_params(bnn.clipped_layers(inner)[0][1])[0][1].dtype
