""":func:`fix_model`: the fix the BatchNorm problem message names.

Apart from the checks: it changes the model, where everything else in this package only reads it
(or a copy of it).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..models import group_count


def _group_norm_for(bn: nn.modules.batchnorm._BatchNorm) -> nn.GroupNorm:
    """The GroupNorm replacing ``bn`` (:func:`fix_model`), its affine parameters copied."""
    if isinstance(bn, nn.modules.lazy.LazyModuleMixin) and bn.has_uninitialized_params():
        raise ValueError(f"fix_model: {type(bn).__name__} has not seen an input yet, so its number of channels is "
                         "unknown; run one forward pass before fix_model")
    channels = bn.num_features
    # A BatchNorm1d may see [B, C] feature vectors, where a group of a few channels would normalise a
    # handful of numbers (one channel: its output is its bias alone); one group normalises them all.
    groups = 1 if isinstance(bn, nn.BatchNorm1d) else group_count(channels, 32)
    like = bn.weight if bn.affine else bn.running_mean
    kw = {} if like is None else {"device": like.device, "dtype": like.dtype}
    gn = nn.GroupNorm(groups, channels, eps=bn.eps, affine=bn.affine, **kw)
    if bn.affine:
        with torch.no_grad():
            gn.weight.copy_(bn.weight)
            gn.bias.copy_(bn.bias)
        gn.weight.requires_grad_(bn.weight.requires_grad)
        gn.bias.requires_grad_(bn.bias.requires_grad)
    gn.train(bn.training)
    return gn


def fix_model(model: nn.Module) -> nn.Module:
    """Replaces every BatchNorm of ``model`` (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, lazy ones once
    initialised: every ``nn.modules.batchnorm._BatchNorm``) by an ``nn.GroupNorm``, in place; returns
    ``model`` (a bare BatchNorm: its replacement).

    BatchNorm normalises each example with statistics of the batch, so one example moves the others
    (:mod:`bpclip_fast.registry` refuses it); GroupNorm's statistics are each example's own. The
    replacement has the BatchNorm's ``num_features``, ``eps`` and ``affine``, its weight and bias
    (values and ``requires_grad``), device, dtype and training mode; the running statistics are
    dropped. Groups: the largest divisor of the channels that is at most 32 (64 channels -> 32, 48 ->
    24), except for ``BatchNorm1d``, which becomes ``GroupNorm(1, C)``: it may normalise ``[B, C]``
    feature vectors, where a group of few channels would normalise a handful of numbers. A module
    shared by two parents is replaced by one GroupNorm. A model that learnt with BatchNorm computes
    other functions afterwards: train (or fine-tune) it after fixing.

    Warns (``UserWarning``) with one line per replaced module, ``name: BatchNorm2d(64) ->
    GroupNorm(32, 64)``; silent when there is nothing to replace.
    """
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        gn = _group_norm_for(model)
        warnings.warn(f"fix_model: replaced {type(model).__name__}({model.num_features}) by "
                      f"GroupNorm({gn.num_groups}, {gn.num_channels})", stacklevel=2)
        return gn
    replaced: dict[int, nn.GroupNorm] = {}
    changes = []
    for parent_name, parent in list(model.named_modules()):
        # _modules, not named_children(): that yields a module held twice by one parent only once
        for child_name, child in list(parent._modules.items()):
            if not isinstance(child, nn.modules.batchnorm._BatchNorm):
                continue
            if id(child) not in replaced:
                replaced[id(child)] = _group_norm_for(child)
                gn = replaced[id(child)]
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                changes.append(f"{name}: {type(child).__name__}({child.num_features}) -> "
                               f"GroupNorm({gn.num_groups}, {gn.num_channels})")
            setattr(parent, child_name, replaced[id(child)])
    if changes:
        warnings.warn(f"fix_model: replaced {len(changes)} BatchNorm layer{'s' if len(changes) > 1 else ''} by "
                      "GroupNorm (statistics within each example; train the model after this):\n  "
                      + "\n  ".join(changes), stacklevel=2)
    return model
