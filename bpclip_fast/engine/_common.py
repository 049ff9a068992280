"""What every module of the engine shares: the seed warning, the pickling refusal, argument checks."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .. import nn as bnn


class InsecureSeedWarning(UserWarning):
    """An explicit noise seed: reproducible, and whoever knows it can subtract the noise."""


class Float64NoiseWarning(UserWarning):
    """No longer issued: float64 parameters draw float64 normals. Kept so that code filtering it
    still imports (the floating-point attack that remains: the README, "Floating-point noise")."""


# An engine holds the secret noise and sampling seeds and the live step records: a pickled or copied
# engine (or an optimizer holding it) would carry the seed into a file, or continue the same draws.
NO_PICKLE = ("{} cannot be pickled or copied: it holds the secret noise seed and the live step state. "
             "Save optimizer.state_dict() (it carries engine.state_dict(), never the seed) and load it into "
             "a fresh make_private set-up")


def accounting():
    from .. import accounting  # imported lazily: the accounting package is optional at import time

    return accounting


def positive(value, what):
    return bnn._check_positive(value, what, "PrivacyEngine")


def to_device(batch, model):
    """``batch`` with its floating tensors on the device (and dtype) of ``model``'s first parameter."""
    p = next(model.parameters(), None)
    if p is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(p.device, p.dtype) if batch.is_floating_point() else batch.to(p.device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, model) for b in batch)
    if isinstance(batch, Mapping):
        return {k: to_device(v, model) for k, v in batch.items()}
    return batch


def half_precision_dtype(optimizer):
    """The dtype of a trainable parameter of ``optimizer`` that is neither float32 nor float64, or
    ``None``: the noise that is added to the released gradient itself (banded rows, the integer
    release) must meet the sum before any rounding to half precision."""
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        if p.requires_grad and p.dtype not in (torch.float32, torch.float64):
            return p.dtype
    return None
