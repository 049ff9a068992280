"""``make_private(integer_noise=True)``: its refusals and the layers' set-up (the mechanism and its
proof: :mod:`bpclip_fast.integer_noise`)."""

from __future__ import annotations

from .. import adaptive as _adaptive
from .. import integer_noise
from ._common import half_precision_dtype


def accountant_problem(accountant_name: str) -> str | None:
    """Why the accountant cannot charge the integer release (``None`` when it can)."""
    if accountant_name == "pld":
        return ("the PLD accountant has no proof for the discrete Gaussian's privacy loss; use "
                "PrivacyEngine(accountant='rdp') (charged at integer orders) or 'zcdp'")
    return None


def check(r, accountant_name: str, distributed: bool) -> bool:
    """Whether the run releases through integers; a clear error where it cannot yet."""
    if not isinstance(r.integer_noise, bool):
        raise TypeError(f"{r.what}: integer_noise must be True or False, got {r.integer_noise!r}")
    if not r.integer_noise:
        return False
    why = None
    if r.noise != "independent":
        why = "correlated noise (noise='banded') has no integer form yet; use noise='independent'"
    elif accountant_problem(accountant_name) is not None:
        why = accountant_problem(accountant_name)
    elif distributed:
        why = ("DDP is not supported yet (each rank would release its part of the sum before DDP's average, "
               "and a float sum of released parts is not a function of the integers); train in one process")
    if why is not None:
        raise ValueError(f"{r.what}: integer_noise=True is not available here: {why}")
    dtype = half_precision_dtype(r.optimizer)
    if dtype is not None:
        raise ValueError(f"{r.what}: integer_noise=True needs float32 or float64 parameters (found {dtype}): the "
                         "gradient is released from the tensor the layer returns, and a half-precision one is "
                         "rounded before its noise; keep the parameters in float32 (autocast computes in half "
                         "precision without them)")
    return True


def accountant_kwargs(accountant_name: str, kwargs: dict) -> dict:
    """The accountant's settings under integer noise: RDP at integer orders only."""
    return {**kwargs, "orders": integer_noise.INTEGER_ORDERS} if accountant_name == "rdp" else kwargs


def prepare(engine, thresholds_per_layer: int, adaptive: bool) -> None:
    """Each layer's grid bits (``g`` from the clipped layers' ``D`` coordinates), after every Δ the
    run can reach (adaptive thresholds within their clamp) was checked to fit the grid."""
    coordinates = sum(p.numel() for st in engine._steps_of for p in st.params if p is not None)
    bits = integer_noise.grid_bits(coordinates)
    factor = 2.0 * float(_adaptive._CLAMP) ** thresholds_per_layer if adaptive else 1.0
    bad = []
    for st in engine._steps_of:
        try:
            delta = float(st.layer.sensitivity)
        except RuntimeError:  # a shape-dependent Δ never fixed: its noise is refused at the forward
            delta = None
        for d in () if delta is None else (delta / factor, delta * factor):
            why = integer_noise.problem(st.name, engine.gradient_noise_multiplier, d, bits)
            if why is not None:
                bad.append(why)
                break
        st.integer_bits = bits
    if bad:
        raise ValueError("make_private: integer_noise=True cannot release these layers:\n  - " + "\n  - ".join(bad))
