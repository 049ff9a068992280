"""An independent reference for exact per-example clipping (DP-SGD "flat", "per_layer", "per_param").

Nothing here uses bpclip_fast's clipping code: per-example gradients come from ``torch.func``
(``vmap`` of ``grad`` of each example's own loss, on a float64 copy of the model), and the clipped
sum is written out from its definition. A second path runs Opacus' own clipping
(``GradSampleModule`` hooks + ``DPOptimizer.clip_and_accumulate``) with the noise off, so the
oracle is checked against an implementation written by other people (tests/test_exact_oracle.py).

Clipping units: "flat" clips each example's whole gradient; "per_layer" clips the gradient of
each leaf module (a Linear/Conv2d's weight and bias together) with its own threshold; "per_param"
clips each parameter tensor separately, which is what Opacus calls "per_layer".
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from bpclip_fast.models import cifar10_net, mnist_net

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not an installed package
from bench.models import resnet20_nobn  # noqa: E402

__all__ = ["sum_cross_entropy", "per_example_grads", "layer_groups", "clipping_units", "split_thresholds",
           "ClippedSum", "clip_factor", "clipped_sum", "opacus_clipped_sum", "MeanOverTime", "sequence_linear",
           "odd_conv_net", "models"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Thresholds = Union[float, Sequence[float]]
CLIP_FNS = ("clip", "global", "normalize")


def sum_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the batch: the loss whose per-example terms are the examples' own losses."""
    return F.cross_entropy(output, target, reduction="sum")


# --- per-example gradients ------------------------------------------------------------------------

def per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn = sum_cross_entropy,
                      dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Each example's gradient of its own loss, ``{param name: [B, *param.shape]}`` for trainable parameters.

    The model is deep-copied and cast to ``dtype`` (float64 by default, so the oracle's own rounding
    is far below the float32 error of what it checks); ``loss_fn`` sees a batch of one example.
    Frozen parameters and buffers enter as constants.
    """
    ref = copy.deepcopy(model).to(dtype)
    trainable = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    constants = {n: p.detach() for n, p in ref.named_parameters() if not p.requires_grad}
    constants.update({n: b.detach() for n, b in ref.named_buffers()})

    def loss_one(params, xi, yi):
        out = functional_call(ref, {**params, **constants}, (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    x, y = (t.to(dtype) if t.is_floating_point() else t for t in (x, y))
    with torch.no_grad():
        return dict(vmap(grad(loss_one), in_dims=(None, 0, 0))(trainable, x, y))


# --- clipping units -------------------------------------------------------------------------------

def layer_groups(model: nn.Module) -> list[tuple[str, list[str]]]:
    """``(module name, [its own trainable parameter names])`` for each module owning trainable parameters.

    A module's *own* parameters (``recurse=False``) make one layer: a Linear's weight and bias are
    clipped together under "per_layer". Order follows ``named_modules``, which is the order of
    ``named_parameters`` for these models.
    """
    groups = []
    for name, module in model.named_modules():
        own = [f"{name}.{p}" if name else p for p, t in module.named_parameters(recurse=False) if t.requires_grad]
        if own:
            groups.append((name, own))
    return groups


def clipping_units(model_groups: list[tuple[str, list[str]]], clipping: str) -> list[tuple[str, list[str]]]:
    """The sets of parameters that share one norm and one factor: all of them, each layer, or each tensor."""
    names = [p for _, ps in model_groups for p in ps]
    if clipping == "flat":
        return [("all", names)]
    if clipping == "per_layer":
        return list(model_groups)
    if clipping == "per_param":
        return [(p, [p]) for p in names]
    raise ValueError(f"clipping must be 'flat', 'per_layer' or 'per_param', got {clipping!r}")


def split_thresholds(max_grad_norm: Thresholds, n_units: int) -> list[float]:
    """One threshold per unit; a scalar ``C`` becomes ``C / sqrt(n_units)`` so the total sensitivity stays ``C``."""
    if isinstance(max_grad_norm, (int, float)):
        return [float(max_grad_norm) / math.sqrt(n_units)] * n_units
    thresholds = [float(c) for c in max_grad_norm]
    if len(thresholds) != n_units:
        raise ValueError(f"{len(thresholds)} thresholds for {n_units} clipping units")
    return thresholds


# --- the clipped sum ------------------------------------------------------------------------------

def clip_factor(norms: torch.Tensor, max_grad_norm: float, clip_fn: str = "clip", gamma: float = 0.01,
                eps: float = 0.0) -> torch.Tensor:
    """The per-example factor ``f(n; C)``: clip ``min(1, C/(n+eps))``, global ``1[n <= C]``, normalize ``C/(n+gamma)``.

    ``eps`` is 0 in the exact definition; pass 1e-6 to reproduce Opacus' ``(C/(n+1e-6)).clamp(max=1)``.
    A zero norm under "clip" gives ``C/0 = inf``, clamped to 1.
    """
    if clip_fn == "clip":
        return (max_grad_norm / (norms + eps)).clamp(max=1.0)
    if clip_fn == "global":
        return (norms <= max_grad_norm).to(norms.dtype)
    if clip_fn == "normalize":
        return max_grad_norm / (norms + gamma)
    raise ValueError(f"clip_fn must be one of {CLIP_FNS}, got {clip_fn!r}")


@dataclass
class ClippedSum:
    """The release with noise off, with what produced it, so tests can check each step.

    ``sums[p] = sum_i factors[u][i] * G_{p,i}`` for the unit ``u`` holding ``p``; ``norms[u][i]`` is
    example i's gradient norm over that unit and ``thresholds[u]`` its ``C_u``.
    """

    sums: dict[str, torch.Tensor]
    units: list[tuple[str, list[str]]]
    norms: dict[str, torch.Tensor]
    factors: dict[str, torch.Tensor]
    thresholds: dict[str, float]


def clipped_sum(per_ex: dict[str, torch.Tensor], groups: list[tuple[str, list[str]]], max_grad_norm: Thresholds,
                clipping: str, clip_fn: str = "clip", gamma: float = 0.01, eps: float = 0.0) -> ClippedSum:
    """``sum_i c_i G_i`` with ``c_i = f(n_i; C)`` taken per unit of ``clipping`` (see :func:`clipping_units`).

    ``groups`` is :func:`layer_groups` of the model and must cover exactly the parameters of
    ``per_ex``. ``max_grad_norm`` is one ``C`` (split over the units as ``C/sqrt(U)``) or a list
    with one ``C_u`` per unit.
    """
    covered = sorted(p for _, ps in groups for p in ps)
    if covered != sorted(per_ex):
        raise ValueError(f"groups cover {covered}, per-example gradients hold {sorted(per_ex)}")
    units = clipping_units(groups, clipping)
    thresholds = dict(zip((u for u, _ in units), split_thresholds(max_grad_norm, len(units))))
    norms, factors, sums = {}, {}, {}
    for unit, params in units:
        sq = sum(per_ex[p].flatten(1).pow(2).sum(1) for p in params)
        norms[unit] = sq.sqrt()
        factors[unit] = clip_factor(norms[unit], thresholds[unit], clip_fn, gamma, eps)
        for p in params:
            sums[p] = torch.einsum("i,i...->...", factors[unit], per_ex[p])
    return ClippedSum({p: sums[p] for p in per_ex}, units, norms, factors, thresholds)


# --- Opacus' clipping -----------------------------------------------------------------------------

def opacus_clipped_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
                       max_grad_norm: Thresholds, clipping: str,
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Opacus' own clipped sum (noise 0): ``{param name: p.summed_grad}`` after ``clip_and_accumulate``.

    ``clipping`` is Opacus' name: "flat" (``DPOptimizer``) or "per_layer" (``DPPerLayerOptimizer``,
    one threshold per *parameter tensor*, i.e. this module's "per_param"); a scalar ``C`` is split
    as ``C/sqrt(P)`` there, as :func:`clipped_sum` does, since Opacus itself takes only a list.
    Opacus' factor is ``(C/(n+1e-6)).clamp(max=1)``, so compare with ``clipped_sum(..., eps=1e-6)``.
    """
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer

    copy_ = copy.deepcopy(model).to(dtype)
    names = {id(p): n for n, p in copy_.named_parameters() if p.requires_grad}
    gsm = GradSampleModule(copy_, batch_first=True, loss_reduction="sum")
    params = [p for p in copy_.parameters() if p.requires_grad]
    base = torch.optim.SGD(params, lr=0.0)
    common = dict(noise_multiplier=0.0, expected_batch_size=len(x), loss_reduction="sum")
    if clipping == "flat":
        optimizer = DPOptimizer(base, max_grad_norm=float(max_grad_norm), **common)
    elif clipping == "per_layer":
        optimizer = DPPerLayerOptimizer(base, max_grad_norm=split_thresholds(max_grad_norm, len(params)), **common)
    else:
        raise ValueError(f"Opacus clipping is 'flat' or 'per_layer', got {clipping!r}")
    x, y = (t.to(dtype) if t.is_floating_point() else t for t in (x, y))
    with warnings.catch_warnings():  # Opacus' full backward hooks warn that the input needs no gradient
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss_fn(gsm(x), y).backward()
    optimizer.clip_and_accumulate()
    return {names[id(p)]: p.summed_grad.detach() for p in optimizer.params}


# --- the model zoo --------------------------------------------------------------------------------

class MeanOverTime(nn.Module):
    """``[B, T, C] -> [B, C]``: the loss of a sequence model taken on its output averaged over T."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def sequence_linear() -> nn.Sequential:
    """Linear layers on 3-D input ``[B, T=5, 6]``: each example's weight gradient sums over its T positions."""
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), MeanOverTime())


def odd_conv_net() -> nn.Sequential:
    """Convolutions off the common path, on ``[B, 4, 12, 12]``; biased and unbiased layers alternate.

    12 -> strided conv (s2, p1) 6 -> grouped conv (groups=2) 6 -> depthwise conv (groups=8) 6 ->
    dilated conv (dilation 2, kernel 3x2, stride (1,2)) 2x2 -> Linear(24 -> 5).
    """
    return nn.Sequential(
        nn.Conv2d(4, 8, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False),
        nn.Tanh(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.Tanh(),
        nn.Conv2d(8, 6, (3, 2), dilation=2, stride=(1, 2), bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, 5),
    )


def models() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]]:
    """``{name: (factory() -> nn.Module, input shape without the batch dim, number of classes)}``.

    The factories keep their default activations. ``cifar10`` holds ~29.6M parameters: use B <= 2.
    """
    return {
        "mnist": (mnist_net, (1, 28, 28), 10),
        "cifar10": (cifar10_net, (3, 32, 32), 10),
        "resnet20": (resnet20_nobn, (3, 32, 32), 10),
        "sequence_linear": (sequence_linear, (5, 6), 8),
        "odd_conv": (odd_conv_net, (4, 12, 12), 5),
    }
