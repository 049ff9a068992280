"""Backpropagation clipping in plain PyTorch hooks: the test oracle and the unfused baseline.

This module implements the algorithm of Stevens et al. (2022) the way the paper's own code does,
with module hooks on ``nn.Linear``, ``nn.Conv2d`` and ``nn.Conv1d``:

* a forward pre-hook replaces each example's input ``x`` by ``s(x) x`` (L2 norm, bound ``C_x``);
  the map is written in differentiable torch ops, so autograd supplies its exact Jacobian;
* a full backward pre-hook replaces each example's upstream gradient ``g`` by ``t(g) g`` (L2 for
  Linear, ``l15`` or L2 for Conv2d, bound ``C_g``) before the layer computes its weight *and*
  input gradients, so the clipped gradient is also what flows further down.

It deliberately shares no code with ``bpclip_fast._ops`` / ``autograd`` / ``nn`` or the C++
kernels: the tests compare the fused layers with this file, and a comparison is only evidence if
the two sides could not share a bug. For the same reason the sensitivity here is derived again
from DESIGN.md section 2 (with a brute-force patch count for the Conv2d L2 bound) rather than
imported. It is also the "unfused" baseline of the benchmarks, hence :func:`add_noise`, which
draws noise with ``torch.randn`` (not the Philox stream the library uses).

Conventions shared with the kernels: the factor for an example of norm ``n`` and bound ``C`` is
``clip`` ``min(1, C/n)`` (1 at ``n == C``), ``global`` ``1[n <= C]``, ``normalize`` ``C/(n+gamma)``;
a non-finite norm (NaN/Inf entry, or an accumulator overflow) gives factor 0 and an all-zero
clipped example.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = [
    "CLIP_FNS",
    "NORMS",
    "l2_norm",
    "l15_norm",
    "clip_factor",
    "clip_input",
    "clip_upstream",
    "attach",
    "layer_sensitivity",
    "conv_patch_multiplicity",
    "record_input_shapes",
    "add_noise",
    "clipped_modules",
]

CLIP_FNS = ("clip", "global", "normalize")
NORMS = ("l2", "l15")
_LAYERS = (nn.Linear, nn.Conv2d, nn.Conv1d)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision sums of squares overflow at ~256 (fp16) and lose digits (bf16).
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check_bound(bound: float, name: str = "bound") -> float:
    bound = float(bound)
    if not (math.isfinite(bound) and bound > 0):
        raise ValueError(f"{name} must be a positive finite number, got {bound}")
    return bound


def _check_clip_fn(clip_fn: str, gamma: float) -> None:
    if clip_fn not in CLIP_FNS:
        raise ValueError(f"clip_fn must be one of {CLIP_FNS}, got {clip_fn!r}")
    if clip_fn == "normalize" and not (math.isfinite(gamma) and gamma > 0):
        # gamma = 0 would give an infinite factor for an all-zero example.
        raise ValueError(f"clip_fn='normalize' needs a positive finite gamma, got {gamma}")


def _check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")


def _row_view(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape((like.shape[0],) + (1,) * (like.dim() - 1))


def l2_norm(x: torch.Tensor) -> torch.Tensor:
    """Per-example L2 norm over all non-batch dims; shape ``[B]``, float32 for half inputs."""
    if x.dim() < 2:
        raise ValueError(f"expected a batched tensor [B, ...], got shape {tuple(x.shape)}")
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1, dtype=_acc_dtype(x.dtype))


def l15_norm(g: torch.Tensor) -> torch.Tensor:
    """``sqrt(sum_c (sum_{h,w} |g[b,c,h,w]|)^2)`` for ``g`` of shape ``[B, C, H, W]`` (a Conv1d's
    ``[B, C, L]``: the sum over ``l``); shape ``[B]``."""
    if g.dim() not in (3, 4):
        raise ValueError(f"l15_norm expects [B, C, H, W] or [B, C, L], got shape {tuple(g.shape)}")
    per_channel = g.to(_acc_dtype(g.dtype)).abs().sum(dim=tuple(range(2, g.dim())))
    return torch.linalg.vector_norm(per_channel, dim=1)


def clip_factor(norm: torch.Tensor, bound: float, clip_fn: str, gamma: float = 0.01) -> torch.Tensor:
    """Per-example factor keeping ``factor * norm <= bound``; 0 where ``norm`` is not finite.

    Differentiable in ``norm`` (``global`` is piecewise constant); every branch is evaluated on a
    finite stand-in so that ``torch.where`` never back-propagates ``0 * inf``.
    """
    bound = _check_bound(bound)
    _check_clip_fn(clip_fn, gamma)
    finite = torch.isfinite(norm)
    n = torch.where(finite, norm, torch.zeros_like(norm))
    if clip_fn == "clip":
        over = n > bound
        s = torch.where(over, bound / torch.where(over, n, torch.full_like(n, bound)), torch.ones_like(n))
    elif clip_fn == "global":
        s = (n <= bound).to(n.dtype)
    else:
        s = bound / (n + gamma)
    return torch.where(finite, s, torch.zeros_like(s))


def clip_input(x: torch.Tensor, bound: float, clip_fn: str = "clip", gamma: float = 0.01) -> torch.Tensor:
    """``x * s(x)`` per example (L2 over all non-batch dims), differentiable with the exact Jacobian.

    An example with a non-finite norm becomes exactly zero, and so does its input gradient.
    """
    bound = _check_bound(bound)
    _check_clip_fn(clip_fn, gamma)
    with torch.no_grad():
        ok = torch.isfinite(l2_norm(x))
    # Zero the bad rows *before* the differentiable norm, so no NaN/Inf enters the graph at all
    # (masking afterwards would still back-propagate 0 * NaN into that example's gradient).
    x_safe = torch.where(_row_view(ok, x), x, torch.zeros_like(x))
    s = clip_factor(l2_norm(x_safe), bound, clip_fn, gamma)
    s = torch.where(ok, s, torch.zeros_like(s))
    return (x_safe.to(s.dtype) * _row_view(s, x)).to(x.dtype)


def clip_upstream(g: torch.Tensor, bound: float, norm: str = "l2", clip_fn: str = "clip",
                  gamma: float = 0.01) -> torch.Tensor:
    """Clipped upstream gradient ``g * t(g)`` (``norm`` 'l2' or 'l15'); not for differentiation."""
    bound = _check_bound(bound)
    _check_norm(norm)
    _check_clip_fn(clip_fn, gamma)
    with torch.no_grad():
        n = l2_norm(g) if norm == "l2" else l15_norm(g)
        t = clip_factor(n, bound, clip_fn, gamma)
        ok = _row_view(t != 0, g)
        out = g.to(t.dtype) * _row_view(t, g)
        # where, not the product alone: 0 * inf and 0 * NaN are NaN.
        return torch.where(ok, out, torch.zeros_like(out)).to(g.dtype)


def clipped_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The ``nn.Linear`` / ``nn.Conv2d`` / ``nn.Conv1d`` submodules the reference clips, as ``(name, module)``."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _LAYERS)]


def _check_conv(layer: nn.Conv2d) -> None:
    if layer.padding_mode != "zeros":
        # Reflect/replicate/circular padding can put one input entry twice into a patch, which
        # breaks ||patch|| <= ||x|| and so the l15 bound.
        raise ValueError(f"padding_mode={layer.padding_mode!r} is not supported (only 'zeros')")


def attach(model: nn.Module, *, input_clip: float, grad_clip: float, norm: str = "l15",
           clip_fn: str = "clip", gamma: float = 0.01) -> list:
    """Hook every Linear/Conv2d/Conv1d of ``model`` for backpropagation clipping; returns the handles.

    Upstream gradients use L2 for Linear and ``norm`` for Conv2d and Conv1d. Inputs must be batched.
    """
    _check_bound(input_clip, "input_clip")
    _check_bound(grad_clip, "grad_clip")
    _check_norm(norm)
    _check_clip_fn(clip_fn, gamma)
    handles = []

    def forward_pre(module, args):
        if not args or not torch.is_tensor(args[0]):
            return None
        return (clip_input(args[0], input_clip, clip_fn, gamma),) + tuple(args[1:])

    def make_backward_pre(layer_norm):
        def backward_pre(module, grad_output):
            g = grad_output[0]
            if g is None:
                return None
            # The returned grad_output replaces the original for both the parameter gradients
            # and the gradient w.r.t. the (clipped) input, as in the paper's hooks.
            return (clip_upstream(g, grad_clip, layer_norm, clip_fn, gamma),) + tuple(grad_output[1:])
        return backward_pre

    for _, m in clipped_modules(model):
        if isinstance(m, (nn.Conv2d, nn.Conv1d)):
            _check_conv(m)
            layer_norm = norm
        else:
            layer_norm = "l2"
        handles.append(m.register_forward_pre_hook(forward_pre))
        handles.append(m.register_full_backward_pre_hook(make_backward_pre(layer_norm)))
    return handles


def _pair(v) -> Tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _max_hits_1d(size: int, kernel: int, stride: int, dilation: int, pad_left: int, out: int) -> int:
    """Most (output position, kernel offset) pairs that read one input index, by enumeration."""
    hits = [0] * size
    for o in range(out):
        for k in range(kernel):
            i = o * stride - pad_left + k * dilation
            if 0 <= i < size:
                hits[i] += 1
    return max(hits) if hits else 0


def _conv_geometry_1d(size: int, kernel: int, stride: int, dilation: int, padding) -> Tuple[int, int]:
    """``(left padding, output size)`` for one spatial dim, including torch's 'same'/'valid'."""
    if padding == "valid":
        pad_left, pad_total = 0, 0
    elif padding == "same":
        # torch pads d*(k-1) in total, the odd unit on the right.
        pad_total = dilation * (kernel - 1)
        pad_left = pad_total // 2
    else:
        pad_left, pad_total = int(padding), 2 * int(padding)
    out = (size + pad_total - dilation * (kernel - 1) - 1) // stride + 1
    return pad_left, max(out, 0)


def conv_patch_multiplicity(layer: nn.Conv2d, input_shape: Sequence[int]) -> Tuple[int, int]:
    """``(m, HW_out)`` for a Conv2d on ``input_shape`` (last two dims H, W); for a Conv1d ``(m, L_out)``
    along its one dim (last of ``input_shape``).

    ``m`` is the largest number of (output position, kernel offset) pairs any single input entry
    falls in. The count for entry (i, j) is the product of the per-dimension counts, so the maximum
    is the product of the per-dimension maxima.
    """
    if isinstance(layer, nn.Conv1d):
        pad = layer.padding if isinstance(layer.padding, str) else layer.padding[0]
        left, out = _conv_geometry_1d(int(input_shape[-1]), layer.kernel_size[0], layer.stride[0],
                                      layer.dilation[0], pad)
        return _max_hits_1d(int(input_shape[-1]), layer.kernel_size[0], layer.stride[0], layer.dilation[0],
                            left, out), out
    H, W = int(input_shape[-2]), int(input_shape[-1])
    kh, kw = _pair(layer.kernel_size)
    sh, sw = _pair(layer.stride)
    dh, dw = _pair(layer.dilation)
    if isinstance(layer.padding, str):
        ph = pw = layer.padding
    else:
        ph, pw = _pair(layer.padding)
    lh, oh = _conv_geometry_1d(H, kh, sh, dh, ph)
    lw, ow = _conv_geometry_1d(W, kw, sw, dw, pw)
    m = _max_hits_1d(H, kh, sh, dh, lh, oh) * _max_hits_1d(W, kw, sw, dw, lw, ow)
    return m, oh * ow


def layer_sensitivity(layer: nn.Module, input_shape: Sequence[int], *, input_clip: float,
                      grad_clip: float, norm: str = "l15") -> float:
    """Per-example Frobenius bound on ``[grad W, grad b]`` of one clipped layer (DESIGN.md section 2).

    Linear, input ``[B, *, in]`` with ``T = prod(*)``: ``grad W = G^T X`` with ``||G||_F <= C_g``,
    ``||X||_F <= C_x`` gives ``C_g C_x``; ``grad b = sum_t g_t`` has norm ``<= sqrt(T) C_g``.
    Conv2d l15: ``||grad W[c]|| <= ||x|| sum_p |g[c,p]|`` (a patch holds distinct entries) and
    ``|grad b[c]| <= sum_p |g[c,p]|``. Conv2d l2: Cauchy-Schwarz per output channel gives
    ``||grad W||_F^2 <= ||g||^2 sum_p ||P_p(x)||^2 <= ||g||^2 m ||x||^2`` and
    ``||grad b||^2 <= HW_out ||g||^2``.
    """
    cx = _check_bound(input_clip, "input_clip")
    cg = _check_bound(grad_clip, "grad_clip")
    has_bias = 1.0 if getattr(layer, "bias", None) is not None else 0.0
    if isinstance(layer, nn.Linear):
        T = 1
        for d in tuple(input_shape)[1:-1]:
            T *= int(d)
        return cg * math.sqrt(cx * cx + T * has_bias)
    if isinstance(layer, (nn.Conv2d, nn.Conv1d)):  # Conv1d: a patch is a [C/G, k] window, the same argument
        _check_conv(layer)
        _check_norm(norm)
        if norm == "l15":
            return cg * math.sqrt(cx * cx + has_bias)
        m, hw_out = conv_patch_multiplicity(layer, input_shape)
        return cg * math.sqrt(m * cx * cx + has_bias * hw_out)
    raise TypeError(f"no sensitivity for {type(layer).__name__}; expected nn.Linear, nn.Conv2d or nn.Conv1d")


def record_input_shapes(model: nn.Module) -> Tuple[Dict[nn.Module, Tuple[int, ...]], list]:
    """Forward pre-hooks storing each Linear/Conv2d's latest input shape; returns ``(dict, handles)``."""
    shapes: Dict[nn.Module, Tuple[int, ...]] = {}

    def hook(module, args):
        if args and torch.is_tensor(args[0]):
            shapes[module] = tuple(args[0].shape)

    handles = [m.register_forward_pre_hook(hook) for _, m in clipped_modules(model)]
    return shapes, handles


def add_noise(model: nn.Module, sigma: float, *, input_clip: float, grad_clip: float,
              norm: str = "l15", input_shapes: Dict[nn.Module, Sequence[int]],
              generator: Optional[torch.Generator] = None) -> None:
    """Add ``N(0, (sigma * Delta_l)^2)`` to every coordinate of each Linear/Conv2d's weight/bias grad.

    Call once per optimizer step, after the backward pass(es). A trainable parameter with no
    gradient gets the noise alone: skipping it would reveal that the layer went unused.
    """
    sigma = float(sigma)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a non-negative finite number, got {sigma}")
    for name, layer in clipped_modules(model):
        if layer not in input_shapes:
            raise KeyError(f"no recorded input shape for layer {name!r}; run a forward pass "
                           "with record_input_shapes(model) first")
        delta = layer_sensitivity(layer, input_shapes[layer], input_clip=input_clip,
                                  grad_clip=grad_clip, norm=norm)
        std = sigma * delta
        for p in (layer.weight, layer.bias):
            if p is None or not p.requires_grad:
                continue
            gen_device = generator.device if generator is not None else p.device
            noise = torch.randn(p.shape, generator=generator, device=gen_device, dtype=p.dtype)
            noise = noise.to(p.device).mul_(std)
            if p.grad is None:
                p.grad = noise
            else:
                p.grad.add_(noise)
