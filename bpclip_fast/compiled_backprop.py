"""``torch.compile`` of backpropagation clipping's layers (Linear, Conv2d, Conv1d): the forward and
backward as opaque custom ops whose Python runs at run time, as :mod:`bpclip_fast.compiled` does for
the exact modes (its module docstring: what becomes a guard, what is read at run time, the marks)."""

from __future__ import annotations

import torch

from . import exact, handles
from .compiled import _NOT_IN_CUDA_GRAPHS, _ForwardMark, _forward_meta, _refuse_recomputation, _seal

# The eager path (bpclip_fast.autograd) reads the layer's bounds and Δ in the forward; here the forward
# op reads them at run time and returns what the backward needs of them (the bounds' version and Δ of
# this forward) as a CPU float64 tensor, so nothing that moves between steps becomes a guard.

@torch.library.custom_op("bpclip_fast_compiled::backprop_forward", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def backprop_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int,
                     padding: list[int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, x_factor, x_norm, meta)``: the clipped layer's forward (the extension's op, which also
    counts non-finite inputs in the layer's own counter); ``meta = [bounds' version, Δ, origin]``
    (:func:`_forward_meta`)."""
    lay = handles.lookup(layer, torch.nn.Module, "layer")
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        # Eager backprop layers save past the hooks (autograd._apply_without_hooks); here the compiled
        # graph's own Function saves x and the factor through them, and the backward rebuilds the
        # clipped input from what the unpack returns: an unpack scaling x broke the bound (review 17).
        raise RuntimeError(
            f"{lay.layer_name}: a compiled model with backpropagation clipping cannot run inside "
            "torch.autograd.graph.saved_tensors_hooks (save_on_cpu, a custom pack/unpack): the backward "
            "rebuilds the clipped input from the saved input, which the hooks may change; run the compiled "
            "model outside the hooks, run it eagerly, or use clipping='flat' or 'per_layer'")
    # its budget check and max-shape refusal, as the eager forward's, on the shape of the layer's own
    # input (nn.Conv1d: x is the kernels' view of it, exact.HEIGHT_ONE)
    own = lay._bp_layer_input(x) if lay._bp_weight_layout == exact.HEIGHT_ONE else x
    sens = lay._bp_noise_sensitivity(own)
    meta = _forward_meta(lay, [float(lay._bp_bounds_version), float(sens)], torch.float64)
    weight = exact.kernel_weight(lay, weight)
    if padding is None:
        out, factor, norm = torch.ops.bpclip_fast.linear_forward(
            x, weight, bias, lay._bp_nonfinite[0:1], float(lay._bp_input_clip), lay._bp_clip_fn, float(lay._bp_gamma))
    else:
        out, factor, norm = torch.ops.bpclip_fast.conv2d_forward(
            x, weight, bias, lay._bp_nonfinite[0:1], *exact.kernel_geometry(lay, padding), lay.groups,
            float(lay._bp_input_clip), lay._bp_clip_fn, float(lay._bp_gamma))
    return out, factor, norm, meta


@backprop_forward.register_fake
def _(x, weight, bias, layer, padding):
    lay = handles.lookup(layer, torch.nn.Module, "layer")
    nonfinite = torch.empty(1, dtype=torch.int64, device=x.device)
    weight = exact.kernel_weight(lay, weight)
    if padding is None:
        out, factor, norm = torch.ops.bpclip_fast.linear_forward(x, weight, bias, nonfinite, 1.0, lay._bp_clip_fn, 0.01)
    else:
        out, factor, norm = torch.ops.bpclip_fast.conv2d_forward(x, weight, bias, nonfinite,
                                                                 *exact.kernel_geometry(lay, padding), lay.groups,
                                                                 1.0, lay._bp_clip_fn, 0.01)
    return out, factor, norm, torch.empty(3, dtype=torch.float64, device="cpu")


@torch.library.custom_op("bpclip_fast_compiled::backprop_backward", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def backprop_backward(grad_out: torch.Tensor, x: torch.Tensor, factor: torch.Tensor, norm: torch.Tensor,
                      weight: torch.Tensor, meta: torch.Tensor, layer: int, mask: list[bool],
                      padding: list[int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``autograd._backward`` at run time; ``mask``: [input, weight, bias] gradients wanted."""
    from . import autograd

    lay = handles.lookup(layer, torch.nn.Module, "layer")
    version, sens, origin = meta.tolist()
    ctx = _BackpropCtx(lay, sens, int(version), mask, padding, meta, origin)
    ctx.saved_tensors = (x, factor, norm, weight)
    if padding is None:
        gx, gw, gb = autograd._backward(ctx, grad_out, torch.ops.bpclip_fast.linear_backward)
    else:
        geometry = (*exact.kernel_geometry(lay, padding), lay.groups, lay.norm)
        gx, gw, gb = autograd._backward(ctx, grad_out, torch.ops.bpclip_fast.conv2d_backward, *geometry)
    _seal(lay)
    return tuple(t if t is not None else weight.new_empty(0) for t in (gx, gw, gb))


class _BackpropCtx(_ForwardMark):
    """What ``autograd._backward`` reads of an autograd context, rebuilt from the ops' arguments;
    the forward's mark on ``meta`` (:class:`_ForwardMark`)."""

    __slots__ = ("layer", "sensitivity", "bounds_version", "needs_input_grad", "has_bias", "padding",
                 "saved_tensors")

    def __init__(self, layer, sensitivity, version, mask, padding, meta, origin):
        super().__init__(meta, origin)
        self.layer, self.sensitivity, self.bounds_version = layer, sensitivity, version
        self.needs_input_grad = (mask[0], mask[1], mask[2])
        self.has_bias = layer.bias is not None
        self.padding = padding
        self.saved_tensors = None


@backprop_backward.register_fake
def _(grad_out, x, factor, norm, weight, meta, layer, mask, padding):
    gx = torch.empty_like(x, memory_format=torch.contiguous_format) if mask[0] else x.new_empty(0)
    # the parameter's layout (autograd._backward maps an nn.Conv1d's release back to it)
    gw = torch.empty_like(weight, memory_format=torch.contiguous_format) if mask[1] else weight.new_empty(0)
    gb = weight.new_empty(weight.shape[0]) if mask[2] else weight.new_empty(0)
    return gx, gw, gb


def _backprop_setup(ctx, inputs, output):
    x, weight, bias, layer, padding = inputs
    _, factor, norm, meta = output
    ctx.save_for_backward(x, factor, norm, weight, meta)
    ctx.args = (layer, padding)
    ctx.has_bias = bias is not None


def _backprop_backward(ctx, grad_out, *_):
    x, factor, norm, weight, meta = ctx.saved_tensors
    layer, padding = ctx.args
    need = ctx.needs_input_grad
    mask = [need[0], need[1], need[2] and ctx.has_bias]
    gx, gw, gb = backprop_backward(grad_out, x, factor, norm, weight, meta, layer, mask, padding)
    return gx if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None, None, None


backprop_forward.register_autograd(_backprop_backward, setup_context=_backprop_setup)


def backprop_layer(x, layer, padding=None):
    """The compiled counterpart of ``autograd.clipped_linear`` / ``clipped_conv2d``."""
    _refuse_recomputation()
    return backprop_forward(x, layer.weight, layer.bias, layer._bp_handle,
                            list(padding) if padding is not None else None)[0]
