"""What every clipped layer shares: the clipping configuration (:class:`_Clipped`), the autocast
rule (:func:`_in_parameter_dtype`), the base of the layers whose per-example gradients are
instantiated (:class:`_ExampleLayer`) and the converters' helpers. Each layer type's module, its
bound, its converter and its registration live in their own file of :mod:`bpclip_fast.layers`.

The backpropagation bounds (``linear.py``, ``conv2d.py``, ``conv1d.py``) hold for each of the three clip functions
(clip, global, normalize): all keep the clipped norm ``≤ C``. ``tests/test_sensitivity.py`` checks every bound against exact per-example
gradients from ``torch.func`` and its attainment.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from .. import compiled, exact, exact_examples, handles, modes
from ..amp import autocast_on
from ..boundary import StepRefused
from ..modes.base import check_positive as _check_positive

CLIP_FNS = ("clip", "global", "normalize")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _in_parameter_dtype(forward):
    """Under ``torch.autocast`` a fused layer computes in its parameters' dtype: its floating input is
    cast to it and autocast is off inside (our ops, and the ops inside our autograd functions, would
    otherwise run in autocast's dtype and hand the backward gradients of another dtype). Its kernels
    and proved bounds are then those of that dtype; the ops around the layer keep autocast's."""
    @functools.wraps(forward)
    def wrapped(self, x):
        if isinstance(x, torch.Tensor) and autocast_on(x.device.type):
            dtype = self.weight.dtype
            if x.is_floating_point() and x.dtype != dtype:
                x = x.to(dtype)
            with torch.autocast(x.device.type, enabled=False):
                return forward(self, x)
        return forward(self, x)
    return wrapped


# The clipping configuration of a clipped layer. It is stored under ``_bp_`` names because a
# generic unit (bpclip_fast.generic) is the user's own module: a CaiT/ConvNeXt layer scale holds its
# parameter as ``self.gamma``, another module a ``clipping`` flag or a ``_step`` counter, and the
# module's forward must keep reading its own. Our layer types (:class:`_Public`) also show it under
# the public names below.
CONFIG = ("clipping", "input_clip", "grad_clip", "max_grad_norm", "norm_method", "noise_bound", "clip_fn", "gamma",
          "noise_multiplier")
# What the noise of an engine-armed layer is scaled to (and the noise itself): changing it afterwards
# would clip to one bound and noise to another. The engine's adaptive thresholds go through
# _bp_set_bounds, which a forward's backward checks (_bp_bounds_version).
_FIXED = frozenset("_bp_" + name for name in CONFIG if name != "norm_method")


class _Clipped:
    """Clipping configuration, the non-finite counter and the fixed sensitivity shared by our layers
    and the generic units. Every attribute and method it adds to a module starts with ``_bp_``, or is
    one of :data:`UNIT_NAMES` (a generic unit of a module that defines one is refused by name, never
    shadowed).

    The layer's part of a training step (its noise draw, row count and gradient records) lives in
    ``self._bp_step``, a :class:`bpclip_fast.boundary.LayerStep` (``None`` until armed).
    """

    _bp_weight_layout = None  # exact.TRANSPOSED / HEIGHT_ONE: the weight is not in the Linear/Conv2d ops' layout
    _bp_fixed = _FIXED

    def _bp_init_clipping(self, input_clip, grad_clip, clip_fn, gamma, clipping="backprop", max_grad_norm=None,
                          norm_method="auto"):
        kind = type(self).__name__
        mode = modes.strategy(clipping, kind)
        self._bp_clipping = clipping
        self._bp_input_clip, self._bp_grad_clip, self._bp_max_grad_norm = mode.layer_bounds(kind, input_clip,
                                                                                             grad_clip, max_grad_norm)
        if norm_method not in exact.NORM_METHODS:
            raise ValueError(f"{kind}: norm_method must be one of {exact.NORM_METHODS}, got {norm_method!r}")
        self._bp_norm_method = norm_method
        # The C the noise is scaled to under exact clipping: per_layer's (Σ_l C_l²)^½ over the layers of
        # one model (set by convert_model), a bare layer's own max_grad_norm.
        self._bp_noise_bound = self._bp_max_grad_norm
        self._bp_flat = None  # exact.FlatClipping of a flat layer's model
        if clip_fn not in CLIP_FNS:
            raise ValueError(f"{kind}: clip_fn must be one of {CLIP_FNS}, got {clip_fn!r}")
        self._bp_clip_fn = clip_fn
        self._bp_gamma = _check_positive(gamma, "gamma", kind)
        self._bp_noise_multiplier = 0.0
        # [inputs, upstream gradients] found non-finite since the last check_finite: how many sampled
        # examples were dropped, a membership oracle. A plain attribute, not a buffer (state_dict,
        # named_buffers, DDP and EMA copies never see it), moved by _apply and zeroed in a copy.
        self._bp_nonfinite = torch.zeros(2, dtype=torch.int64, device=self._bp_param_device())
        self._bp_name = None
        self._bp_step = None       # boundary.LayerStep: this step's draw, rows and gradient records
        self._bp_max_shape = None  # per-example input shape Δ is fixed for (set_max_input_shape)
        self._bp_bounds_version = 0  # bumped by _bp_set_bounds: a backward must clip with its forward's bounds
        self._bp_handle = handles.register(self)  # the compiled ops' name for it (bpclip_fast.handles)

    def __setattr__(self, name, value):
        if name in type(self)._bp_fixed:
            step = self.__dict__.get("_bp_step")
            if step is not None and step.enforce:
                shown = name[4:] if name.startswith("_bp_") else name
                raise AttributeError(f"{self.layer_name}: {shown} is fixed by make_private (the noise is scaled to "
                                     "the clipping bounds); make a fresh model private to change it")
        super().__setattr__(name, value)

    def _bp_param_device(self):
        return self.weight.device

    def _bp_set_bounds(self, **bounds) -> None:
        """The engine's adaptive thresholds (``bpclip_fast.adaptive``), between steps: new clipping
        bounds (and the noise bound they imply). A forward run before the change cannot be
        backpropagated after it (``_bp_bounds_version``): its Δ was fixed from the old bounds."""
        for name, value in bounds.items():  # the public names (CONFIG)
            nn.Module.__setattr__(self, "_bp_" + name, _check_positive(value, name, self.layer_name))
        self._bp_bounds_version += 1

    def _bp_check_forward(self, ctx, version: int) -> None:
        """An eager backward's checks against its forward (``ctx``, its autograd context): the bounds it
        clipped with, and no earlier pass over it landed (``boundary.LayerStep.first_landing``)."""
        self._bp_check_bounds_version(version)
        if self._bp_step is not None:
            self._bp_step.first_landing(ctx)

    def _bp_check_bounds_version(self, version: int) -> None:
        """Refuses a backward whose forward ran before the bounds last changed."""
        if version != self._bp_bounds_version:
            if self._bp_step is not None:  # a step was taken since the forward: the budget may be spent
                self._bp_step.check_budget("a backward")
            details = (f"{self.layer_name}: this backward's forward ran before the clipping thresholds were adapted "
                       "at the last step, so its noise is scaled to the old bounds")
            if self._bp_step is not None:
                self._bp_step.refuse("bounds", details)
            raise RuntimeError(details + "; run the forward after optimizer.step()")

    @property
    def exact(self) -> bool:
        """Whether the layer clips each example's exact gradient (``flat``/``per_layer``)."""
        return self._bp_clipping != "backprop"

    @property
    def layer_name(self) -> str:
        return self._bp_name or type(self).__name__

    def __getstate__(self):
        # A pickled or deep-copied layer leaves its step behind: the step holds the secret noise key,
        # hooks and weak references. The copy is a bare clipped layer, and its non-finite counter is
        # zero: the live one counts the dropped examples of the data (the engine's
        # nonfinite_counts() still reads it).
        state = dict(super().__getstate__())  # the base's own (nn.LSTM drops its weak references)
        state["_bp_step"] = None
        state["_bp_nonfinite"] = torch.zeros_like(self._bp_nonfinite)
        state["_bp_handle"] = None  # process-local and random (bpclip_fast.handles): __setstate__ gives a new one
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._bp_handle = handles.register(self)  # a copy's own: the copied one names the original

    def _apply(self, fn, recurse=True):
        # The counter follows the layer across devices, as a buffer would.
        out = super()._apply(fn, recurse)
        self._bp_nonfinite = fn(self._bp_nonfinite)
        return out

    def _bp_check_input(self, x: torch.Tensor) -> torch.Tensor:
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
        step = self.__dict__.get("_bp_step")
        if step is not None and step.enforce and step.band is not None:
            # Banded noise's recursion assumes one σΔ for every row: a Δ that shrinks after a row leaves
            # that row's participation under-noised in the rows after it (bpclip_fast.banded).
            raise RuntimeError(f"{self.layer_name}: set_max_input_shape after make_private(noise='banded') would "
                               "change Δ between steps, and the correlated noise rows need one noise scale for the "
                               "whole run; pass max_input_shape to make_private on a fresh model instead")
        if any(s < 1 for s in shape):  # Δ's formulas assume a shape a layer can run on (review 43)
            raise ValueError(f"{self.layer_name}: set_max_input_shape{shape}: every dimension must be at least 1")
        delta = self.sensitivity_for((1, *shape))  # validates the shape
        if (step is not None and step.enforce and step.std_span is not None and not self.exact
                and self._bp_shape_dependent(None)):
            # make_private checked σΔ/d for every d with Δ at the shape it fixed, over the thresholds' whole
            # clamp; Δ grows with every dimension of the shape, so a shape at least as large in each keeps
            # that check (compared as shapes: Δs at the thresholds of the moment can round equal, review 42)
            checked = step.checked_shape
            if checked is not None and (len(shape) != len(checked) or any(a < b for a, b in zip(shape, checked))):
                raise ValueError(f"{self.layer_name}: set_max_input_shape{shape} after make_private: the noise "
                                 f"range was checked for Δ at max_input_shape {tuple(checked)}; a new shape must have "
                                 "its rank and be at least as large in every dimension (a smaller one would lower Δ "
                                 "below it); pass max_input_shape to make_private on a fresh model instead")
            from ..engine import noise_range

            sigma, span = step.std_span
            # A first shape (none fixed at make_private: never trained, its thresholds where they started)
            # checks both ends. Otherwise adaptive thresholds may have moved down by up to span[1] since, and
            # the high end is checked as from the top of their clamp (review 43).
            why = (noise_range.problem(self.layer_name, sigma, delta, span) if checked is None else
                   noise_range.problem(self.layer_name, sigma, delta * span[1], span, low_end=False))
            if why is not None:
                raise ValueError(f"set_max_input_shape{shape}: {why}")
        self._bp_max_shape = shape

    @property
    def max_input_shape(self):
        return self._bp_max_shape

    @property
    def sensitivity(self) -> float:
        """Δ, the bound on one example's contribution to [∇W, ∇b] (Frobenius): fixed by
        :meth:`set_max_input_shape`, or shape-free (bias-free Linear, Conv2d l15). Raises where it
        would depend on a shape not declared."""
        if self.exact:
            return self._bp_noise_bound
        if self._bp_max_shape is not None:
            return self.sensitivity_for((1, *self._bp_max_shape))
        if self._bp_shape_dependent(None):
            raise RuntimeError(
                f"{self.layer_name}: its sensitivity depends on the input shape ({self._bp_shape_rule()}), which is not "
                "known yet; call layer.set_max_input_shape(largest per-example input shape) (make_private does this "
                "from max_input_shape), or use sensitivity_for(input_shape)")
        return self.sensitivity_for(None)

    def _bp_noise_sensitivity(self, x: torch.Tensor) -> float:
        """The Δ this forward's backward scales its noise to: the fixed Δ (refusing a larger input
        in training), or the shape-free Δ. A shape-dependent Δ with no declared maximum is refused
        when noise is to be drawn, since the std would then follow the batch's shape."""
        if self.exact:
            return self._bp_noise_bound
        training = torch.is_grad_enabled()
        if training and self._bp_step is not None:  # before the shape is looked at: its refusal is charged
            self._bp_step.check_budget("a training forward")
        shape = tuple(x.shape)
        sens = self.sensitivity_for(shape)
        if self._bp_max_shape is not None:
            fixed = self.sensitivity_for((1, *self._bp_max_shape))
            if training and sens > fixed * (1 + 1e-12):
                details = (f"input shape {shape} has sensitivity {sens:.6g}, above the {fixed:.6g} fixed for "
                           f"max_input_shape {self._bp_max_shape}")
                if self._bp_step is not None:
                    self._bp_step.refuse("max-shape", details)
                raise StepRefused("max-shape", details, [self.layer_name], charged=False)
            return fixed
        if (training and self._bp_shape_dependent(shape) and self._bp_step is not None and self._bp_step.key is not None
                and self._bp_noise_multiplier > 0):
            raise RuntimeError(
                f"{self.layer_name}: its sensitivity depends on the input shape ({self._bp_shape_rule()}), so noise "
                f"scaled to this batch's shape {shape} would reveal the shape; call layer.set_max_input_shape(largest "
                "per-example input shape) first (make_private: max_input_shape=...)")
        return sens

    def _bp_clip_repr(self) -> str:
        if self.exact:
            return f"clipping={self._bp_clipping!r}, max_grad_norm={self._bp_max_grad_norm:g}, clip_fn={self._bp_clip_fn!r}"
        return f"input_clip={self._bp_input_clip:g}, grad_clip={self._bp_grad_clip:g}, clip_fn={self._bp_clip_fn!r}"


def _config_property(name: str) -> property:
    attr = "_bp_" + name
    return property(lambda self: getattr(self, attr), lambda self, value: setattr(self, attr, value),
                    doc=f"The layer's {name} (kept as ``{attr}``, :data:`CONFIG`).")


class _Public:
    """The clipping configuration under its public names (:data:`CONFIG`), on our own layer types;
    a generic unit has none: its names are the user's. A conv layer's ``norm`` is fixed as well."""

    _bp_fixed = _FIXED | {"norm"}


for _name in CONFIG:
    setattr(_Public, _name, _config_property(_name))


class _ExactOnly:
    """A clipped layer with exact modes only: its noise bound is ``C`` whatever the input's shape."""

    def _bp_shape_dependent(self, input_shape) -> bool:
        return False

    def sensitivity_for(self, input_shape=None) -> float:
        """The noise bound ``C`` (exact clipping: each example's gradient is clipped to it)."""
        return self._bp_noise_bound


class _ExampleLayer(_Public, _ExactOnly, _Clipped):
    """A layer whose per-example gradients are small enough to instantiate (affine parameters of a
    normalisation, an embedding table's rows, an added parameter), clipped exactly by
    :func:`bpclip_fast.exact_examples.example_layer`; its bound is :class:`bpclip_fast.examples.DenseExamples`'.
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
        self._bp_init_clipping(None, None, clip_fn, gamma, clipping, max_grad_norm)

    @_in_parameter_dtype
    def forward(self, x):
        x = self._bp_check_input(x)
        if torch.compiler.is_compiling():  # opaque ops, no Python read per step (compiled.py)
            return compiled.example_layer(self, x)
        return exact_examples.example_layer(self, x, self._bp_noise_sensitivity(x))

    def extra_repr(self):
        return f"{super().extra_repr()}, {self._bp_clip_repr()}"


def _exact_kwargs(clipping: dict) -> dict:
    """The converters' keywords for a layer of the exact modes only (no norm_method: its per-example
    gradients are instantiated, there is no ghost/instantiation choice)."""
    return {k: v for k, v in clipping.items() if k in ("clipping", "max_grad_norm", "clip_fn", "gamma")}


def _sqrt_numel(layer, x) -> float:
    return math.sqrt(x.numel())


def _sqrt_batch(layer, x) -> float:
    return math.sqrt(x.shape[0]) if x.dim() else 1.0
