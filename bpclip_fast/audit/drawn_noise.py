"""The noise drawn: the std of the noise the training path actually draws on a copy of the model, per clipped
layer (and each weight and bias alone), against the claimed ``σ·Δ_l``, with its χ² interval, and the draws'
structure tests (:class:`bpclip_fast.audit.noise.NoiseCheck`).

Apart from the contributions because it measures the other half of the release — the noise, not the sensitivity —
with its own statistics. Its derivation: the "Noise" section of :mod:`.contribution`'s docstring, which "module
docstring" below refers to.
"""

from __future__ import annotations

import torch

from .. import nn as bnn
from .noise import NoiseCheck, SumOfSquares
from .noise_free import layer_params
from .sensitivity_report import NoiseRow

NOISE_ALPHA = 1e-6          # the noise check's significance, over all its intervals (Bonferroni)
NOISE_COORDINATES = 2048    # coordinates wanted per layer (the smallest decides the draws)
NOISE_MAX_DRAWS = 64


def _claimed_sigmas(inner, engine):
    """``(σ each private layer draws with, σ claimed for it)``: the engine's gradient noise multiplier
    on rank 0 (other DDP ranks leave the draw to rank 0); without an engine, the layer's own."""
    drawn = [float(layer._bp_noise_multiplier) for _, layer in bnn.clipped_layers(inner)]
    if engine is None:
        return drawn, drawn
    claim = float(engine.gradient_noise_multiplier) if engine.rank == 0 else 0.0
    return drawn, [claim] * len(drawn)


def _noise(native, inner, engine, deltas, x, y, draws, seed, notes):
    """``([NoiseRow], draws, structure)``: the noisy minus the noise-free release of ``(x, y)`` per
    layer, drawn by the training path on the copy ``native`` (module docstring: noise); ``structure``
    the shape and correlation tests of :class:`bpclip_fast.audit.noise.NoiseCheck` on the same draws
    (a key used twice — a bias at its weight's offset, two layers sharing a draw — or non-Gaussian
    noise of the claimed std), None when nothing was measured."""
    drawn, claimed = _claimed_sigmas(inner, engine)
    sizes = [[(part, p.numel()) for part, p in layer_params(layer) if p is not None and p.requires_grad]
             for layer in native.layers]
    measured = [k for k, layer in enumerate(native.layers) if sizes[k] and claimed[k] > 0]
    if engine is not None and getattr(engine, "bands", 1) != 1:
        # The copy is armed with the independent draw; training adds the correlated rows (bpclip_fast.banded),
        # which one batch cannot show: measuring the draw would vouch for a mechanism training does not use.
        notes.append(f"the noise was not measured: noise='banded' (bands={engine.bands}) adds correlated rows across "
                     "steps, not the independent draw this audit measures (tests/test_banded_noise.py checks the rows)")
        draws = 0
    if draws is None:
        smallest = min((sum(n for _, n in sizes[k]) for k in measured), default=NOISE_COORDINATES)
        draws = min(NOISE_MAX_DRAWS, -(-NOISE_COORDINATES // smallest))
    if not draws:
        measured = []
    sq = [{part: SumOfSquares() for part, _ in s} for s in sizes]
    names = [f"{native.names[k]}.{part}" for k in measured for part, _ in sizes[k]]
    lengths = [n for k in measured for _, n in sizes[k]]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    check = None
    if measured:
        base = native.release(x, y)
        scale = torch.cat([torch.full((sum(n for _, n in sizes[k]),), claimed[k] * deltas[k], dtype=torch.float64)
                           for k in measured])
        flat_base = torch.cat([base[k].double() for k in measured])
        check = NoiseCheck(lambda *_: flat_base, scale, [(n, slice(a, a + m)) for n, a, m in zip(names, starts, lengths)])
        stream = bnn.NoiseStream(seed)  # explicit seed: this noise is never released
        try:
            for layer, sigma in zip(native.layers, drawn):
                layer._bp_noise_multiplier = sigma
            for _ in range(draws):
                bnn.arm_noise(native.model, stream)  # a fresh key per draw, the engine's layer offsets
                noisy = native.release(x, y)
                check.add(torch.cat([noisy[k].double() for k in measured]), None, None)
                for k in measured:
                    s = claimed[k] * deltas[k]
                    for (part, _), d in zip(sizes[k], (noisy[k] - base[k]).split([n for _, n in sizes[k]])):
                        sq[k][part].add(d.double() / s)
        except RuntimeError as exc:  # e.g. a shape-dependent Δ never fixed: training refuses to draw too
            notes.append(f"the noise was not measured: {exc}")
            measured, draws, check = [], 0, None
        finally:
            for layer in native.layers:  # back to noise-free releases
                layer._bp_step.arm(None)
                layer._bp_noise_multiplier = 0.0
    tests = sum(1 + len(sizes[k]) for k in measured)
    a = NOISE_ALPHA / max(tests, 1)

    rows = []
    for k, layer in enumerate(native.layers):
        row = NoiseRow(name=native.names[k], sigma=drawn[k], claimed_sigma=claimed[k], bound=deltas[k], std=None,
                       ratio=None, low=None, high=None, coordinates=0, parts={},
                       status="frozen" if not sizes[k] else "σ = 0" if claimed[k] == 0 else "not measured")
        if k in measured:
            s = claimed[k] * deltas[k]
            whole = SumOfSquares(sum(q.sum_sq for q in sq[k].values()), sum(q.n for q in sq[k].values()))
            row.parts = {part: list(sq[k][part].interval(a)) for part, _ in sizes[k]}
            row.ratio, row.low, row.high = whole.interval(a)
            row.std, row.coordinates = row.ratio * s, whole.n
            under = row.high < 1 or any(hi < 1 for _, _, hi in row.parts.values())
            row.status = "under" if under else "over" if row.low > 1 else "ok"
        rows.append(row)
    over = [r.name for r in rows if r.status == "over"]
    if over:
        notes.append(f"more noise than claimed at {', '.join(over)} (a utility loss, not a privacy one)")
    if any(r.status == "σ = 0" and r.sigma > 0 for r in rows):
        notes.append("layers whose engine leaves the draw to rank 0 draw noise too: more noise than claimed")
    structure = None
    if check is not None:
        result = check.result()
        structure = {k: result[k] for k in ("correlated", "not_gaussian", "shape_p_value", "correlations")}
    return rows, draws if measured else 0, structure
