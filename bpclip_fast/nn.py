"""Drop-in clipped layers (re-exported from :mod:`bpclip_fast.layers`, one file per layer type:
its module, bound, converter and registration), noise arming, the per-step finiteness check and
model conversion.

The clipped types keep their public names here: ``bpclip_fast.nn.Linear`` etc. are the classes of
:mod:`bpclip_fast.layers`, so code, checkpoints and pickles that name them through this module
(pickles made before the layers moved store ``bpclip_fast.nn.<Class>``) keep working.
"""

from __future__ import annotations

import secrets

import torch
from torch import nn

from . import generic, modes, registry
from .boundary import LayerStep
from .layers import (CLIP_FNS, CONV_NORMS, SUPPORTED_DTYPES, ClassToken, Conv1d, Conv2d, Conv3d,  # noqa: F401
                     Embedding, EmbeddingBag,
                     GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, LayerNorm, Linear,
                     PositionalEmbedding, RMSNorm)
from .layers.base import _Clipped, _ExampleLayer, _check_positive, _exact_kwargs, _in_parameter_dtype  # noqa: F401
from .layers.embedding import _embedding_problem  # noqa: F401

def __getattr__(name):
    """``Conv1D``: the clipped Hugging Face Conv1D, imported on first use (it needs transformers)."""
    if name == "Conv1D":
        from .layers.hf_conv1d import Conv1D
        return Conv1D
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_LAYER_BITS = 19  # offset = step << 20 | layer << 1 | (0: weight, 1: bias)
_MAX_LAYERS = 1 << _LAYER_BITS
_MAX_STEPS = 1 << (63 - _LAYER_BITS - 1)


class NonFiniteError(RuntimeError):
    """Raised by :func:`check_finite`; ``counts`` maps layer name to (inputs, upstream gradients)."""

    def __init__(self, message: str, counts: dict):
        super().__init__(message)
        self.counts = counts


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


def set_noise_multiplier(module: nn.Module, noise_multiplier: float) -> None:
    """Every clipped layer's noise multiplier (its draw's std is ``noise_multiplier·Δ``), for training
    without the engine. A generic unit's too: a unit is the user's module and shows none of our
    settings under public names, so ``layer.noise_multiplier = σ`` would make an attribute of the
    module and leave the unit unnoised (:func:`arm_noise` refuses that). Fixed after
    ``make_private``, as the layers' public names are."""
    sigma = float(noise_multiplier)
    if not 0.0 <= sigma < float("inf"):
        raise ValueError(f"set_noise_multiplier: noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
    for _, layer in clipped_layers(module):
        layer._bp_noise_multiplier = sigma


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
        return self.offset_at(self.step, layer_index)

    def offset_at(self, step: int, layer_index: int) -> int:
        """The counters of layer ``layer_index``'s draw at ``step`` (correlated noise keys its rows by
        the batch index, ``bpclip_fast.banded``)."""
        if not 0 <= step < _MAX_STEPS:
            raise RuntimeError("NoiseStream: step counter exhausted; start a new stream")
        return (int(step) << (_LAYER_BITS + 1)) | (layer_index << 1)

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
        if layer._bp_step is not None and layer._bp_step.enforce:
            raise RuntimeError(f"arm_noise: {name} belongs to a PrivacyEngine, which arms its layers itself")
        if "noise_multiplier" in layer.__dict__ and not layer.__dict__.get("_bp_own_sigma", True):
            # A generic unit is the user's module and reads no public names of ours: the loop's
            # layer.noise_multiplier = σ made an attribute of the module and left the unit unnoised.
            raise ValueError(f"arm_noise: {name} is a generic unit (the user's module, trained by the generic exact "
                             "path), whose noise multiplier is not its attribute noise_multiplier, which was set "
                             "on it after convert_model; set every layer's with bnn.set_noise_multiplier(model, σ)")
        if layer._bp_step is None:
            layer._bp_step = LayerStep(layer, name, enforce=False)
        layer._bp_name = name
        layer._bp_step.arm((stream.seed, stream.offset(index)))
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
        by_device.setdefault(layer._bp_nonfinite.device, []).append((name, layer))
    bad = {}
    for group in by_device.values():
        counts = torch.stack([layer._bp_nonfinite for _, layer in group]).cpu()
        for (name, layer), (n_in, n_grad) in zip(group, counts.tolist()):
            if n_in or n_grad:
                bad[name] = (n_in, n_grad)
                layer._bp_nonfinite.zero_()
    if bad:
        lines = [f"  {name}: {n_in} input(s), {n_grad} upstream gradient(s)" for name, (n_in, n_grad) in bad.items()]
        raise NonFiniteError(
            "bpclip_fast: non-finite values (NaN/Inf, or a norm that overflowed) reached these layers; the "
            "examples concerned were dropped (clip factor 0):\n" + "\n".join(lines) +
            "\nCheck the data and the loss (e.g. log of 0), or lower the learning rate.", bad)


def _convert_generic(module: nn.Module, **clipping) -> nn.Module:
    """A generic unit (:mod:`bpclip_fast.generic`): the module itself, its class swapped in place (its
    attributes, parameters, hooks and state_dict keys stay), or returned as it is if it is one."""
    if registry.is_generic(module):
        return module
    module.__class__ = generic.generic_class(type(module))
    module._bp_init_generic(**_exact_kwargs(clipping))
    return module


def _convert(layer: nn.Module, **clipping) -> nn.Module:
    if registry.layer_type(layer) is None:
        return _convert_generic(layer, **clipping)
    new = registry.layer_type(layer).convert(layer, **clipping)
    # The same Parameter objects: an optimizer built before the conversion keeps working.
    new.weight = layer.weight
    if getattr(layer, "bias", None) is not None:
        new.bias = layer.bias
    new._bp_nonfinite = torch.zeros(2, dtype=torch.int64, device=layer.weight.device)
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
    if mode.exact:  # registry.Composite (nn.MultiheadAttention): in place, its parameters into registered layers
        for _, m, entry in registry.composites(model):
            entry.unpack(m)
    kw = dict(clip_fn=clip_fn, gamma=gamma, clipping=clipping,
              **mode.conversion_settings(input_clip=input_clip, grad_clip=grad_clip, norm=norm, norm_method=norm_method))
    units = {id(u) for _, u in registry.generic_units(model)} if mode.exact else set()
    if registry.convertible(model) or id(model) in units:
        name = type(model).__name__  # before a generic unit's class is swapped in place
        new = _convert(model, **kw, max_grad_norm=mode.layer_thresholds(max_grad_norm, 1)[0])
        new._bp_name = name
        if mode.collects:  # a bare layer's noise bound is its own C already; flat's collector it needs
            mode.settle(new, [new], new._bp_max_grad_norm, clip_fn, gamma)
        return new
    inside = registry.inside_units(model) if units else set()
    # _modules, not named_children(): that yields a module held twice by one parent only once, and the
    # second name would keep the unconverted layer
    children = [(name, m, child_name, child) for name, m in list(model.named_modules()) if id(m) not in inside
                for child_name, child in list(m._modules.items()) if child is not None]

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
        mode.settle(model, new_layers, new_layers[0]._bp_max_grad_norm, clip_fn, gamma)
    return model
