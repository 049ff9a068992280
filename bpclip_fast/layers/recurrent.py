"""``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (tanh, relu) under exact clipping (``flat``/``per_layer``) through
the fused Linear path: single or multi-layer, bidirectional, ``batch_first`` either way, with or
without ``h_0``/``c_0``, dropout between layers. No new clipped type and no new bound: a
:class:`registry.Composite <bpclip_fast.registry.Composite>`, as ``nn.MultiheadAttention``
(:mod:`bpclip_fast.layers.attention`): :func:`unpack` turns the torch module (in place, same object,
same ``Parameter`` objects) into a subclass whose weights are plain ``nn.Linear`` children, which
``convert_model`` then converts like every other Linear (and the probes see as Linears).

Why a recurrent layer is a Linear over time steps
-------------------------------------------------
For each layer and direction, the gate pre-activations at step ``t`` are ``a_t = W_ih x_t + b_ih +
W_hh h_{t-1} + b_hh`` (GRU: the ``n`` block of the hidden part is multiplied by ``r_t`` first). With
``δ_t = ∂L/∂a_t``, one example's gradients are ``∇W_ih = Σ_t δ_t x_tᵀ``, ``∇b_ih = Σ_t δ_t``,
``∇W_hh = Σ_t δ'_t h_{t-1}ᵀ``, ``∇b_hh = Σ_t δ'_t`` (``δ' = δ``, GRU: ``n`` block ``r_t ⊙ δ_n``): the
gradients of a Linear applied at every position ``t`` of ``[B, T, ·]``, with upstream gradient ``δ``
(``δ'``) and input ``x`` (``h_{t-1}``). So each layer/direction is two Linear children,
``ih_l{k}[_reverse]`` and ``hh_l{k}[_reverse]``, each owning torch's ``Parameter`` objects (the same
objects: an optimizer built before the conversion keeps working; ``state_dict`` keys are torch's,
``weight_ih_l0`` ..., in torch's order, by hooks; the attributes ``weight_ih_l0`` ... read the
Linears' parameters, and refuse to be reassigned). Once converted, their per-example norms, factors
and release are the fused exact Linear path's (:mod:`bpclip_fast.exact`), whose proof is the bound:
nothing here clips or noises anything.

The forward, per layer and direction (``_direction``):

1. the recurrence once without gradients (torch's own kernel, real weights): every ``h_{t-1}``;
2. ``X = ih(x)`` ``[B, T, G·H]`` and ``Z = hh(h_prev)`` on the detached previous states;
3. the recurrence again (torch's kernel, with gradients) on the input ``U`` with input weight the
   identity and zero input bias, recurrent weights detached: ``a_t = U_t + W_hh h_{t-1} + b_hh``.
   ``U = _Tie(X, Z)`` has the value of ``X`` and hands its gradient ``δ`` to ``X`` and ``δ ⊙ m`` to ``Z``
   (``m = 1``; GRU: ``r_t`` on the ``n`` block, from step 1's states). The gates' values are torch's
   (``U = X``), the gradients of ``x`` and ``h_0`` flow through both kernels' own backward (the
   detached ``W_hh`` still carries ``∂a_t/∂h_{t-1}``), and the parameters' gradients flow only
   through the Linears: ``ih`` receives ``δ`` at positions ``x_t``, ``hh`` receives ``δ'`` at
   positions ``h_{t-1}`` — the sums above. The ``h_{t-1}`` of step 1 and of step 3 are one function
   of the same values, computed by the same kernel (rounding apart).

Row ``i`` of both Linears' inputs and upstream gradients is example ``i``'s alone (the recurrence
runs within each example; dropout between layers is elementwise), which is what their bound
assumes. Each Linear runs once per forward on all rows (flat clipping's rule).

Not unpacked (:func:`not_fused`; trained by the generic exact path, :mod:`bpclip_fast.generic`, as
before): an LSTM with ``proj_size > 0`` (its ``weight_hr`` would need a third Linear over the
recurrence's cell outputs, not done here), a subclass (its forward may differ from torch's), and
modules whose weights are not their own plain parameters (a reparametrisation: the generic path
differentiates whatever computes them). A ``PackedSequence`` or an unbatched ``[T, d]`` input is
refused at the forward (the Linears need the examples in dimension 0). ``clipping="backprop"``
has no proved bound for a recurrent layer's parameters and refuses it (``registry.unbounded``).

``per_layer``: every Linear with a trainable parameter is one clipping unit (as in Opacus' DPLSTM,
whose ``ih``/``hh`` are separate layers); ``convert_model`` counts them among the model's layers
(``C/√L``, or one ``C_l`` per Linear in ``named_modules`` order). A frozen pair stays a plain Linear.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from .. import registry
from ..amp import autocast_on
from ..graph_nodes import untraced

_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
_VF_FN = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}
_TORCH_NAME = re.compile(r"(weight|bias)_(ih|hh)_l(\d+)(_reverse)?")


class _Tie(torch.autograd.Function):
    """``X`` (value), whose gradient ``g`` goes to ``X`` and ``g ⊙ m`` to ``Z`` (``m`` None: ``g``)."""

    @staticmethod
    def forward(ctx, x, z, m):
        ctx.save_for_backward(m)
        ctx.has_m = m is not None
        return x.clone()

    @staticmethod
    @untraced  # graph_nodes.untraced: the engine's calls never run under dynamo
    def backward(ctx, g):
        m, = ctx.saved_tensors
        return g, (g * m if ctx.has_m else g), None


def _vf(mode, x, hx, params, has_bias, train):
    """One layer, one direction, batch-first, of torch's own recurrence kernel: ``(output, final state)``.
    ``train``: the kernel keeps what its backward needs (cuDNN refuses a backward of an inference-mode
    call); the dropout inside is 0 either way (ours is between the layers)."""
    fn = getattr(torch._VF, _VF_FN[mode])
    if mode == "LSTM":
        out, h, c = fn(x, hx, params, has_bias, 1, 0.0, train, False, True)
        return out, (h, c)
    out, h = fn(x, hx, params, has_bias, 1, 0.0, train, False, True)
    return out, h


class _Recurrent:
    """The forward of an unpacked recurrent layer (module docstring), shared by :class:`LSTM`,
    :class:`GRU` and :class:`RNN` (torch's own attributes: ``mode``, sizes, ``batch_first`` ...)."""

    def __init__(self, *args, **kwargs):
        raise TypeError(f"bpclip_fast {type(self).__name__}: build a torch nn.{type(self).__name__}; convert_model "
                        "(make_private) unpacks it")

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    def torch_names(self) -> list[str]:
        """torch's ``_flat_weights_names``: the state_dict keys of this layer."""
        out = []
        for k in range(self.num_layers):
            for sfx in [""] + (["_reverse"] if self.bidirectional else []):
                out += [f"weight_ih_l{k}{sfx}", f"weight_hh_l{k}{sfx}"]
                if self.bias:
                    out += [f"bias_ih_l{k}{sfx}", f"bias_hh_l{k}{sfx}"]
        return out

    def __getattr__(self, name):
        # torch's names (lstm.weight_ih_l0 ...) read the parameter of the clipped Linear owning it
        match = _TORCH_NAME.fullmatch(name)
        if match is not None:
            kind, side, k, rev = match.groups()
            modules = self.__dict__.get("_modules", {})
            child = modules.get(f"{side}_l{k}{rev or ''}")
            if child is not None:
                return getattr(child, kind)
        return super().__getattr__(name)

    def __setattr__(self, name, value):
        # torch's names alias the Linears' parameters (__getattr__); a plain tensor assigned to one
        # would become an attribute shadowing the alias while the forward kept the Linear's parameter:
        # torch refuses a non-Parameter for a parameter's name, so the assignment is refused, not ignored.
        match = _TORCH_NAME.fullmatch(name)
        if match is not None and f"{match[2]}_l{match[3]}{match[4] or ''}" in self.__dict__.get("_modules", {}):
            child = f"{match[2]}_l{match[3]}{match[4] or ''}"
            raise AttributeError(f"{type(self).__name__}: {name} is the {match[1]} of the clipped Linear {child!r} "
                                 f"(unpacked for private training) and cannot be replaced; copy values in place "
                                 f"(with torch.no_grad(): layer.{name}.copy_(new)), or replace the weight before "
                                 "make_private")
        super().__setattr__(name, value)

    def flatten_parameters(self) -> None:
        """Nothing to do: the weights are the Linears' (torch's would re-point their storage into one
        cuDNN buffer); each forward passes them as a list."""

    # ------------------------------------------------------------------ forward
    def forward(self, input, hx=None):
        kind = type(self).__name__
        if isinstance(input, PackedSequence):
            raise ValueError(f"{kind}: a PackedSequence input is not supported under private training (its "
                             "examples' time steps are interleaved in one dimension, and the clipped Linears need "
                             "each example in its own row); pad the batch instead (torch.nn.utils.rnn."
                             "pad_packed_sequence, or pad_sequence with batch_first=True)")
        if not isinstance(input, torch.Tensor) or input.dim() != 3:
            shape = tuple(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__
            raise ValueError(f"{kind}: the input must be batched, [B, T, {self.input_size}] with batch_first=True "
                             f"or [T, B, {self.input_size}]; got {shape} (an unbatched sequence: add a batch "
                             "dimension of one)")
        param = next(self.parameters())
        if autocast_on(input.device.type):
            # As every fused layer (layers.base._in_parameter_dtype): computed in the parameters' dtype.
            with torch.autocast(input.device.type, enabled=False):
                return self._forward(input.to(param.dtype) if input.is_floating_point() else input, hx, kind)
        return self._forward(input, hx, kind)

    def _forward(self, input, hx, kind):
        weight = self._modules["ih_l0"].weight
        if input.device != weight.device or input.dtype != weight.dtype:  # before torch's kernels raise less clearly
            raise TypeError(f"{kind}: the input is {input.dtype} on {input.device} but the layer's parameters are "
                            f"{weight.dtype} on {weight.device}; move or cast one of them (x.to(...), model.to(...))")
        x = input if self.batch_first else input.transpose(0, 1)
        if x.shape[-1] != self.input_size:
            raise ValueError(f"{kind}: expected input size {self.input_size}, got {x.shape[-1]}")
        B, H, D = x.shape[0], self.hidden_size, self.directions
        zeros = x.new_zeros(self.num_layers * D, B, H)
        if self.mode == "LSTM":
            h0, c0 = (zeros, zeros) if hx is None else hx
            self._check_state(h0, B, "h_0")
            self._check_state(c0, B, "c_0")
        else:
            h0, c0 = (zeros if hx is None else hx), None
            self._check_state(h0, B, "h_0")
        hs, cs = [], []
        for k in range(self.num_layers):
            if k > 0 and self.dropout > 0 and self.training:
                x = F.dropout(x, self.dropout, True)
            outs = []
            for d, sfx in enumerate([""] + (["_reverse"] if self.bidirectional else [])):
                j = k * D + d
                state = h0[j] if self.mode != "LSTM" else (h0[j], c0[j])
                out, last = self._direction(x, state, self._modules[f"ih_l{k}{sfx}"],
                                            self._modules[f"hh_l{k}{sfx}"], d == 1)
                outs.append(out)
                if self.mode == "LSTM":
                    hs.append(last[0][0])
                    cs.append(last[1][0])
                else:
                    hs.append(last[0])
            x = outs[0] if D == 1 else torch.cat(outs, dim=2)
        output = x if self.batch_first else x.transpose(0, 1)
        h_n = torch.stack(hs)
        return (output, (h_n, torch.stack(cs))) if self.mode == "LSTM" else (output, h_n)

    def _check_state(self, h, batch, what):
        want = (self.num_layers * self.directions, batch, self.hidden_size)
        if not isinstance(h, torch.Tensor) or tuple(h.shape) != want:
            got = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise ValueError(f"{type(self).__name__}: {what} must have shape {want} (layers·directions, batch, "
                             f"hidden), got {got}")

    def _direction(self, x, state, ih, hh, reverse):
        """One layer and direction (module docstring): ``(output [B, T, H], final state)``."""
        if reverse:
            x = x.flip(1)
        w_ih, w_hh = ih.weight.detach(), hh.weight.detach()
        has_bias = self.bias
        plain = [w_ih, w_hh] + ([ih.bias.detach(), hh.bias.detach()] if has_bias else [])
        unsq = (tuple(s.unsqueeze(0) for s in state) if self.mode == "LSTM" else state.unsqueeze(0))
        with torch.no_grad():
            first, _ = _vf(self.mode, x.detach(), tuple(s.detach() for s in unsq) if self.mode == "LSTM"
                           else unsq.detach(), plain, has_bias, False)
            h0 = unsq[0][0] if self.mode == "LSTM" else unsq[0]
            prev = torch.cat([h0.detach().unsqueeze(1), first[:, :-1]], dim=1)
        X = ih(x)
        Z = hh(prev)
        m = None
        if self.mode == "GRU":  # the n block of the hidden part enters as r ⊙ (W_hn h + b_hn)
            with torch.no_grad():
                H = self.hidden_size
                r = torch.sigmoid(X[..., :H] + Z[..., :H])
                m = torch.cat([torch.ones_like(X[..., :2 * H]), r], dim=-1)
        U = _Tie.apply(X, Z, m)
        gates = X.shape[-1]
        eye = torch.eye(gates, dtype=U.dtype, device=U.device)
        params = [eye, w_hh] + ([torch.zeros(gates, dtype=U.dtype, device=U.device), hh.bias.detach()]
                                if has_bias else [])
        out, last = _vf(self.mode, U, unsq, params, has_bias, True)
        return (out.flip(1) if reverse else out), last


class LSTM(_Recurrent, nn.LSTM):
    __doc__ = _Recurrent.__doc__


class GRU(_Recurrent, nn.GRU):
    __doc__ = _Recurrent.__doc__


class RNN(_Recurrent, nn.RNN):
    __doc__ = _Recurrent.__doc__


# ------------------------------------------------------------------------------ state_dict: torch's keys


def _internal(name: str) -> str | None:
    match = _TORCH_NAME.fullmatch(name)
    if match is None:
        return None
    kind, side, k, rev = match.groups()
    return f"{side}_l{k}{rev or ''}.{kind}"


def _torch_state_dict(module, state_dict, prefix, local_metadata):
    """``ih_l0.weight`` -> ``weight_ih_l0`` ..., in torch's order: a checkpoint of the converted model
    loads into the plain one and back."""
    # This module's entries are the last ones written when the hook runs: re-adding them at the end
    # under torch's names keeps the whole dict in named_modules order.
    for name in module.torch_names():
        key = prefix + _internal(name)
        if key in state_dict:
            state_dict[prefix + name] = state_dict.pop(key)
    return state_dict


def _from_torch_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                           error_msgs):
    for name in module.torch_names():
        if prefix + name in state_dict:
            state_dict[prefix + _internal(name)] = state_dict.pop(prefix + name)


# ------------------------------------------------------------------------------ unpacking and registration


_UNPACKED = {nn.LSTM: LSTM, nn.GRU: GRU, nn.RNN: RNN}
_TORCH = {v: k for k, v in _UNPACKED.items()}


def not_fused(module) -> str | None:
    """Why ``module`` stays a generic unit (``None``: it is unpacked)."""
    if type(module) not in _UNPACKED:
        return "a subclass (its forward may differ from torch's)"
    if getattr(module, "proj_size", 0):
        return "proj_size > 0 (weight_hr projects the recurrence's own output: not a Linear over the inputs)"
    if module._modules:
        return "it has submodules (a parametrisation computes its weights)"
    own = {n for n, p in module._parameters.items() if p is not None}
    if own != set(module._flat_weights_names) or not all(isinstance(module._parameters[n], nn.Parameter) for n in own):
        return "its weights are not its own plain parameters (a reparametrisation computes them)"
    return None


def _pairs(layer) -> list[tuple[str, str, str | None]]:
    """``(child name, torch weight name, torch bias name or None)`` in torch's order."""
    out = []
    for k in range(layer.num_layers):
        for sfx in [""] + (["_reverse"] if layer.bidirectional else []):
            for side in ("ih", "hh"):
                out.append((f"{side}_l{k}{sfx}", f"weight_{side}_l{k}{sfx}",
                            f"bias_{side}_l{k}{sfx}" if layer.bias else None))
    return out


def unpack(module):
    """``module`` (a torch recurrent layer :func:`not_fused` accepts), in place, as our subclass: each
    ``weight_ih_l{k}``/``bias_ih_l{k}`` (and ``hh``, ``_reverse``) moved into a child ``nn.Linear``
    ``ih_l{k}`` (the same ``Parameter`` objects). :func:`pack` undoes it."""
    reason = not_fused(module)
    if reason is not None:
        raise ValueError(f"{type(module).__name__}: not unpacked: {reason}")
    for child, w, b in _pairs(module):
        weight = module._parameters.pop(w)
        bias = module._parameters.pop(b) if b else None
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
        lin.weight = weight
        if bias is not None:
            lin.bias = bias
        lin.train(module.training)
        module._modules[child] = lin
    module.__class__ = _UNPACKED[type(module)]
    module._bp_hooks = (module._register_state_dict_hook(_torch_state_dict),
                        module._register_load_state_dict_pre_hook(_from_torch_state_dict, with_module=True))
    return module


def pack(module):
    """Undoes :func:`unpack` (the probes' in-place fallback, bpclip_fast.validate)."""
    if type(module) not in _TORCH or any(type(m) is not nn.Linear for m in module._modules.values()):
        raise ValueError(f"{type(module).__name__}: only an unpacked, unconverted recurrent layer can be packed back")
    for h in module.__dict__.pop("_bp_hooks"):
        h.remove()
    children = dict(module._modules)
    module._modules.clear()
    module.__class__ = _TORCH[type(module)]
    for child, w, b in _pairs(module):
        module._parameters[w] = children[child].weight
        if b:
            module._parameters[b] = children[child].bias
    module._parameters = {n: module._parameters[n] for n in module._flat_weights_names}  # torch's order
    module._init_flat_weights()
    return module


for _torch_type in _UNPACKED:
    registry.register_composite(_torch_type, not_fused=not_fused, unpack=unpack, pack=pack)
