"""The sensitivity audit's argument checks: a bad model, engine, loss reduction or batch is refused with the rule and
what to do instead, before any measurement; and the deep copy every measurement runs on (:func:`_copy`), whose
failure is a model caught mid-step.

Apart so that the audit (:mod:`.contribution`) and the noise-free copy (:mod:`.noise_free`, which copies with
:func:`_copy`) share them without importing each other.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .. import nn as bnn


def _unwrap(model):
    if not isinstance(model, nn.Module):
        raise TypeError(f"sensitivity: model must be a torch.nn.Module, got {type(model).__name__}")
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _check_layers(inner, engine):
    layers = bnn.clipped_layers(inner)
    if not layers:
        raise ValueError("sensitivity: model has no bpclip_fast clipped layer; pass the model returned by "
                         "PrivacyEngine.make_private (or one converted with bpclip_fast.nn.convert_model)")
    modes = {layer._bp_clipping for _, layer in layers}
    if len(modes) > 1:
        raise ValueError(f"sensitivity: model mixes clipping modes {sorted(modes)}; one model is private in one mode")
    if engine is not None:
        if not getattr(engine, "_made_private", False):
            raise ValueError("sensitivity: engine has not made a model private (call make_private first)")
        if {id(m) for _, m in layers} != {id(m) for m in engine._layers}:
            raise ValueError("sensitivity: engine is not the PrivacyEngine of model (their clipped layers differ)")
    return layers, modes.pop()


def _reduction(engine, loss_reduction, mean_batch_size):
    if engine is not None:
        if loss_reduction not in (None, engine.loss_reduction):
            raise ValueError(f"sensitivity: loss_reduction={loss_reduction!r}, but engine was made private with "
                             f"loss_reduction={engine.loss_reduction!r}")
        loss_reduction = engine.loss_reduction
        if loss_reduction == "mean":
            mean_batch_size = float(engine.expected_batch_size)
    loss_reduction = loss_reduction or "sum"
    if loss_reduction not in ("sum", "mean"):
        raise ValueError(f"sensitivity: loss_reduction must be 'sum' or 'mean', got {loss_reduction!r}")
    if loss_reduction == "mean" and not (mean_batch_size and mean_batch_size > 0):
        raise ValueError("sensitivity: loss_reduction='mean' without engine needs mean_batch_size (the B̄ the "
                         "layers scale by)")
    return loss_reduction, (float(mean_batch_size) if loss_reduction == "mean" else None)


def _check_batch(batch):
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError("sensitivity: batch must be a pair (inputs, targets), got "
                        f"{type(batch).__name__}{'' if not hasattr(batch, '__len__') else f' of length {len(batch)}'}")
    x, y = batch
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        raise TypeError(f"sensitivity: batch must hold two tensors (inputs, targets), got ({type(x).__name__}, "
                        f"{type(y).__name__})")
    if x.dim() < 1 or y.dim() < 1 or x.shape[0] != y.shape[0] or x.shape[0] < 1:
        raise ValueError(f"sensitivity: batch's inputs {tuple(x.shape)} and targets {tuple(y.shape)} must share a "
                         "first (example) dimension of size >= 1")
    return x, y


def _copy(inner, name="model"):
    try:
        return copy.deepcopy(inner)
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"sensitivity: {name} cannot be copied ({exc}); it holds state of a forward or backward "
                           "in progress (a graph tensor kept on a module). Audit it between training steps, after "
                           "optimizer.step() or zero_grad()") from exc
