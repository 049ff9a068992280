"""The arguments of ``make_private`` that can be checked alone, all before the model is changed (a
failure after the conversion would leave a model no engine can make private), and the record of
them that the set-up composes from."""

from __future__ import annotations

import dataclasses
import numbers
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import adaptive as _adaptive
from .. import modes
from .. import nn as bnn
from . import optimizer as _optimizer
from ._common import InsecureSeedWarning, positive


@dataclasses.dataclass(frozen=True)
class Request:
    """The arguments of one ``make_private`` (its signature holds the defaults and their meaning),
    with ``sigma_effective`` set by ``make_private_with_epsilon``: the effective σ it computed, from
    which each layer's σ follows once the layers are counted."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    data_loader: DataLoader
    noise_multiplier: float
    input_clip: float | None
    grad_clip: float | None
    conv_norm: str
    clipping: str
    max_grad_norm: object
    norm_method: str
    clip_fn: str
    gamma: float
    loss_reduction: str
    poisson_sampling: bool
    noise_seed: int | None
    max_epsilon: float | None
    delta: float | None
    max_input_shape: object
    nonfinite: str
    probe: bool
    adaptive: object
    criterion: object
    batch_inputs: object
    noise: str = "independent"
    bands: int = 1
    integer_noise: bool = False
    sigma_effective: float | None = None

    @property
    def what(self) -> str:
        """The entry point named in errors."""
        return "make_private" if self.sigma_effective is None else "make_private_with_epsilon"


def check(made_private: bool, module, optimizer, data_loader, *, noise_multiplier, input_clip, grad_clip,
          clipping, max_grad_norm, loss_reduction, nonfinite, max_epsilon, delta, noise_seed) -> float:
    """The arguments of ``make_private`` that can be checked alone (all before the model is
    changed: a failure after the conversion would leave a model no engine can make private);
    returns σ."""
    if made_private:
        raise RuntimeError("PrivacyEngine: make_private was already called on this engine; use one engine "
                           "per model (its accountant belongs to that training run)")
    for value, kind, what in ((module, nn.Module, "module must be a torch.nn.Module"),
                              (optimizer, torch.optim.Optimizer, "optimizer must be a torch.optim.Optimizer"),
                              (data_loader, DataLoader, "data_loader must be a torch DataLoader")):
        if not isinstance(value, kind):
            raise TypeError(f"make_private: {what}, got {type(value).__name__}")
    if isinstance(optimizer, _optimizer.DPOptimizer) or any(isinstance(m, bnn._Clipped) and m._bp_step is not None
                                                            and m._bp_step.enforce for m in module.modules()):
        raise RuntimeError("PrivacyEngine: this model/optimizer is already private (make_private called twice)")
    sigma = positive(noise_multiplier, "noise_multiplier")
    check_clipping(clipping, input_clip, grad_clip, max_grad_norm)
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"make_private: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if nonfinite not in ("drop", "raise"):
        raise ValueError(f"make_private: nonfinite must be 'drop' or 'raise', got {nonfinite!r}")
    if max_epsilon is not None:
        positive(max_epsilon, "max_epsilon")
        if delta is None or not 0 < float(delta) < 1:
            raise ValueError("make_private: max_epsilon needs delta in (0, 1), the δ at which ε is measured")
    if noise_seed is not None:
        if not 0 <= int(noise_seed) < 2 ** 63:
            raise ValueError(f"make_private: noise_seed must be in [0, 2**63), got {noise_seed}")
        warnings.warn("PrivacyEngine: an explicit noise_seed makes the noise and the batch sampling "
                      "reproducible, and is for that only: whoever knows the seed can subtract the noise, "
                      "and the privacy guarantee is void. Use noise_seed=None (OS entropy) for a real run.",
                      InsecureSeedWarning, stacklevel=5)  # the caller of make_private
    return sigma


def check_clipping(clipping, input_clip, grad_clip, max_grad_norm) -> None:
    """The bounds each clipping mode takes, and only those (the mode's ``check_request``)."""
    modes.strategy(clipping, "make_private").check_request(input_clip, grad_clip, max_grad_norm)


def check_adaptive(adaptive):
    """``None`` (fixed thresholds) or the :class:`bpclip_fast.Adaptive` options."""
    if adaptive is None or adaptive is False:
        return None
    if adaptive is True:
        return _adaptive.Adaptive()
    if not isinstance(adaptive, _adaptive.Adaptive):
        raise TypeError(f"make_private: adaptive must be None, True or a bpclip_fast.Adaptive(...), got "
                        f"{type(adaptive).__name__}")
    return adaptive


def check_batch_inputs(batch_inputs):
    """``None`` (every element of a tuple batch but the last is a model input) or a positive count
    (:mod:`bpclip_fast.batches`)."""
    if batch_inputs is None:
        return None
    if isinstance(batch_inputs, bool) or not isinstance(batch_inputs, numbers.Integral) or batch_inputs < 1:
        raise ValueError(f"make_private: batch_inputs must be a positive integer (how many leading elements of a "
                         f"tuple batch are model inputs) or None (all but the last), got {batch_inputs!r}")
    return int(batch_inputs)


def check_built_layers(inner, clipping, max_grad_norm) -> None:
    """Clipped layers the user built must clip as the engine does (flat: with its ``C``); none may come
    from a refused make_private (its bounds would pass for the user's own)."""
    refused = [f"{name}: {layer.__dict__['_bp_refused_setup']}" for name, layer in bnn.clipped_layers(inner)
               if "_bp_refused_setup" in layer.__dict__]
    if refused:
        raise ValueError("make_private: " + "; ".join(refused))
    bad = [f"{name} is clipping={layer._bp_clipping!r}" for name, layer in bnn.clipped_layers(inner)
           if layer._bp_clipping != clipping]
    bad += modes.strategy(clipping).built_layer_problems(bnn.clipped_layers(inner), max_grad_norm)
    if bad:
        raise ValueError(f"make_private: clipping={clipping!r}, but the model's own clipped layers differ: "
                         + "; ".join(bad) + ". Build them with the engine's clipping, or use torch's layers "
                         "and let make_private convert them")


def check_pairing(accountant, accountant_name: str, poisson_sampling: bool):
    """The sampling and the accountant's analysis must match (module docstring of :mod:`bpclip_fast.engine`)."""
    sampling = getattr(accountant, "sampling", None)
    adjacency = getattr(accountant, "adjacency", None)
    if not poisson_sampling and adjacency not in (None, "replace_one"):
        raise ValueError(
            f"PrivacyEngine: shuffled disjoint batches (poisson_sampling=False) are analysed only under "
            f"replace-one adjacency, not {adjacency!r}: adding one example re-packs every batch of the "
            "epoch, so one example moves the release by 2Δ while add/remove zCDP charges Δ. Use "
            "PrivacyEngine(accountant='zcdp') (replace_one), or Poisson sampling with 'rdp'/'pld'")
    if poisson_sampling and sampling != "poisson":
        raise ValueError(
            f"PrivacyEngine: the {accountant_name!r} accountant analyses shuffled disjoint batches "
            f"(sampling={sampling!r}), not Poisson sampling; use PrivacyEngine(accountant='rdp' or 'pld') with "
            "poisson_sampling=True, or keep this accountant with poisson_sampling=False")
    if not poisson_sampling and sampling != "shuffle":
        raise ValueError(
            f"PrivacyEngine: poisson_sampling=False (shuffled disjoint batches) cannot be accounted for by the "
            f"{accountant_name!r} accountant, which assumes Poisson sampling (its ε would not bound this "
            "run); use PrivacyEngine(accountant='zcdp') for shuffled batches, or poisson_sampling=True")
