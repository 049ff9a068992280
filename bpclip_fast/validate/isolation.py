"""What the probes run on: a copy of the model (or the model itself, restored after), its composites
unpacked and our layers run as their torch base class.

Apart from the probes because the criterion's probe (:mod:`bpclip_fast.criterion`) isolates the
model the same way, and must leave it as untouched as they do.
"""

from __future__ import annotations

import contextlib
import copy
import types

from torch import nn

from .. import registry
from .forward import _MISSING, restore_forward
from .probe_pass import _SHARED_UNITS
from .probes import _buffer_snapshot, _restore_buffers




@contextlib.contextmanager
def _isolated(model: nn.Module):
    """The model the probes may change: a deep copy (tied parameters stay tied in it); if the model
    cannot be copied, the model itself, with its training modes, buffers and ``.grad`` restored after."""
    try:
        work = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - an attribute that cannot be copied (a lock, a file, a C object)
        work = None
    if work is not None:
        yield work
        return
    modes = [(m, m.training) for m in model.modules()]
    buffers = _buffer_snapshot(model)
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training
        _restore_buffers(buffers)
        for p, g in grads:
            p.grad = g


@contextlib.contextmanager
def _unpacked(work: nn.Module, model: nn.Module):
    """The probes see what training runs: every composite (``registry.Composite``, an
    ``nn.MultiheadAttention``) unpacked into the registered layers that train it, as ``convert_model``
    does; packed back after where ``work`` is the model itself (it could not be copied)."""
    done = [(m, e) for _, m, e in registry.composites(work, _SHARED_UNITS.get())]
    for m, e in done:
        e.unpack(m)
    try:
        yield
    finally:
        if work is model:
            for m, e in reversed(done):
                e.pack(m)


@contextlib.contextmanager
def _as_torch_layers(model: nn.Module):
    """Our layers clip in their backward (and may draw a step's noise), so their parameter gradient is
    not the plain one probe 4 recomputes: the probes run their torch base class's forward instead."""
    patched = []
    for m in model.modules():
        if registry.is_clipped(m):
            base = type(m)._bp_base if registry.is_generic(m) else registry.layer_type(m).torch_type
            patched.append((m, m.__dict__.get("forward", _MISSING)))
            m.forward = types.MethodType(base.forward, m)
    try:
        yield
    finally:
        for m, previous in patched:
            restore_forward(m, previous)
