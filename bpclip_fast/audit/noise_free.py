"""The release with noise off: :class:`NoiseFree`, a copy of a private model (float64 by default) whose clipped layers
release a batch's gradient with no noise drawn, in bound units, each pass from one state of the torch generators
(:class:`_Generators`); and the units the releases are checked in (:func:`_units`, :func:`_delta`, :func:`_norms`).

Apart from the sensitivity audit because two audits measure through it: the sensitivity audit (:mod:`.contribution`)
and the empirical audit's canaries (:mod:`.empirical`, whose function ``noise_free(model)`` builds its copy).
"Module docstring" below means :mod:`.contribution`'s (units, arithmetic and tolerance, training mode), where the
measurement is derived.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import nn as bnn
from ..boundary import LayerStep
from .sensitivity_args import _copy


class _Generators:
    """The torch generators a forward can draw from: the CPU's and the model's CUDA device's."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.index = (device.index if device.index is not None else torch.cuda.current_device()) if self.cuda else None

    def fork(self):
        """A context that restores the caller's states on exit (``torch.random.fork_rng``)."""
        return torch.random.fork_rng(devices=[self.index] if self.cuda else [])

    def state(self):
        return torch.get_rng_state(), (torch.cuda.get_rng_state(self.index) if self.cuda else None)

    def set(self, state):
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state(state[1], self.index)

    @staticmethod
    def same(a, b) -> bool:
        return all((s is None and t is None) or torch.equal(s, t) for s, t in zip(a, b))


class NoiseFree:
    """A float64 (or ``dtype``) copy of a private model whose releases are measured, noise off (module
    docstring: arithmetic and units). Also the empirical audit's measure of its canaries.
    ``training=False``: eval mode; the sensitivity audit passes ``True`` and calls :meth:`settle`."""

    def __init__(self, inner, mode, reduction, mean_batch, loss_fn, dtype, training=False):
        self.model = _copy(inner)
        if dtype is not None:
            self.model.to(dtype)
        self.model.train(training)
        self.generators = None  # set by settle(): every release starts from this state of the generators
        self.layers = [layer for _, layer in bnn.clipped_layers(self.model)]
        self.names = [name for name, _ in bnn.clipped_layers(inner)]
        self.mode, self.loss_fn = mode, loss_fn
        self.unit = mean_batch or 1.0  # release -> bound units
        for name, layer in zip(self.names, self.layers):
            layer._bp_noise_multiplier = 0.0
            layer._bp_step = LayerStep(layer, name, enforce=False, mean_loss_batch=mean_batch)  # key None: no draw
        for p in self.model.parameters():
            p.grad = None
        if mode == "flat":
            self._check_flat()
        self._positions = positions = [1]

        def record(module, args, out):  # a closure, not a bound method: copies of the model stay apart
            if isinstance(out, torch.Tensor) and out.dim() > 1 and out.shape[0] > 0:
                features = out.shape[1] if isinstance(module, (nn.Conv2d, nn.GroupNorm)) else out.shape[-1]
                positions[0] = max(positions[0], out[0].numel() // max(features, 1))

        for layer in self.layers:
            layer.register_forward_hook(record)

    def _check_flat(self):
        groups = {id(layer._bp_flat): layer._bp_flat for layer in self.layers if layer._bp_flat is not None}
        mine = {id(m) for m in self.layers}
        hooked = {id(getattr(h, "__self__", None)) for m in self.model.modules() for h in m._forward_pre_hooks.values()}
        if (len(groups) != 1 or any(layer._bp_flat is None for layer in self.layers)
                or any(id(m) not in mine for g in groups.values() for m in g.layers) or set(groups) - hooked):
            raise RuntimeError("sensitivity: flat clipping's book-keeping did not survive the copy of model (its "
                               "layers would clip without the other layers' norms); audit a model made private "
                               "as a whole by PrivacyEngine.make_private or convert_model")

    @property
    def positions(self) -> int:
        """An upper bound on the positions one example adds to a gradient coordinate (module docstring)."""
        return self._positions[0]

    @property
    def dtype(self) -> torch.dtype:
        return layer_params(self.layers[0])[0][1].dtype

    def trainable(self, layer):
        return [p for _, p in layer_params(layer) if p is not None and p.requires_grad]

    def settle(self, x, y) -> tuple[str, str | None]:
        """Training mode with every release starting from one state of the generators; dropout off,
        or eval mode, where a training forward still draws random numbers (module docstring:
        training mode). Returns ``(how the copy runs, a note or None)``. Call inside
        :meth:`_Generators.fork`; :func:`_audit` checks the determinism that is left."""
        if not self.model.training:
            return "eval", None
        gen = _Generators(self.layers[0]._bp_param_device())
        self.generators, self._start = gen, gen.state()

        def draws_random_numbers():
            self.release(x, y)
            return not gen.same(gen.state(), self._start)

        if not draws_random_numbers():
            return "train", None
        # Dropout masks cannot be kept per example across batches of different sizes; dropout acts on
        # each entry alone, so turning it off hides no mixing.
        for m in self.model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.eval()
        if not draws_random_numbers():
            return "train, dropout off", ("the copies ran in training mode with dropout off (removing an example "
                                          "would shift the other examples' dropout masks)")
        self.model.eval()
        return "eval", ("the copies ran in eval mode: the training forward draws random numbers besides dropout's, "
                        "which removal cannot keep for the other examples; mixing that happens only in training "
                        "mode is not tested")

    def follow(self, other) -> None:
        """Runs in the modes of ``other`` (a copy of the same model in another dtype), each release from
        its generator state."""
        for mine, theirs in zip(self.model.modules(), other.model.modules()):
            mine.training = theirs.training
        self.generators, self._start = other.generators, getattr(other, "_start", None)

    def release(self, x, y):
        """Per layer, the flattened ``[∇W, ∇b]`` of the batch ``(x, y)`` in bound units (float64), noise
        off unless the layers were armed (:func:`_noise`)."""
        for p in self.model.parameters():
            p.grad = None
        if self.generators is not None:
            self.generators.set(self._start)
        if x.shape[0] > 0:
            loss = self.loss_fn(self.model(x), y)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise ValueError(f"sensitivity: loss_fn must return a scalar tensor, got "
                                 f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
            loss.backward()
        out = []
        for layer in self.layers:
            parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.trainable(layer)]
            # float64 before the unit: ×B̄ adds no rounding of the model's dtype
            out.append(torch.cat(parts).detach().double() * self.unit if parts else None)
        for p in self.model.parameters():
            p.grad = None
        return out


def _units(audit, mode):
    """``(name, layer indices, bound, symbol, checked)`` of every unit, from the layers themselves."""
    layers, names = audit.layers, audit.names
    live = [k for k, layer in enumerate(layers) if audit.trainable(layer)]
    units = []
    if mode == "backprop":
        for k, layer in enumerate(layers):
            units.append((names[k], [k], _delta(layer, audit), "Δ", True))
        return units
    noise = {layer._bp_noise_bound for layer in layers}
    if len(noise) > 1:
        raise ValueError(f"sensitivity: the layers of model scale their noise to different C {sorted(noise)}")
    c = noise.pop()
    if mode == "flat":
        units.append(("flat", live, c, "C", True))
        units += [(names[k], [k], c, "C", False) for k in range(len(layers))]
    else:
        units += [(names[k], [k], layers[k]._bp_max_grad_norm, "C_l", True) for k in range(len(layers))]
        units.append(("total", live, c, "C", True))
    return units


def _delta(layer, audit):
    try:
        return float(layer.sensitivity)
    except RuntimeError:  # a shape-dependent Δ never fixed: the noise follows the batch's shape
        return float(layer.sensitivity_for(tuple(audit.shapes[id(layer)])))


def _norms(units, full, other=None):
    """``[unit] -> ‖full − other‖`` (``‖full‖`` without ``other``) over each unit's layers."""
    sq = [None if f is None else (f if other is None else f - other[k]).square().sum() for k, f in enumerate(full)]
    return [math.sqrt(float(sum((sq[k] for k in ks if sq[k] is not None), 0.0))) for _, ks, *_ in units]


def layer_params(layer) -> list:
    """``[(part, parameter)]`` a clipped layer releases: a fused layer's ``weight`` and ``bias`` (the
    bias may be None), a generic unit's parameters by their names in the unit (its one draw covers
    them all, in this order: ``GenericLayer._bp_params``)."""
    if "_bp_slots" in layer.__dict__:
        return list(zip(layer._bp_names, layer._bp_params()))
    return [("weight", layer.weight), ("bias", layer.bias)]


def _on(copy_, x, y):
    """The batch on the copy's device, floating inputs in its dtype."""
    p = layer_params(copy_.layers[0])[0][1]
    return (x.to(p.device, p.dtype) if x.is_floating_point() else x.to(p.device)), y.to(p.device)
