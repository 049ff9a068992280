"""The clipping thresholds of the mode, fixed or adaptive (:mod:`bpclip_fast.adaptive` has the
noise split and its proof and the update rule; here they meet the engine's layers): the slots of
each mode, the noisy counts released with each step, and the new values given to the layers."""

from __future__ import annotations

import torch

from .. import adaptive as _adaptive
from . import distributed


def slots(engine):
    """``[(name, layers, attribute)]``: every clipping threshold of the mode and the layers it sets."""
    return engine._mode.threshold_slots(engine._layers)


def prepare(engine, adaptive, sigma, plan) -> None:
    """Fixed thresholds, or the adaptive ones with the noise split of :mod:`bpclip_fast.adaptive`:
    the layers get ``σ_Δ`` (raised from ``σ`` to pay for the ``k`` counts), the accountant ``σ``."""
    engine._thresholds = None
    engine._gradient_sigma = sigma
    if adaptive is None:
        return
    slots_ = slots(engine)
    k, n_layers = len(slots_), len(engine._layers)
    per_layer = engine._mode.sigma_factor(n_layers)  # backprop: σ = σ_eff·√L
    sigma_grad_eff, sigma_b = _adaptive.noise_split(sigma / per_layer, k, adaptive.count_noise)
    engine._gradient_sigma = sigma_grad_eff * per_layer
    initial = [float(getattr(layers[0], "_bp_" + attr)) for _, layers, attr in slots_]
    engine._thresholds = _adaptive.Thresholds(adaptive, [name for name, _, _ in slots_], initial,
                                              plan.batch_size * engine.world_size, sigma_b)


def centered_counts(engine) -> torch.Tensor:
    """``Σ_{i in batch} (1[n_{k,i} ≤ C_k] − ½)`` per threshold, over every process (float64, CPU):
    a layer's ``rows`` examples were counted, the rest of the batch did not reach it (norm 0)."""
    half = engine._counter.last_rows / 2.0
    slots_ = engine._mode.count_slots(engine._steps_of)
    live = [st.counts[j].reshape(()) for st, j in slots_ if st is not None]
    counts = iter(torch.stack(live).to("cpu", torch.float64).tolist() if live else [])  # one device sync
    centered = torch.tensor([next(counts) - st.rows + half if st is not None else half for st, _ in slots_],
                            dtype=torch.float64)
    if engine.distributed:
        centered = distributed.summed(centered)
    return centered


def proposed(engine):
    """The thresholds after this step (``None`` when fixed): released with the gradient, one draw
    per step at its counters, computed before the release so that nothing after it can fail half-way."""
    if engine._thresholds is None:
        return None
    noisy_counts = engine._thresholds.noisy(centered_counts(engine), engine._stream.seed,
                                            engine._stream.count_offset())
    return engine._thresholds.proposed(noisy_counts)


def adopt(engine, values) -> None:
    """Makes ``values`` (from :func:`proposed`) the thresholds of the next step."""
    if values is None:
        return
    engine._thresholds.values = values
    apply(engine, values)


def apply(engine, values) -> None:
    """Gives the layers the thresholds ``values`` (under per_layer every layer's noise bound is
    ``(Σ_l C_l²)^½`` of them)."""
    engine._mode.set_thresholds(engine._layers, values, engine._flat_group)
