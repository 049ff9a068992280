"""The engine's side of correlated noise (``make_private(noise="banded", bands=b)``; the
mechanism and its proof: :mod:`bpclip_fast.banded`): the arguments it takes, each layer's rows, the
commit of a charged row, the fallback draw, and the restart of a resumed run."""

from __future__ import annotations

import functools

import torch

from .. import banded

NOISES = ("independent", "banded")


def check(r, accountant_name: str, distributed: bool) -> int:
    """The bands ``make_private`` will use (1: independent noise), or a clear error."""
    if r.noise not in NOISES:
        raise ValueError(f"{r.what}: noise must be one of {NOISES}, got {r.noise!r}")
    bands = banded.check_bands(r.bands)
    if r.noise == "independent":
        if bands != 1:
            raise ValueError(f"{r.what}: bands={bands} needs noise='banded' (independent noise has one band)")
        return 1
    why = None
    if not r.poisson_sampling:
        why = ("its accounting needs cyclic Poisson sampling (poisson_sampling=True): shuffled batches are not "
               "b-min-separated")
    elif accountant_name not in ("rdp", "pld"):
        why = f"its accounting is the Poisson reduction of the 'rdp' and 'pld' accountants, not {accountant_name!r}"
    elif r.adaptive is not None:
        why = ("adaptive thresholds change the noise scale from step to step, and the recursion of past noise rows "
               "assumes one scale; use fixed thresholds")
    elif distributed:
        why = "DDP is not supported yet (every rank would have to hold the same noise rows); train in one process"
    if why is not None:
        raise ValueError(f"{r.what}: noise='banded' is not available here: {why}")
    for p in (p for group in r.optimizer.param_groups for p in group["params"]):
        if p.requires_grad and p.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{r.what}: noise='banded' needs float32 or float64 parameters (found {p.dtype}): the "
                             "noise row is added to the released gradient in the parameter's dtype, and a half-"
                             "precision gradient would be rounded before its noise; keep the parameters in float32 "
                             "(autocast computes in half precision without them)")
    return bands


def momentum_of(optimizer) -> float:
    """The workload's momentum: torch's SGD's ``momentum`` (without Nesterov and dampening, where the
    update is the momentum recursion BSR's closed form assumes); 0 (prefix sums) otherwise."""
    if type(optimizer) is torch.optim.SGD:
        groups = optimizer.param_groups
        betas = {float(g.get("momentum", 0.0)) for g in groups}
        if len(betas) == 1 and all(not g.get("nesterov") and not g.get("dampening") for g in groups):
            return betas.pop()
    return 0.0


def prepare(engine, bands: int, optimizer) -> None:
    """Each layer's rows (``None`` everywhere for independent noise)."""
    engine.bands = bands
    engine._band = None
    if bands == 1:
        return
    engine.band_coefficients = banded.bsr_coefficients(bands, momentum_of(optimizer))
    engine._band = banded.BandedNoise(engine.band_coefficients)
    for index, st in enumerate(engine._steps_of):
        st.band = engine._band.layer(functools.partial(_key_of_row, engine, index))
        st.band_row = functools.partial(_row, engine)


def _key_of_row(engine, index, row):
    return engine._stream.seed, engine._stream.offset_at(row, index)


def _row(engine) -> int:
    """The row of the step in progress: the index of its batch."""
    t = engine._counter.last_t
    if t is None:
        raise RuntimeError("banded noise: no batch was drawn from the private data loader for this step")
    return t


def std(engine, st) -> float:
    """The std of the layer's draws in the released gradient's units (what the independent draw
    has: ``σΔ``, divided by the expected batch under ``loss_reduction="mean"``)."""
    s = engine.gradient_noise_multiplier * st.layer.sensitivity
    return s / st.mean_loss_batch if st.mean_loss_batch is not None else s


def commit(engine, row: int) -> None:
    """The step charged for batch ``row`` ended (released or refused): every layer's rows through it
    become history, rows never made (no backward reached the layer, a skipped batch) made now."""
    if engine._band is None:
        return
    for st in engine._steps_of:
        like, numel = st.band_layout()
        st.band.commit_through(row, std(engine, st), like, numel)


def fallback(engine, st) -> bool:
    """Adds row ``t`` to a layer whose gradient does not hold it (``verify.fallback_noise``). Returns
    False when the row was made already (its gradient was cleared after the backward): it cannot be
    made again, and the caller refuses the step."""
    row = _row(engine)
    if st.band.made(row):
        return False
    grads = []
    for p in st.params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad if p.requires_grad else None)
    st.make_band(row, std(engine, st), grads)
    st.noised = True
    return True


def restart(engine) -> None:
    """A resumed run starts a new block of the strategy (sound: :mod:`bpclip_fast.banded`)."""
    if engine._band is not None:
        for st in engine._steps_of:
            st.band.restart()
