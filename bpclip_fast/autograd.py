"""Autograd Functions of the clipped layers: each forward and backward is one op of the extension.

The layer object passed in supplies the bounds; its step state (``layer._bp_step``, a
:class:`bpclip_fast.boundary.LayerStep`) supplies the noise draw, the mean-loss scaling and the row
count of each backward, and learns which gradient tensors the backward returned.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import _ops, exact
from .graph_nodes import forward_origin, untraced
from .amp import autocast_off

_C_AUTOGRAD = torch._C._autograd  # the saved-tensor hook stack's private controls


class _ClippedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, sensitivity):
        out, factor, norm = torch.ops.bpclip_fast.linear_forward(
            x, weight, bias, layer._bp_nonfinite[0:1], float(layer._bp_input_clip), layer._bp_clip_fn, float(layer._bp_gamma))
        ctx.save_for_backward(x, factor, norm, weight)  # x, not x̃: see reclip in csrc/layers.cpp
        ctx.layer, ctx.sensitivity, ctx.has_bias = layer, sensitivity, bias is not None
        ctx.bounds_version, ctx._bp_origin = layer._bp_bounds_version, forward_origin()
        return out

    @staticmethod
    @untraced  # graph_nodes.untraced: the engine's calls never run under dynamo
    @once_differentiable  # double backward (create_graph) raises instead of silently dropping a term
    def backward(ctx, grad_out):
        return (*_backward(ctx, grad_out, torch.ops.bpclip_fast.linear_backward), None, None)


class _ClippedConv2d(torch.autograd.Function):
    """Conv2d, and nn.Conv1d as a Conv2d of height 1: ``weight`` is the parameter itself, in its own
    layout (so its AccumulateGrad receives the very tensor ``_outputs`` records); the ops get
    ``exact.kernel_weight``'s view of it and the release is mapped back in ``_backward``."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, sensitivity, padding):
        stride, pad, dilation = exact.kernel_geometry(layer, padding)
        out, factor, norm = torch.ops.bpclip_fast.conv2d_forward(
            x, exact.kernel_weight(layer, weight), bias, layer._bp_nonfinite[0:1], stride, pad, dilation,
            layer.groups, float(layer._bp_input_clip), layer._bp_clip_fn, float(layer._bp_gamma))
        ctx.save_for_backward(x, factor, norm, weight)  # x, not x̃: see reclip in csrc/layers.cpp
        ctx.layer, ctx.sensitivity, ctx.has_bias, ctx.padding = layer, sensitivity, bias is not None, padding
        ctx.bounds_version, ctx._bp_origin = layer._bp_bounds_version, forward_origin()
        return out

    @staticmethod
    @untraced  # graph_nodes.untraced: the engine's calls never run under dynamo
    @once_differentiable  # double backward (create_graph) raises instead of silently dropping a term
    def backward(ctx, grad_out):
        layer = ctx.layer
        geometry = (*exact.kernel_geometry(layer, ctx.padding), layer.groups, layer.norm)
        return (*_backward(ctx, grad_out, torch.ops.bpclip_fast.conv2d_backward, *geometry), None, None, None)


@autocast_off
def _backward(ctx, grad_out, op, *geometry):
    """``(grad_x, grad_weight, grad_bias)`` from a layer's backward op: the forward's saved tensors,
    the layer's own arguments (``geometry``: Conv2d's) and the arguments both ops end with."""
    ctx.layer._bp_check_forward(ctx, ctx.bounds_version)  # before the saved tensors: their own check is less clear
    x, factor, norm, weight = ctx.saved_tensors
    args, scale = _backward_args(ctx, grad_out.shape[0])
    _count_unclipped(ctx.layer, norm, grad_out, args[0])
    gx, gw, gb = op(grad_out, x, factor, norm, exact.kernel_weight(ctx.layer, weight), ctx.layer._bp_nonfinite[1:2],
                    *geometry, *args, scale)
    # the release in the parameter's layout before _outputs records it: the tensor its AccumulateGrad gets
    gw, gb = _outputs(ctx.layer, ctx, exact._param_layout(ctx.layer, gw, weight), gb)
    return gx if ctx.needs_input_grad[0] else None, gw, gb


def _backward_args(ctx, rows):
    """``(bounds, clip_fn, gamma, output_mask, noise_key, noise_std)``, the arguments both backward
    ops end with before the mean-loss ``scale`` of this backward (csrc/bpclip_fast.cpp), and that scale."""
    layer = ctx.layer
    seed, offset, std, d, scale = _step_args(layer, rows, ctx.sensitivity)
    args = ([float(layer._bp_input_clip), float(layer._bp_grad_clip) / d], layer._bp_clip_fn, float(layer._bp_gamma) / d,
            [ctx.needs_input_grad[0], ctx.has_bias], [seed, offset], std)
    return args, scale


def _count_unclipped(layer, input_norm, grad_out, bounds):
    """Adaptive thresholds (``bpclip_fast.adaptive``): the examples of this backward whose input and
    upstream gradient norms are within ``bounds = (C_x, C_g/d)``, the norms the kernels clip (L2;
    Conv2d's gradient in the layer's ``norm``)."""
    step = layer._bp_step
    if step is None or not step.counting:
        return
    from .reference import l2_norm, l15_norm

    g_norm = l15_norm(grad_out) if getattr(layer, "norm", "l2") == "l15" else l2_norm(grad_out)
    step.count(torch.stack([(input_norm <= bounds[0]).sum(), (g_norm <= bounds[1]).sum()]))


def _step_args(layer, rows, sensitivity):
    """``(seed, offset, std, d, scale)`` of this backward (``boundary.LayerStep.begin_backward``);
    no noise and no scaling for a layer that was never armed."""
    if layer._bp_step is None:
        return 0, 0, 0.0, 1.0, 1.0
    return layer._bp_step.begin_backward(rows, sensitivity)


def _outputs(layer, ctx, gw, gb):
    """The (weight, bias) gradients to return (the op applied the engine's mean-loss scale after the
    noise, in the noise's launch), ``None`` where not needed; the step state records them."""
    gw = gw if ctx.needs_input_grad[1] else None
    gb = gb if ctx.has_bias and ctx.needs_input_grad[2] else None
    if layer._bp_step is not None:
        layer._bp_step.produced((gw, gb))
    return gw, gb


_HOOKS_INSIDE = (
    "bpclip_fast: saved_tensors_hooks were entered inside a backpropagation-clipping layer's autograd "
    "Function (code run by its forward, such as a tensor subclass's __torch_function__): they would pack "
    "the input its backward clips; enter the hooks around the model's call instead, or pass a plain tensor")


def _apply_without_hooks(fn, *args):
    """``fn(*args)`` (one of these Functions' ``apply``) with the loop's ``saved_tensors_hooks`` (every
    level of their stack) set aside, so that what it saves is packed by no hook and unpacked as saved.
    Why: the backward rebuilds the clipped input ``x̃ = RZ(s·x)`` from the saved ``x`` and the
    forward's factor ``s`` (``reclip``, csrc/layers.cpp), and the bound ``‖x̃‖ ≤ C_x`` holds only for the
    ``x`` that ``s`` was computed from: an unpack hook returning ``1000·x`` moved a release 14× past
    its ``2BΔ`` (review 17). The exact modes need no such care: their backward computes every norm
    from the tensors it unpacks. The cost: ``save_on_cpu`` and activation checkpointing do not offload
    or drop these layers' saved inputs. While the Function runs, the hooks are also disabled: code
    running inside it (a tensor subclass's ``__torch_function__`` on the extension's op) pushed a
    hook that then packed the saved ``x``, and its unpack scaled the clipped input 2500× (review 18);
    now that push raises."""
    hooks = _pop_saved_tensor_hooks()
    prev = _C_AUTOGRAD._saved_tensors_hooks_get_disabled_error_message()
    try:  # torch.autograd.graph.disable_saved_tensors_hooks' calls, without its generator per layer call
        _C_AUTOGRAD._saved_tensors_hooks_disable(_HOOKS_INSIDE)
        return fn(*args)
    finally:
        if prev is None:
            _C_AUTOGRAD._saved_tensors_hooks_enable()
        else:
            _C_AUTOGRAD._saved_tensors_hooks_disable(prev)
        _push_saved_tensor_hooks(hooks)


def _pop_saved_tensor_hooks():
    """Every level of the thread's ``saved_tensors_hooks`` stack, popped: ``[(pack, unpack)]``, top first."""
    hooks = []
    top = _C_AUTOGRAD._top_saved_tensors_default_hooks(False)
    while top is not None:
        _C_AUTOGRAD._pop_saved_tensors_default_hooks()
        hooks.append(top)
        top = _C_AUTOGRAD._top_saved_tensors_default_hooks(False)
    return hooks


def _push_saved_tensor_hooks(hooks):
    """The levels :func:`_pop_saved_tensor_hooks` returned, pushed back in their order."""
    for pack, unpack in reversed(hooks):
        _C_AUTOGRAD._push_saved_tensors_default_hooks(pack, unpack)


def clipped_linear(x, weight, bias, layer, sensitivity):
    _ops.require_extension()
    return _apply_without_hooks(_ClippedLinear.apply, x, weight, bias, layer, sensitivity)


def clipped_conv2d(x, weight, bias, layer, sensitivity, padding):
    _ops.require_extension()
    return _apply_without_hooks(_ClippedConv2d.apply, x, weight, bias, layer, sensitivity, padding)
