"""Drop-in clipped layers, noise arming, the per-step finiteness check and model conversion.

Sensitivity bounds
------------------
Every clipped layer bounds the Frobenius norm of one example's contribution to ``[∇W, ∇b]``. With
clipped input ``x̃`` (``‖x̃‖₂ ≤ C_x`` over all non-batch dims) and clipped upstream gradient ``g̃``:

*Linear*, input ``[B, *, in]`` with ``T`` positions in ``*`` (T = 1 for 2-D input),
``‖g̃‖₂ ≤ C_g`` over all non-batch dims. ``∇W = Σ_t g̃_t x̃_tᵀ`` so, by the triangle and
Cauchy–Schwarz inequalities, ``‖∇W‖ ≤ Σ_t ‖g̃_t‖‖x̃_t‖ ≤ ‖g̃‖‖x̃‖ ≤ C_g C_x``; ``∇b = Σ_t g̃_t`` so
``‖∇b‖ ≤ √T ‖g̃‖ ≤ √T C_g``. Hence ``Δ = C_g √(C_x² + T·[bias])``. Attained: all ``x̃_t`` equal
(norm ``C_x/√T``) and all ``g̃_t`` equal (norm ``C_g/√T``, one direction).

*Conv2d, norm l15* (``l15(g̃) = √(Σ_c (Σ_hw |g̃_chw|)²) ≤ C_g``), zero padding, any stride,
dilation and groups. Row ``c`` of ``[∇W, ∇b]`` is ``Σ_hw g̃_chw [P_hw(x̃); 1]`` where the patch
``P_hw(x̃)`` holds distinct entries of ``x̃`` (of one channel group) or zeros, so
``‖[P_hw; 1]‖ ≤ √(C_x² + [bias])`` and the triangle inequality gives
``‖row_c‖ ≤ Σ_hw |g̃_chw| √(C_x² + [bias])``; summing squares over ``c``:
``Δ = C_g √(C_x² + [bias])``. Attained when the output is 1×1 (the kernel covers the input).
Other padding modes can repeat an entry inside a patch, so they are refused.

*Conv2d, norm l2* (``‖g̃‖₂ ≤ C_g``). Per group ``j``, ``∇W_j = G_j P_jᵀ`` with ``P_j`` the
im2col matrix (a column per output position); ``‖G_j P_jᵀ‖_F ≤ ‖G_j‖_F ‖P_j‖₂`` and
``‖[P_j; 1ᵀ]‖₂² ≤ ‖P_j‖_F² + HW_out = Σ_e mult(e) x̃_e² + HW_out ≤ m‖x̃_j‖² + HW_out`` where
``mult(e)`` counts the (output position, kernel offset) pairs that read entry ``e`` and ``m`` is
its maximum. Summing over groups, ``Δ = C_g √(m C_x² + [bias]·HW_out)``.

The three clip functions (clip, global, normalize) all keep the clipped norm ``≤ C``, so the
bounds hold for each. ``tests/test_sensitivity.py`` checks every bound against exact per-example
gradients from ``torch.func`` and its attainment.
"""

from __future__ import annotations

import functools
import math
import secrets

import torch
import torch.nn.functional as F
from torch import nn

from . import autograd, compiled, exact, examples, generic, modes, modules, registry
from .boundary import LayerStep, StepRefused
from .modes.base import check_positive as _check_positive

CLIP_FNS = ("clip", "global", "normalize")
CONV_NORMS = ("l15", "l2")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

_LAYER_BITS = 19  # offset = step << 20 | layer << 1 | (0: weight, 1: bias)
_MAX_LAYERS = 1 << _LAYER_BITS
_MAX_STEPS = 1 << (63 - _LAYER_BITS - 1)


class NonFiniteError(RuntimeError):
    """Raised by :func:`check_finite`; ``counts`` maps layer name to (inputs, upstream gradients)."""

    def __init__(self, message: str, counts: dict):
        super().__init__(message)
        self.counts = counts


def _in_parameter_dtype(forward):
    """Under ``torch.autocast`` a fused layer computes in its parameters' dtype: its floating input is
    cast to it and autocast is off inside (our ops, and the ops inside our autograd functions, would
    otherwise run in autocast's dtype and hand the backward gradients of another dtype). Its kernels
    and proved bounds are then those of that dtype; the ops around the layer keep autocast's."""
    @functools.wraps(forward)
    def wrapped(self, x):
        if (isinstance(x, torch.Tensor) and torch.amp.is_autocast_available(x.device.type)
                and torch.is_autocast_enabled(x.device.type)):
            dtype = self.weight.dtype
            if x.is_floating_point() and x.dtype != dtype:
                x = x.to(dtype)
            with torch.autocast(x.device.type, enabled=False):
                return forward(self, x)
        return forward(self, x)
    return wrapped


class _Clipped:
    """Clipping configuration, the non-finite counter and the fixed sensitivity shared by our layers.

    The layer's part of a training step (its noise draw, row count and gradient records) lives in
    ``self._step``, a :class:`bpclip_fast.boundary.LayerStep` (``None`` until armed).
    """

    def _init_clipping(self, input_clip, grad_clip, clip_fn, gamma, clipping="backprop", max_grad_norm=None,
                       norm_method="auto"):
        kind = type(self).__name__
        mode = modes.strategy(clipping, kind)
        self.clipping = clipping
        self.input_clip, self.grad_clip, self.max_grad_norm = mode.layer_bounds(kind, input_clip, grad_clip,
                                                                                max_grad_norm)
        if norm_method not in exact.NORM_METHODS:
            raise ValueError(f"{kind}: norm_method must be one of {exact.NORM_METHODS}, got {norm_method!r}")
        self.norm_method = norm_method
        # The C the noise is scaled to under exact clipping: per_layer's (Σ_l C_l²)^½ over the layers of
        # one model (set by convert_model), a bare layer's own max_grad_norm.
        self.noise_bound = self.max_grad_norm
        self._flat = None  # exact.FlatClipping of a flat layer's model
        if clip_fn not in CLIP_FNS:
            raise ValueError(f"{kind}: clip_fn must be one of {CLIP_FNS}, got {clip_fn!r}")
        self.clip_fn = clip_fn
        self.gamma = _check_positive(gamma, "gamma", kind)
        self.noise_multiplier = 0.0
        # [inputs, upstream gradients] found non-finite since the last check_finite: how many sampled
        # examples were dropped, a membership oracle. A plain attribute, not a buffer (state_dict,
        # named_buffers, DDP and EMA copies never see it), moved by _apply and zeroed in a copy.
        self._nonfinite = torch.zeros(2, dtype=torch.int64, device=self._param_device())
        self._bp_name = None
        self._step = None       # boundary.LayerStep: this step's draw, rows and gradient records
        self._max_shape = None  # per-example input shape Δ is fixed for (set_max_input_shape)
        self._bounds_version = 0  # bumped by _set_bounds: a backward must clip with its forward's bounds

    # What the noise of an engine-armed layer is scaled to (and the noise itself): changing it afterwards
    # would clip to one bound and noise to another. The engine's adaptive thresholds go through
    # _set_bounds, which a forward's backward checks (_bounds_version).
    _FIXED_BY_ENGINE = ("clipping", "max_grad_norm", "noise_bound", "input_clip", "grad_clip", "clip_fn", "gamma",
                        "norm", "noise_multiplier")

    def __setattr__(self, name, value):
        if name in _Clipped._FIXED_BY_ENGINE:
            step = self.__dict__.get("_step")
            if step is not None and step.enforce:
                raise AttributeError(f"{self.layer_name}: {name} is fixed by make_private (the noise is scaled to the "
                                     "clipping bounds); make a fresh model private to change it")
        super().__setattr__(name, value)

    def _param_device(self):
        return self.weight.device

    def _set_bounds(self, **bounds) -> None:
        """The engine's adaptive thresholds (``bpclip_fast.adaptive``), between steps: new clipping
        bounds (and the noise bound they imply). A forward run before the change cannot be
        backpropagated after it (``_bounds_version``): its Δ was fixed from the old bounds."""
        for name, value in bounds.items():
            nn.Module.__setattr__(self, name, _check_positive(value, name, self.layer_name))
        self._bounds_version += 1

    def _check_bounds_version(self, version: int) -> None:
        """Refuses a backward whose forward ran before the bounds last changed."""
        if version != self._bounds_version:
            if self._step is not None:  # a step was taken since the forward: the budget may be spent
                self._step.check_budget("a backward")
            details = (f"{self.layer_name}: this backward's forward ran before the clipping thresholds were adapted "
                       "at the last step, so its noise is scaled to the old bounds")
            if self._step is not None:
                self._step.refuse("bounds", details)
            raise RuntimeError(details + "; run the forward after optimizer.step()")

    @property
    def exact(self) -> bool:
        """Whether the layer clips each example's exact gradient (``flat``/``per_layer``)."""
        return self.clipping != "backprop"

    @property
    def layer_name(self) -> str:
        return self._bp_name or type(self).__name__

    def __getstate__(self):
        # A pickled or deep-copied layer leaves its step behind: the step holds the secret noise key,
        # hooks and weak references. The copy is a bare clipped layer, and its non-finite counter is
        # zero: the live one counts the dropped examples of the data (the engine's
        # nonfinite_counts() still reads it).
        state = dict(super().__getstate__())  # the base's own (nn.LSTM drops its weak references)
        state["_step"] = None
        state["_nonfinite"] = torch.zeros_like(self._nonfinite)
        return state

    def _apply(self, fn, recurse=True):
        # The counter follows the layer across devices, as a buffer would.
        out = super()._apply(fn, recurse)
        self._nonfinite = fn(self._nonfinite)
        return out

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x``, checked (the subclasses' checks return it too)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.layer_name}: expected a tensor input, got {type(x).__name__}")
        weight = self.weight  # once: each read is a Module.__getattr__ call
        if x.device != weight.device:
            raise ValueError(f"{self.layer_name}: the input is on {x.device} but the layer's parameters are on "
                             f"{weight.device}; move the input or the model (.to(device)) so they match")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{self.layer_name}: unsupported input dtype {x.dtype}; bpclip_fast layers take float32, "
                            "float16, bfloat16 (or float64)")
        if x.dtype != weight.dtype:
            raise TypeError(f"{self.layer_name}: the input is {x.dtype} but the layer's parameters are {weight.dtype}; "
                            "cast one of them (x.to(dtype) or model.to(dtype))")
        return x

    # ------------------------------------------------------------------ a data-independent Δ
    def set_max_input_shape(self, shape) -> None:
        """Fixes Δ to its value for per-example input ``shape`` (without the batch dim), the largest
        this layer will be trained on. Needed where Δ depends on the shape (a biased Linear over
        ``[B, *, in]``, Conv2d with norm ``l2``): a Δ taken from each batch's shape would make the
        noise std depend on the data (padding to the longest sampled example). Training forwards
        whose Δ would be larger are then refused."""
        shape = tuple(int(s) for s in shape)
        self.sensitivity_for((1, *shape))  # validates the shape
        self._max_shape = shape

    @property
    def max_input_shape(self):
        return self._max_shape

    @property
    def sensitivity(self) -> float:
        """Δ, the bound on one example's contribution to [∇W, ∇b] (Frobenius): fixed by
        :meth:`set_max_input_shape`, or shape-free (bias-free Linear, Conv2d l15). Raises where it
        would depend on a shape not declared."""
        if self.exact:
            return self.noise_bound
        if self._max_shape is not None:
            return self.sensitivity_for((1, *self._max_shape))
        if self._shape_dependent(None):
            raise RuntimeError(
                f"{self.layer_name}: its sensitivity depends on the input shape ({self._shape_rule()}), which is not "
                "known yet; call layer.set_max_input_shape(largest per-example input shape) (make_private does this "
                "from max_input_shape), or use sensitivity_for(input_shape)")
        return self.sensitivity_for(None)

    def _noise_sensitivity(self, x: torch.Tensor) -> float:
        """The Δ this forward's backward scales its noise to: the fixed Δ (refusing a larger input
        in training), or the shape-free Δ. A shape-dependent Δ with no declared maximum is refused
        when noise is to be drawn, since the std would then follow the batch's shape."""
        if self.exact:
            return self.noise_bound
        training = torch.is_grad_enabled()
        if training and self._step is not None:  # before the shape is looked at: its refusal is charged
            self._step.check_budget("a training forward")
        shape = tuple(x.shape)
        sens = self.sensitivity_for(shape)
        if self._max_shape is not None:
            fixed = self.sensitivity_for((1, *self._max_shape))
            if training and sens > fixed * (1 + 1e-12):
                details = (f"input shape {shape} has sensitivity {sens:.6g}, above the {fixed:.6g} fixed for "
                           f"max_input_shape {self._max_shape}")
                if self._step is not None:
                    self._step.refuse("max-shape", details)
                raise StepRefused("max-shape", details, [self.layer_name], charged=False)
            return fixed
        if (training and self._shape_dependent(shape) and self._step is not None and self._step.key is not None
                and self.noise_multiplier > 0):
            raise RuntimeError(
                f"{self.layer_name}: its sensitivity depends on the input shape ({self._shape_rule()}), so noise "
                f"scaled to this batch's shape {shape} would reveal the shape; call layer.set_max_input_shape(largest "
                "per-example input shape) first (make_private: max_input_shape=...)")
        return sens

    def _clip_repr(self) -> str:
        if self.exact:
            return f"clipping={self.clipping!r}, max_grad_norm={self.max_grad_norm:g}, clip_fn={self.clip_fn!r}"
        return f"input_clip={self.input_clip:g}, grad_clip={self.grad_clip:g}, clip_fn={self.clip_fn!r}"


class Linear(_Clipped, nn.Linear):
    """``nn.Linear`` whose inputs and upstream gradients are clipped per example (L2 norms).

    Input ``[B, *, in_features]``; each example's norm is taken over all its non-batch dims.
    """

    def __init__(self, in_features, out_features, bias=True, *, input_clip=None, grad_clip=None, clip_fn="clip",
                 gamma=0.01, clipping="backprop", max_grad_norm=None, norm_method="auto", device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_clipping(input_clip, grad_clip, clip_fn, gamma, clipping, max_grad_norm, norm_method)

    def _shape_dependent(self, input_shape) -> bool:
        return not self.exact and self.bias is not None and (input_shape is None or len(input_shape) > 2)

    def _shape_rule(self) -> str:
        return "a biased Linear's Δ grows with the positions T of a [B, T, in] input"

    def sensitivity_for(self, input_shape=None) -> float:
        """``C_g √(C_x² + T·[bias])``, T the positions between batch and feature dims (module docstring);
        the noise bound ``C`` under exact clipping."""
        if self.exact:
            return self.noise_bound
        tokens = 1 if input_shape is None else math.prod(input_shape[1:-1])
        bias = 1 if self.bias is not None else 0
        return self.grad_clip * math.sqrt(self.input_clip ** 2 + tokens * bias)

    @_in_parameter_dtype
    def forward(self, x):
        x = self._check_input(x)
        if x.dim() < 2:
            raise ValueError(f"{self.layer_name}: the input needs a batch dimension, [B, *, {self.in_features}]; "
                             f"got shape {tuple(x.shape)}")
        if torch.compiler.is_compiling():  # opaque ops, no Python read per step (compiled.py)
            return compiled.exact_layer(x, self) if self.exact else compiled.backprop_layer(x, self)
        sens = self._noise_sensitivity(x)
        if self.exact:
            return exact.exact_layer(x, self, sens)
        return autograd.clipped_linear(x, self.weight, self.bias, self, sens)

    def extra_repr(self):
        return f"{super().extra_repr()}, {self._clip_repr()}"


@functools.lru_cache(maxsize=256)
def _max_patch_multiplicity(size: int, out: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """The most (output position, kernel offset) pairs that read one input position, along one dim."""
    counts = [0] * size
    for o in range(out):
        for k in range(kernel):
            i = o * stride - padding + k * dilation
            if 0 <= i < size:
                counts[i] += 1
    return max(counts, default=0)


class Conv2d(_Clipped, nn.Conv2d):
    """``nn.Conv2d`` whose inputs (L2) and upstream gradients (``norm``: l15 or l2) are clipped per example.

    Zero padding only: other padding modes can repeat an input entry inside one patch, which the
    l15 bound does not allow for.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, *, input_clip=None, grad_clip=None, norm="l15", clip_fn="clip", gamma=0.01,
                 padding_mode="zeros", clipping="backprop", max_grad_norm=None, norm_method="auto", device=None,
                 dtype=None):
        if padding_mode != "zeros":
            raise ValueError(f"Conv2d: padding_mode={padding_mode!r} is not supported: only 'zeros' keeps every "
                             "input entry at most once in a patch, which the sensitivity bound needs")
        if norm not in CONV_NORMS:
            raise ValueError(f"Conv2d: norm must be one of {CONV_NORMS}, got {norm!r}")
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                         groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype)
        self.norm = norm
        self._init_clipping(input_clip, grad_clip, clip_fn, gamma, clipping, max_grad_norm, norm_method)
        self._explicit_padding = self._resolve_padding()

    def _resolve_padding(self):
        if not isinstance(self.padding, str):
            return tuple(self.padding)
        if self.padding == "valid":
            return (0, 0)
        pads = []
        for k, d in zip(self.kernel_size, self.dilation):
            total = d * (k - 1)
            if total % 2:
                raise ValueError(f"Conv2d: padding='same' with kernel {self.kernel_size} and dilation "
                                 f"{self.dilation} needs asymmetric padding; pass explicit padding instead")
            pads.append(total // 2)
        return tuple(pads)

    def _out_hw(self, h, w):
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel_size, self.stride, self._explicit_padding, self.dilation
        return (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1

    def _shape_dependent(self, input_shape) -> bool:
        return not self.exact and self.norm == "l2"

    def _shape_rule(self) -> str:
        return "with norm='l2' Δ grows with the input's height and width"

    def sensitivity_for(self, input_shape=None) -> float:
        """l15: ``C_g √(C_x² + [bias])``; l2: ``C_g √(m C_x² + [bias]·HW_out)`` (module docstring); the
        noise bound ``C`` under exact clipping."""
        if self.exact:
            return self.noise_bound
        bias = 1 if self.bias is not None else 0
        if self.norm == "l15":
            return self.grad_clip * math.sqrt(self.input_clip ** 2 + bias)
        if input_shape is None:
            raise RuntimeError(f"{self.layer_name}: with norm='l2' the sensitivity depends on the input's height "
                               "and width; call sensitivity_for(input_shape) or run a forward pass first")
        h, w = input_shape[-2], input_shape[-1]
        oh, ow = self._out_hw(h, w)
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel_size, self.stride, self._explicit_padding, self.dilation
        m = _max_patch_multiplicity(h, oh, kh, sh, ph, dh) * _max_patch_multiplicity(w, ow, kw, sw, pw, dw)
        return self.grad_clip * math.sqrt(m * self.input_clip ** 2 + bias * oh * ow)

    @_in_parameter_dtype
    def forward(self, x):
        x = self._check_input(x)
        if x.dim() != 4:
            raise ValueError(f"{self.layer_name}: the input must be [B, C, H, W]; got shape {tuple(x.shape)}")
        if self.exact:
            geometry = (list(self.stride), list(self._explicit_padding), list(self.dilation), self.groups)
            if torch.compiler.is_compiling():  # opaque ops, no Python read per step (compiled.py)
                return compiled.exact_layer(x, self, geometry)
            return exact.exact_layer(x, self, self._noise_sensitivity(x), geometry)
        if torch.compiler.is_compiling():
            return compiled.backprop_layer(x, self, self._explicit_padding)
        sens = self._noise_sensitivity(x)
        return autograd.clipped_conv2d(x, self.weight, self.bias, self, sens, self._explicit_padding)

    def extra_repr(self):
        norm = "" if self.exact else f", norm={self.norm!r}"
        return f"{super().extra_repr()}{norm}, {self._clip_repr()}"


class _ExampleLayer(_Clipped):
    """A layer whose per-example gradients are small enough to instantiate (affine parameters of a
    normalisation, an embedding table's rows, an added parameter), clipped exactly by
    :func:`bpclip_fast.exact.example_layer`; its bound is :class:`bpclip_fast.examples.DenseExamples`'.
    Exact modes only: backpropagation clipping has no proved bound for these types."""

    def _init_exact(self, clipping, max_grad_norm, clip_fn, gamma):
        kind = type(self).__name__
        if getattr(self, "weight", None) is None:
            raise ValueError(f"{kind}: without affine parameters there is nothing to clip; use torch's "
                             f"nn.{kind} for it")
        if not modes.strategy(clipping, kind).exact:
            raise ValueError(f"{kind}: clipping='backprop' has no proved bound for a {kind}'s parameters; use "
                             "clipping='flat' or 'per_layer' (exact per-example clipping: make_private(..., "
                             f"clipping='flat')), or freeze the {kind} (requires_grad_(False))")
        self._init_clipping(None, None, clip_fn, gamma, clipping, max_grad_norm)

    def _shape_dependent(self, input_shape) -> bool:
        return False

    def sensitivity_for(self, input_shape=None) -> float:
        """The noise bound ``C`` (exact clipping: each example's gradient is clipped to it)."""
        return self.noise_bound

    @_in_parameter_dtype
    def forward(self, x):
        x = self._check_input(x)
        if torch.compiler.is_compiling():  # opaque ops, no Python read per step (compiled.py)
            return compiled.example_layer(self, x)
        return exact.example_layer(self, x, self._noise_sensitivity(x))

    def extra_repr(self):
        return f"{super().extra_repr()}, {self._clip_repr()}"


class LayerNorm(_ExampleLayer, nn.LayerNorm):
    """``nn.LayerNorm`` (affine) under exact per-example clipping (``flat``/``per_layer``). Example
    ``i``'s gradients are ``Σ_t g_t ⊙ x̂_t`` and ``Σ_t g_t`` over its positions ``t``."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, *, clipping="backprop",
                 max_grad_norm=None, clip_fn="clip", gamma=0.01, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias, device=device,
                         dtype=dtype)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _check_input(self, x):
        x = super()._check_input(x)
        k = len(self.normalized_shape)
        if x.dim() <= k or tuple(x.shape[-k:]) != tuple(self.normalized_shape):
            raise ValueError(f"{self.layer_name}: the input must be [B, *, {', '.join(map(str, self.normalized_shape))}] "
                             f"(a batch dimension, then the normalized shape); got {tuple(x.shape)}")
        return x

    def _forward(self, x, weight, bias, keep):
        if not keep:
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps), ()
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, list(self.normalized_shape), weight, bias, self.eps)
        return out, (x, mean, rstd)

    def _examples(self, saved, g, mask):
        x, mean, rstd = saved
        return examples.DenseExamples(*examples.affine_example_grads(g, x, mean, rstd, 1, True, self.weight.shape,
                                                               self.bias is not None), self.weight.dtype)


class GroupNorm(_ExampleLayer, nn.GroupNorm):
    """``nn.GroupNorm`` (affine) under exact per-example clipping. Example ``i``'s gradients are
    ``Σ_s g_{c,s} x̂_{c,s}`` and ``Σ_s g_{c,s}`` per channel ``c`` over its positions ``s``."""

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, *, clipping="backprop", max_grad_norm=None,
                 clip_fn="clip", gamma=0.01, device=None, dtype=None):
        super().__init__(num_groups, num_channels, eps=eps, affine=affine, device=device, dtype=dtype)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _check_input(self, x):
        x = super()._check_input(x)
        if x.dim() < 2 or x.shape[1] != self.num_channels:
            raise ValueError(f"{self.layer_name}: the input must be [B, {self.num_channels}, *]; got {tuple(x.shape)}")
        return x

    def _forward(self, x, weight, bias, keep):
        if not keep:
            return F.group_norm(x, self.num_groups, weight, bias, self.eps), ()
        n, c = x.shape[:2]
        out, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, n, c, math.prod(x.shape[2:]),
                                                           self.num_groups, self.eps)
        return out, (x, mean, rstd)

    def _examples(self, saved, g, mask):
        x, mean, rstd = saved
        return examples.DenseExamples(*examples.affine_example_grads(g, x, mean, rstd, self.num_groups, False,
                                                               self.weight.shape, self.bias is not None),
                                   self.weight.dtype)


class Embedding(_ExampleLayer, nn.Embedding):
    """``nn.Embedding`` under exact per-example clipping, with per-example norms through index
    equality (:class:`bpclip_fast.examples.RowExamples`; no per-example copy of the table). Refused:
    ``max_norm`` (the forward rewrites table rows outside the step), ``scale_grad_by_freq`` (a
    token's gradient is divided by its count in the whole batch, so examples move each other) and
    ``sparse`` gradients."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, sparse=False, _weight=None, _freeze=False, *, clipping="backprop",
                 max_grad_norm=None, clip_fn="clip", gamma=0.01, device=None, dtype=None):
        reason = _embedding_problem(max_norm, scale_grad_by_freq, sparse)
        if reason:
            raise ValueError(f"Embedding: {reason}")
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, _weight=_weight, _freeze=_freeze,
                         device=device, dtype=dtype)
        self.register_parameter("bias", None)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _check_input(self, x):
        name = self.layer_name
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name}: expected an int64/int32 tensor of indices, got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.device != self.weight.device:
            raise ValueError(f"{name}: the input is on {x.device} but the layer's parameters are on "
                             f"{self.weight.device}; move the input or the model (.to(device)) so they match")
        if x.dim() < 1:
            raise ValueError(f"{name}: the input needs a batch dimension, [B, *]; got a scalar")
        return x

    def _forward(self, x, weight, bias, keep):
        return F.embedding(x, weight, self.padding_idx), ((x,) if keep else ())

    def _examples(self, saved, g, mask):
        (idx,) = saved
        b, v, dim = idx.shape[0], self.num_embeddings, self.embedding_dim
        idx = idx.reshape(b, math.prod(idx.shape[1:])).long()  # not -1: an empty batch has b = 0
        positions = idx.shape[1]
        keys = torch.arange(b, device=idx.device).unsqueeze(1) * v + idx
        rows = g.reshape(b * positions, dim)
        if self.padding_idx is not None:  # torch gives the padding row no gradient
            keep = (idx != self.padding_idx).reshape(-1)
            keys, rows = keys.reshape(-1)[keep], rows[keep]
        keys, inverse = torch.unique(keys.reshape(-1), return_inverse=True)
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        summed = rows.new_zeros(keys.shape[0], dim, dtype=acc).index_add_(0, inverse, rows.to(acc))
        return examples.RowExamples(summed, keys // v, keys % v, b, positions, v, self.weight.dtype)


def _embedding_problem(max_norm, scale_grad_by_freq, sparse) -> str | None:
    if max_norm is not None:
        return ("max_norm rewrites the rows an example reads during its forward, outside the private step; "
                "use max_norm=None")
    if scale_grad_by_freq:
        return ("scale_grad_by_freq divides each token's gradient by its count in the whole batch, so one example "
                "changes another's gradient; use scale_grad_by_freq=False")
    if sparse:
        return "sparse gradients are not supported; use sparse=False"
    return None


class PositionalEmbedding(_ExampleLayer, modules.PositionalEmbedding):
    """:class:`bpclip_fast.modules.PositionalEmbedding` under exact per-example clipping: example
    ``i``'s gradient is its upstream gradient."""

    def __init__(self, *shape, clipping="backprop", max_grad_norm=None, clip_fn="clip", gamma=0.01, device=None,
                 dtype=None):
        super().__init__(*shape, device=device, dtype=dtype)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _check_input(self, x):
        x = super()._check_input(x)
        self._check_shape(x)
        return x

    def _forward(self, x, weight, bias, keep):
        return x + weight, ()

    def _examples(self, saved, g, mask):
        return examples.DenseExamples(g, None, self.weight.dtype)


class ClassToken(_ExampleLayer, modules.ClassToken):
    """:class:`bpclip_fast.modules.ClassToken` under exact per-example clipping: example ``i``'s
    gradient is its upstream gradient at the prepended positions."""

    def __init__(self, dim, tokens=1, *, clipping="backprop", max_grad_norm=None, clip_fn="clip", gamma=0.01,
                 device=None, dtype=None):
        super().__init__(dim, tokens, device=device, dtype=dtype)
        self._init_exact(clipping, max_grad_norm, clip_fn, gamma)

    def _check_input(self, x):
        x = super()._check_input(x)
        self._check_shape(x)
        return x

    def _forward(self, x, weight, bias, keep):
        return torch.cat([weight.expand(x.shape[0], -1, -1), x], dim=1), ()

    def _examples(self, saved, g, mask):
        return examples.DenseExamples(g[:, :self.weight.shape[0]].contiguous(), None, self.weight.dtype)


class TemperedSigmoid(nn.Module):
    """``s·sigmoid(T·x) − o`` (Papernot et al. 2021); the default (2, 2, 1) is tanh."""

    def __init__(self, s: float = 2.0, T: float = 2.0, o: float = 1.0):
        super().__init__()
        self.s, self.T, self.o = float(s), float(T), float(o)

    def forward(self, x):
        return self.s * torch.sigmoid(self.T * x) - self.o

    def extra_repr(self):
        return f"s={self.s:g}, T={self.T:g}, o={self.o:g}"


def clipped_layers(module: nn.Module):
    """``[(qualified name, layer)]`` of every clipped layer in ``module``, in ``named_modules`` order:
    every module that runs a clipped backward (subclasses included, so that none goes unarmed;
    which of them may be *trained* is the registry's rule, ``registry.is_clipped``)."""
    return [(name or type(m).__name__, m) for name, m in module.named_modules() if isinstance(m, _Clipped)]


class NoiseStream:
    """The (seed, step) that key the Philox noise of a model.

    With ``seed=None`` the seed comes from the operating system's entropy (``secrets``). An explicit
    seed makes runs reproducible but is insecure: whoever knows it can subtract the noise.
    """

    def __init__(self, seed: int | None = None):
        self.secure = seed is None
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"NoiseStream: seed must be in [0, 2**63), got {seed}")
        self.step = 0

    def offset(self, layer_index: int) -> int:
        if not 0 <= layer_index < _MAX_LAYERS - 1:  # the last index draws the adaptive counts' noise
            raise ValueError(f"NoiseStream: at most {_MAX_LAYERS - 1} clipped layers are supported")
        return self._offset(layer_index)

    def count_offset(self) -> int:
        """Counters of this step's noise on the adaptive thresholds' counts (``bpclip_fast.adaptive``)."""
        return self._offset(_MAX_LAYERS - 1)

    def _offset(self, layer_index: int) -> int:
        if self.step >= _MAX_STEPS:
            raise RuntimeError("NoiseStream: step counter exhausted; start a new stream")
        return (self.step << (_LAYER_BITS + 1)) | (layer_index << 1)

    def __repr__(self):
        return f"NoiseStream(step={self.step}, secure={self.secure})"


def arm_noise(module: nn.Module, stream: NoiseStream | None = None) -> NoiseStream:
    """Arms every clipped layer so that its next backward adds N(0, (noise_multiplier·Δ)²) once.

    Each call is one step of ``stream`` (created on first use and kept on ``module``): layer ``l``
    of step ``t`` draws from Philox counters (t, l, element), so no two draws ever share numbers.
    This is the bare-layer protocol: nothing else is checked. :class:`bpclip_fast.PrivacyEngine`
    arms its layers itself and verifies every step (``bpclip_fast.boundary``).
    """
    if stream is None:
        stream = getattr(module, "_bpclip_noise_stream", None)
        if stream is None:
            stream = NoiseStream()
            module._bpclip_noise_stream = stream
    layers = clipped_layers(module)
    if not layers:
        raise ValueError(f"arm_noise: {type(module).__name__} has no bpclip_fast layers; "
                         "use bpclip_fast.nn.convert_model first")
    for index, (name, layer) in enumerate(layers):
        if layer._step is not None and layer._step.enforce:
            raise RuntimeError(f"arm_noise: {name} belongs to a PrivacyEngine, which arms its layers itself")
        if layer._step is None:
            layer._step = LayerStep(layer, name, enforce=False)
        layer._bp_name = name
        layer._step.arm((stream.seed, stream.offset(index)))
    stream.step += 1
    return stream


def check_finite(module: nn.Module) -> None:
    """Raises :class:`NonFiniteError` if any clipped layer met a non-finite example since the last call.

    Such examples were given clip factor 0 (they contributed nothing, so the bounds held); the counts
    are read with one device sync and reset.
    """
    layers = clipped_layers(module)
    if not layers:
        return
    by_device: dict = {}
    for name, layer in layers:
        by_device.setdefault(layer._nonfinite.device, []).append((name, layer))
    bad = {}
    for group in by_device.values():
        counts = torch.stack([layer._nonfinite for _, layer in group]).cpu()
        for (name, layer), (n_in, n_grad) in zip(group, counts.tolist()):
            if n_in or n_grad:
                bad[name] = (n_in, n_grad)
                layer._nonfinite.zero_()
    if bad:
        lines = [f"  {name}: {n_in} input(s), {n_grad} upstream gradient(s)" for name, (n_in, n_grad) in bad.items()]
        raise NonFiniteError(
            "bpclip_fast: non-finite values (NaN/Inf, or a norm that overflowed) reached these layers; the "
            "examples concerned were dropped (clip factor 0):\n" + "\n".join(lines) +
            "\nCheck the data and the loss (e.g. log of 0), or lower the learning rate.", bad)


def _convert_linear(layer: nn.Linear, **clipping) -> Linear:
    clipping.pop("norm", None)
    return Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta",
                  dtype=layer.weight.dtype, **clipping)


def _convert_conv2d(layer: nn.Conv2d, **clipping) -> Conv2d:
    return Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                  padding=layer.padding, dilation=layer.dilation, groups=layer.groups, bias=layer.bias is not None,
                  device="meta", dtype=layer.weight.dtype, **clipping)


def _exact_kwargs(clipping: dict) -> dict:
    """The converters' keywords for a layer of the exact modes only (no norm_method: its per-example
    gradients are instantiated, there is no ghost/instantiation choice)."""
    return {k: v for k, v in clipping.items() if k in ("clipping", "max_grad_norm", "clip_fn", "gamma")}


def _convert_layer_norm(layer: nn.LayerNorm, **clipping) -> LayerNorm:
    return LayerNorm(layer.normalized_shape, eps=layer.eps, bias=layer.bias is not None, device="meta",
                     dtype=layer.weight.dtype, **_exact_kwargs(clipping))


def _convert_group_norm(layer: nn.GroupNorm, **clipping) -> GroupNorm:
    return GroupNorm(layer.num_groups, layer.num_channels, eps=layer.eps, device="meta", dtype=layer.weight.dtype,
                     **_exact_kwargs(clipping))


def _convert_embedding(layer: nn.Embedding, **clipping) -> Embedding:
    return Embedding(layer.num_embeddings, layer.embedding_dim, padding_idx=layer.padding_idx, device="meta",
                     dtype=layer.weight.dtype, **_exact_kwargs(clipping))


def _convert_positional(layer: modules.PositionalEmbedding, **clipping) -> PositionalEmbedding:
    return PositionalEmbedding(*layer.weight.shape, device="meta", dtype=layer.weight.dtype,
                               **_exact_kwargs(clipping))


def _convert_class_token(layer: modules.ClassToken, **clipping) -> ClassToken:
    return ClassToken(layer.weight.shape[1], layer.weight.shape[0], device="meta", dtype=layer.weight.dtype,
                      **_exact_kwargs(clipping))


def _sqrt_numel(layer, x) -> float:
    return math.sqrt(x.numel())


def _sqrt_batch(layer, x) -> float:
    return math.sqrt(x.shape[0]) if x.dim() else 1.0


_EXACT = modes.EXACT
registry.register_layer(nn.LayerNorm, LayerNorm, convert=_convert_layer_norm, modes=_EXACT, multiplier_norm=_sqrt_numel,
                        plain=lambda layer, x, p: F.layer_norm(x, layer.normalized_shape, p.get("weight"), p.get("bias"),
                                                               layer.eps))
registry.register_layer(nn.GroupNorm, GroupNorm, convert=_convert_group_norm, modes=_EXACT, multiplier_norm=_sqrt_numel,
                        plain=lambda layer, x, p: F.group_norm(x, layer.num_groups, p.get("weight"), p.get("bias"),
                                                               layer.eps))
registry.register_layer(nn.Embedding, Embedding, convert=_convert_embedding, modes=_EXACT, multiplier_norm=_sqrt_numel,
                        plain=lambda layer, x, p: F.embedding(x, p["weight"], layer.padding_idx))
registry.register_layer(modules.PositionalEmbedding, PositionalEmbedding, convert=_convert_positional, modes=_EXACT,
                        multiplier_norm=_sqrt_batch, plain=lambda layer, x, p: x + p["weight"])
registry.register_layer(modules.ClassToken, ClassToken, convert=_convert_class_token, modes=_EXACT,
                        multiplier_norm=_sqrt_batch,
                        plain=lambda layer, x, p: torch.cat([p["weight"].expand(x.shape[0], -1, -1), x], dim=1))


@registry.register_module_check(nn.Embedding)
def _embedding_options(module):
    return _embedding_problem(module.max_norm, module.scale_grad_by_freq, module.sparse)


registry.register_layer(nn.Linear, Linear, convert=_convert_linear,
                        plain=lambda layer, x, p: F.linear(x, p["weight"], p.get("bias")))
registry.register_layer(nn.Conv2d, Conv2d, convert=_convert_conv2d,
                        plain=lambda layer, x, p: nn.Conv2d._conv_forward(layer, x, p["weight"], p.get("bias")),
                        taps=lambda layer: layer.weight[0, 0].numel())


def _convert_generic(module: nn.Module, **clipping) -> nn.Module:
    """A generic unit (:mod:`bpclip_fast.generic`): the module itself, its class swapped in place (its
    attributes, parameters, hooks and state_dict keys stay), or returned as it is if it is one."""
    if registry.is_generic(module):
        return module
    module.__class__ = generic.generic_class(type(module))
    module._init_generic(**_exact_kwargs(clipping))
    return module


def _convert(layer: nn.Module, **clipping) -> nn.Module:
    if registry.layer_type(layer) is None:
        return _convert_generic(layer, **clipping)
    new = registry.layer_type(layer).convert(layer, **clipping)
    # The same Parameter objects: an optimizer built before the conversion keeps working.
    new.weight = layer.weight
    if getattr(layer, "bias", None) is not None:
        new.bias = layer.bias
    new._nonfinite = torch.zeros(2, dtype=torch.int64, device=layer.weight.device)
    new.train(layer.training)
    return new


def convert_model(model: nn.Module, *, input_clip=None, grad_clip=None, norm="l15", clip_fn="clip", gamma=0.01,
                  clipping="backprop", max_grad_norm=None, norm_method="auto") -> nn.Module:
    """Swaps every trainable layer of a registered type (``nn.Linear``, ``nn.Conv2d``; for the exact
    modes also ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.Embedding`` and :mod:`bpclip_fast.modules`'
    ``PositionalEmbedding``/``ClassToken``, which ``"backprop"`` refuses) of ``model`` for ours, in
    place, weights kept.

    ``clipping="backprop"`` (input_clip, grad_clip, norm) or exact per-example clipping:
    ``"per_layer"`` (``max_grad_norm`` a list of ``C_l``, or ``C`` split as ``C/√L``; each layer's noise
    is scaled to ``C = (Σ C_l²)^½``) or ``"flat"`` (``max_grad_norm`` = ``C`` of the whole gradient;
    the model gets its :class:`bpclip_fast.exact.FlatClipping`, so it must be called as a whole).

    Refuses (before changing anything) every module the registry's checks report
    (:func:`bpclip_fast.registry.module_problems`: batch statistics, padding modes other than zeros,
    trainable parameters outside the registered layer types). Frozen layers are left as they are.
    Returns ``model`` (a bare layer of a registered type is returned converted).
    """
    problems = registry.module_problems(model)
    if problems:
        raise ValueError("convert_model: these layers cannot be trained with bpclip_fast:\n  "
                         + "\n  ".join(problems))
    mode = modes.strategy(clipping, "convert_model")
    unbounded = registry.mode_problems(model, clipping)
    if unbounded:
        raise ValueError("convert_model: these layers cannot be trained with clipping=" f"{clipping!r}:\n  "
                         + "\n  ".join(unbounded))
    kw = dict(clip_fn=clip_fn, gamma=gamma, clipping=clipping,
              **mode.conversion_settings(input_clip=input_clip, grad_clip=grad_clip, norm=norm, norm_method=norm_method))
    units = {id(u) for _, u in registry.generic_units(model)} if mode.exact else set()
    if registry.convertible(model) or id(model) in units:
        name = type(model).__name__  # before a generic unit's class is swapped in place
        new = _convert(model, **kw, max_grad_norm=mode.layer_thresholds(max_grad_norm, 1)[0])
        new._bp_name = name
        if mode.collects:  # a bare layer's noise bound is its own C already; flat's collector it needs
            mode.settle(new, [new], new.max_grad_norm, clip_fn, gamma)
        return new
    inside = registry.inside_units(model) if units else set()
    children = [(name, m, child_name, child) for name, m in list(model.named_modules()) if id(m) not in inside
                for child_name, child in list(m.named_children())]

    def target(child):
        return id(child) in units or (registry.convertible(child) and id(child) not in inside)

    count = len({id(c) for _, _, _, c in children if target(c)})
    thresholds = iter(mode.layer_thresholds(max_grad_norm, count))
    converted = {}  # a layer under two parents becomes one clipped layer, not two sharing parameters
    for name, m, child_name, child in children:
        if id(child) not in converted and target(child):
            converted[id(child)] = _convert(child, **kw, max_grad_norm=next(thresholds))
            converted[id(child)]._bp_name = f"{name}.{child_name}" if name else child_name
        if id(child) in converted:
            setattr(m, child_name, converted[id(child)])
    new_layers = list(converted.values())
    if new_layers:
        mode.settle(model, new_layers, new_layers[0].max_grad_norm, clip_fn, gamma)
    return model
