"""The engine's side of correlated noise (``make_private(noise="banded", bands=b)``; the
mechanism and its proof: :mod:`bpclip_fast.banded`): the arguments it takes, each layer's rows, the
commit of a charged row, the fallback draw, and a resumed run's rows (restarted, or continued from
:func:`noise_state_dict`)."""

from __future__ import annotations

import functools

import torch

from .. import _ops, banded
from ._common import half_precision_dtype

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
    dtype = half_precision_dtype(r.optimizer)
    if dtype is not None:
        raise ValueError(f"{r.what}: noise='banded' needs float32 or float64 parameters (found {dtype}): the "
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
        st.band_std = std(engine, st)


def check_row_std(engine, bands: int, optimizer) -> None:
    """Every layer's rows are drawn at ``std(engine, st)/c₀`` (:mod:`bpclip_fast.banded`): outside the
    kernels' range that std failed the first step's op (review 40 F8); it depends on σ, Δ, B̄ and the
    band's coefficients alone, so ``make_private`` refuses it, before anything is drawn."""
    if bands == 1:
        return
    c0 = float(banded.bsr_coefficients(bands, momentum_of(optimizer))[0])
    bad = []
    for st in engine._steps_of:
        try:
            row_std = std(engine, st) / c0
        except RuntimeError:  # a shape-dependent Δ never fixed: its noise is refused at the forward
            continue
        if not _ops.noise_std_ok(row_std):
            bad.append(f"{st.name}: rows' std {row_std:.3g}")
    if bad:
        raise ValueError("make_private: noise='banded' would draw rows outside the kernels' range "
                         f"({_ops.NOISE_STD_RULE}): " + "; ".join(bad) + "; use a clipping norm and noise_multiplier "
                         "whose product is not so small (or so large), or scale the data or the loss")


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
    has: ``σΔ``, divided by the expected batch under ``loss_reduction="mean"``), fixed at
    make_private as ``LayerStep.band_std``: every row of the layer has it, made in a backward (which
    checks its own std is this one) or here."""
    s = engine.gradient_noise_multiplier * st.layer.sensitivity
    return s / st.mean_loss_batch if st.mean_loss_batch is not None else s


def commit(engine, row: int) -> None:
    """The step charged for batch ``row`` ended (released or refused): every layer's rows through it
    become history, rows never made (no backward reached the layer, a skipped batch) made now."""
    if engine._band is None:
        return
    for st in engine._steps_of:
        like, numel = st.band_layout()
        if st.band.fits(like, numel):  # else converted: refused until it fits again, then caught up from here
            st.band.commit_through(row, st.band_std, like, numel)


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
    st.make_band(row, st.band_std, grads)
    st.noised = True
    return True


def restart(engine) -> None:
    """A resumed run starts a new block of the strategy (sound: :mod:`bpclip_fast.banded`), unless
    :func:`load_noise_state_dict` then continues the old one."""
    if engine._band is not None:
        for st in engine._steps_of:
            st.band.restart()


NOISE_STATE_FORMAT = "bpclip_fast.BandedNoiseRows/1"


def noise_state_dict(engine) -> dict:
    """Every layer's last ``b−1`` noise rows, for a resume that continues the band
    (``PrivacyEngine.noise_state_dict``). Secret: with the released models they give the
    un-noised gradients of the last ``b−1`` steps. No seed is in it: the resumed run draws the
    next rows' ``z`` from a fresh one, which is the same mechanism (``C⁻¹z`` with ``z`` i.i.d.)."""
    if engine._band is None:
        raise ValueError("PrivacyEngine.noise_state_dict: this engine adds independent noise (noise='independent'), "
                         "which keeps no rows; its state_dict alone resumes it")
    charged = len(engine.accountant)
    layers = {}
    for st in engine._steps_of:
        band = st.band
        if band.next_row is not None and band.next_row > charged:  # made rows are history at once (LayerBand)
            raise RuntimeError("PrivacyEngine.noise_state_dict: a step is in progress (a backward pass has made its "
                               "noise row and optimizer.step() has not charged it); save between steps, after "
                               "optimizer.step()")
        rows, next_row = band.export_rows()
        layers[st.name] = {"rows": None if rows is None else rows.cpu(), "next_row": next_row,
                           "numel": st.band_layout()[1]}
    # the groups' seed (public): rows continue only the run whose groups the checkpoint restores
    partition_seed = engine.data_loader.batch_sampler.partition_seed
    return {"format": NOISE_STATE_FORMAT, "bands": engine.bands, "coefficients": list(engine.band_coefficients),
            "partition_seed": partition_seed, "charged": charged, "claimed": engine._counter.claimed,
            "steps": engine.steps, "layers": layers}


def load_noise_state_dict(engine, state: dict) -> None:
    """``PrivacyEngine.load_noise_state_dict``: every field checked, then the rows assigned."""
    what = "PrivacyEngine.load_noise_state_dict"
    if engine._band is None:
        raise ValueError(f"{what}: this engine adds independent noise; make_private with noise='banded' and the "
                         "checkpoint's bands")
    fmt = state.get("format") if isinstance(state, dict) else type(state).__name__
    if fmt != NOISE_STATE_FORMAT:
        raise ValueError(f"{what}: not a banded noise state (format {fmt!r}, expected {NOISE_STATE_FORMAT!r}); pass "
                         "what noise_state_dict() returned")
    if int(state["bands"]) != engine.bands or [float(c) for c in state["coefficients"]] != list(
            engine.band_coefficients):
        # Rows made with other coefficients would give the strategy a column of norm above 1 at the seam.
        raise ValueError(f"{what}: the rows were made with bands={state['bands']} and coefficients "
                         f"{state['coefficients']}, this engine has bands={engine.bands} and "
                         f"{list(engine.band_coefficients)} (its optimizer's momentum sets them); resume with the same "
                         "bands and optimizer")
    if engine._taken_here or engine._counter.claimed != getattr(engine, "_claimed_at_load", 0):
        raise RuntimeError(f"{what}: this engine has drawn batches or taken steps since make_private (or the last "
                           "load_state_dict); load the noise rows right after the checkpoint, before training")
    pairing = {"claimed": engine._counter.claimed, "steps": engine.steps, "charged": len(engine.accountant)}
    if any(int(state[k]) != v for k, v in pairing.items()):
        raise ValueError(f"{what}: the rows belong to a checkpoint at "
                         f"{ {k: int(state[k]) for k in pairing} }, this engine was loaded at {pairing}; load the "
                         "optimizer state saved together with these rows first")
    partition_seed = engine.data_loader.batch_sampler.partition_seed
    if state.get("partition_seed") != partition_seed:
        # Another run's rows: its groups are another partition, so an example in its last batches and in
        # this run's first ones could be closer than b batches (overlapping columns of C across the seam),
        # and this run's releases would carry that run's secret noise.
        raise ValueError(f"{what}: the rows were made by another run (its groups come from partition seed "
                         f"{state.get('partition_seed')!r}, this engine's checkpoint from {partition_seed}); load the "
                         "noise rows saved together with this checkpoint, or none (a new band)")
    saved = state["layers"]
    if list(saved) != [st.name for st in engine._steps_of]:
        raise ValueError(f"{what}: the rows are for the layers {list(saved)}, this model's are "
                         f"{[st.name for st in engine._steps_of]}")
    checked = []
    for st in engine._steps_of:
        entry, (like, numel) = saved[st.name], st.band_layout()
        rows, next_row = entry["rows"], entry["next_row"]
        if int(entry["numel"]) != numel or (next_row is not None and not 0 <= int(next_row) <= pairing["charged"]):
            raise ValueError(f"{what}: {st.name}'s saved rows do not fit it (its parameters have {numel} values, "
                             f"the rows {entry['numel']}, through row {next_row})")
        if rows is not None:
            if (not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (engine.bands - 1, numel)
                    or rows.dtype != like.dtype or not torch.isfinite(rows).all()):
                raise ValueError(f"{what}: {st.name}'s rows must be a finite {like.dtype} tensor of shape "
                                 f"[{engine.bands - 1}, {numel}]")
            if next_row is None:
                raise ValueError(f"{what}: {st.name} has rows but no next row")
            rows = rows.to(like.device)
        checked.append((st, rows, None if next_row is None else int(next_row), like, numel))
    for st, rows, next_row, like, numel in checked:
        st.band.import_rows(rows, next_row, like, numel)
