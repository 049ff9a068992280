"""The clipping modes as strategy objects (:mod:`bpclip_fast.modes.base` has the interface):
``strategy("flat")`` is the :class:`~bpclip_fast.modes.flat.Flat` mode."""

from __future__ import annotations

from .backprop import Backprop
from .base import EXACT, NAMES, ExactMode, Mode
from .flat import Flat
from .per_layer import PerLayer

__all__ = ["Mode", "ExactMode", "Backprop", "Flat", "PerLayer", "NAMES", "EXACT", "strategy"]

_MODES = {mode.name: mode for mode in (Backprop(), Flat(), PerLayer())}
assert tuple(_MODES) == NAMES


def strategy(name, where: str = "clipping") -> Mode:
    """The mode called ``name``; an unknown one raises the error every entry point gives, prefixed
    by ``where`` (the layer, ``convert_model`` or ``make_private``)."""
    mode = next((m for m in _MODES.values() if m.name == name), None)  # as `name in NAMES` compares
    if mode is None:
        raise ValueError(f"{where}: clipping must be one of {NAMES}, got {name!r}")
    return mode
