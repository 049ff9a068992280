"""Mixed precision around the fused layers' backward (issue 26; the forward's half is
:func:`bpclip_fast.nn._in_parameter_dtype`).

A backward pass called inside a ``torch.autocast`` region runs with autocast's thread-local state on,
and our ops let autocast fall through: the ATen ops they call inside (the exact modes' Gram and
instantiation ``bmm``, backpropagation clipping's input-gradient ``mm``) were cast to bf16/fp16 while
the rest stayed in the parameters' dtype, and the step died on an internal dtype check
(``exact_bound_: x, g, gb, wa and wb must share a dtype``; ``clip_rows_backward: grad is BFloat16``).
The fused layers' forward already runs with autocast off; their backward does too, so its kernels
and proved bounds are those of the parameters' dtype wherever ``backward()`` is called. The generic
units' backward keeps the caller's state: their per-example gradients are differentiated from the
forward's own graph in whatever precision, and bounded on the values released
(:class:`bpclip_fast.examples.DenseExamples`)."""

from __future__ import annotations

import contextlib
import functools

import torch

_DEVICE_TYPES = ("cpu", "cuda")


# Whether autocast exists for a device type, asked once (per backward and per forward otherwise).
_AVAILABLE = {t: torch.amp.is_autocast_available(t) for t in _DEVICE_TYPES}
_WITH_AUTOCAST = tuple(t for t in _DEVICE_TYPES if _AVAILABLE[t])


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``. Whether it exists for that type is asked once:
    torch 2.11's dynamo cannot trace ``torch._C._is_autocast_available`` (a graph break in every
    compiled layer's forward), and the answer is fixed by the build."""
    available = _AVAILABLE.get(device_type)
    if available is None:
        available = _AVAILABLE[device_type] = torch.amp.is_autocast_available(device_type)
    return available and torch.is_autocast_enabled(device_type)


def autocast_off(backward):
    """``backward`` run with autocast disabled for every device type that has it on (module docstring)."""
    @functools.wraps(backward)
    def wrapped(*args, **kwargs):
        if not any(map(torch.is_autocast_enabled, _WITH_AUTOCAST)):  # per layer per pass: no generator frame
            return backward(*args, **kwargs)
        on = [t for t in _WITH_AUTOCAST if torch.is_autocast_enabled(t)]
        with contextlib.ExitStack() as stack:
            for device_type in on:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            return backward(*args, **kwargs)
    return wrapped
