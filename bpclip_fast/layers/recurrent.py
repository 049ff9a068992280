"""Fused exact clipping for ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (tanh, relu): single or multi-layer,
bidirectional, ``batch_first`` either way, with or without ``h_0``/``c_0``, dropout between layers.
Exact modes only (``flat``/``per_layer``).

Why a recurrent layer is a Linear over time steps
-------------------------------------------------
For each layer and direction, the gate pre-activations at step ``t`` are ``a_t = W_ih x_t + b_ih +
W_hh h_{t-1} + b_hh`` (GRU: the ``n`` block of the hidden part is multiplied by ``r_t`` first). With
``δ_t = ∂L/∂a_t``, one example's gradients are ``∇W_ih = Σ_t δ_t x_tᵀ``, ``∇b_ih = Σ_t δ_t``,
``∇W_hh = Σ_t δ'_t h_{t-1}ᵀ``, ``∇b_hh = Σ_t δ'_t`` (``δ' = δ``, GRU: ``n`` block ``r_t ⊙ δ_n``): the
gradients of a Linear applied at every position ``t`` of ``[B, T, ·]``, with upstream gradient ``δ``
(``δ'``) and input ``x`` (``h_{t-1}``). So each layer/direction is two clipped
:class:`~bpclip_fast.layers.linear.Linear` children, ``ih_l{k}[_reverse]`` and ``hh_l{k}[_reverse]``,
each owning torch's ``Parameter`` objects (the same objects: an optimizer built before the
conversion keeps working; ``state_dict`` keys are torch's, ``weight_ih_l0`` ..., by hooks). Their
per-example norms, factors and release are the fused exact path's (``bpclip_fast.exact``), whose
proof is the bound: nothing here clips or noises anything.

The forward, per layer and direction (``_direction``):

1. the recurrence once without gradients (torch's own kernel, real weights): every ``h_{t-1}``;
2. ``X = ih(x)`` ``[B, T, G·H]`` and ``Z = hh(h_prev)`` on the detached previous states;
3. the recurrence again (torch's kernel, with gradients) on the input ``U`` with input weight the
   identity and zero input bias, recurrent weights detached: ``a_t = U_t + W_hh h_{t-1} + b_hh``.
   ``U = _Tie(X, Z)`` has the value of ``X`` and hands its gradient ``δ`` to ``X`` and ``δ ⊙ m`` to ``Z``
   (``m = 1``; GRU: ``r_t`` on the ``n`` block, from step 1's states). The gates' values are torch's
   (``U = X``), the gradients of ``x`` and ``h_0`` flow through both kernels' own backward (the
   detached ``W_hh`` still carries ``∂a_t/∂h_{t-1}``), and the parameters' gradients flow only
   through the clipped Linears: ``ih`` receives ``δ`` at positions ``x_t``, ``hh`` receives ``δ'`` at
   positions ``h_{t-1}`` — the sums above. The ``h_{t-1}`` of step 1 and of step 3 are one function
   of the same values, computed by the same kernel (rounding apart).

Row ``i`` of both Linears' inputs and upstream gradients is example ``i``'s alone (the recurrence
runs within each example; dropout between layers is elementwise), which is what their bound
assumes. Each Linear runs once per forward on all rows (flat clipping's rule).

Not fused (trained by the generic exact path, :mod:`bpclip_fast.generic`, as before): an LSTM
with ``proj_size > 0`` (its ``weight_hr`` would need a third Linear over the recurrence's cell
outputs, not done here), and modules whose weights are not plain parameters (a reparametrisation:
the generic path differentiates whatever computes them). A ``PackedSequence`` or an unbatched
``[T, d]`` input is refused at the forward (the clipped Linears need the examples in dimension 0).

``per_layer``: every clipped Linear is one clipping unit (as in Opacus' DPLSTM, whose ``ih``/``hh``
are separate layers); ``convert_model`` counts them among the model's layers (``C/√L``, or one
``C_l`` per clipped Linear in ``named_modules`` order).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from .. import modes, registry
from .linear import Linear

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
    def backward(ctx, g):
        m, = ctx.saved_tensors
        return g, (g * m if ctx.has_m else g), None


def _vf(mode, x, hx, params, has_bias, train_grad):
    fn = getattr(torch._VF, _VF_FN[mode])
    if mode == "LSTM":
        out, h, c = fn(x, hx, params, has_bias, 1, 0.0, False, False, True)
        return out, (h, c)
    out, h = fn(x, hx, params, has_bias, 1, 0.0, False, False, True)
    return out, h


class _Recurrent(nn.Module):
    """A recurrent layer of clipped Linears (module docstring). ``mode`` as torch's ``RNNBase``."""

    mode = ""
    _torch_type: type = nn.Module

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, *, clipping="backprop", max_grad_norm=None, clip_fn="clip", gamma=0.01,
                 norm_method="auto", trainable=None, device=None, dtype=None):
        super().__init__()
        kind = type(self).__name__
        if not modes.strategy(clipping, kind).exact:
            raise ValueError(f"{kind}: clipping='backprop' has no proved bound for a recurrent layer's parameters; "
                             "use clipping='flat' or 'per_layer' (exact per-example clipping: make_private(..., "
                             f"clipping='flat')), or freeze the {kind} (requires_grad_(False))")
        if not (isinstance(dropout, (int, float)) and 0 <= dropout <= 1):
            raise ValueError(f"{kind}: dropout must be a number in [0, 1], got {dropout!r}")
        self.input_size, self.hidden_size, self.num_layers = int(input_size), int(hidden_size), int(num_layers)
        self.bias, self.batch_first, self.dropout = bool(bias), bool(batch_first), float(dropout)
        self.bidirectional = bool(bidirectional)
        self.proj_size = 0
        self.clipping = clipping
        gates = _GATES[self.mode] * self.hidden_size
        names = self.unit_names()
        # trainable: which (ih/hh) pairs own a trainable parameter (the converter's; all by default).
        # A frozen pair is a plain nn.Linear: it has nothing to clip, and no threshold is spent on it.
        trainable = [True] * len(names) if trainable is None else list(trainable)
        thresholds = (list(max_grad_norm) if isinstance(max_grad_norm, (list, tuple))
                      else [max_grad_norm] * sum(trainable))
        if len(thresholds) != sum(trainable):
            raise ValueError(f"{kind}: max_grad_norm has {len(thresholds)} thresholds for {sum(trainable)} clipped "
                             "Linears (one per ih/hh of each layer and direction with a trainable parameter)")
        it = iter(thresholds)
        for name, train in zip(names, trainable):
            layer = int(name.split("_l")[1].split("_")[0])
            fan_in = (self.input_size if layer == 0 else self.hidden_size * self.directions) \
                if name.startswith("ih") else self.hidden_size
            if train:
                lin = Linear(fan_in, gates, bias=self.bias, clipping=clipping, max_grad_norm=next(it),
                             clip_fn=clip_fn, gamma=gamma, norm_method=norm_method, device=device, dtype=dtype)
            else:
                lin = nn.Linear(fan_in, gates, bias=self.bias, device=device, dtype=dtype)
            self.add_module(name, lin)
        if device != "meta":
            self.reset_parameters()
        clipped = [m for m in self.children() if isinstance(m, Linear)]
        if clipped:  # as convert_model does over a model (it settles again over the whole model)
            modes.strategy(clipping).settle(self, clipped, clipped[0].max_grad_norm, clip_fn, gamma)
        self._register_state_dict_hook(_torch_state_dict)
        self._register_load_state_dict_pre_hook(_from_torch_state_dict, with_module=True)

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    def unit_names(self) -> list[str]:
        """The children's names, in torch's parameter order (layer, direction, ih before hh)."""
        return [f"{kind}_l{k}{sfx}" for k in range(self.num_layers)
                for sfx in ([""] + (["_reverse"] if self.bidirectional else [])) for kind in ("ih", "hh")]

    def torch_names(self) -> list[str]:
        """torch's ``_flat_weights_names``: the state_dict keys of this layer."""
        out = []
        for k in range(self.num_layers):
            for sfx in [""] + (["_reverse"] if self.bidirectional else []):
                out += [f"weight_ih_l{k}{sfx}", f"weight_hh_l{k}{sfx}"]
                if self.bias:
                    out += [f"bias_ih_l{k}{sfx}", f"bias_hh_l{k}{sfx}"]
        return out

    def reset_parameters(self) -> None:
        """torch's initialisation: every weight and bias uniform in ``±1/√hidden_size``."""
        bound = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        with torch.no_grad():
            for p in self.parameters():
                p.uniform_(-bound, bound)

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

    def extra_repr(self):
        s = f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout:g}"
        if self.bidirectional:
            s += ", bidirectional=True"
        return s + f", clipping={self.clipping!r}"

    def flatten_parameters(self) -> None:
        """Nothing to do (torch's cuDNN weight buffer is not used: each step gets its weights as a list)."""

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
        if (torch.amp.is_autocast_available(input.device.type) and torch.is_autocast_enabled(input.device.type)):
            # As every fused layer (layers.base._in_parameter_dtype): computed in the parameters' dtype.
            with torch.autocast(input.device.type, enabled=False):
                return self._forward(input.to(param.dtype) if input.is_floating_point() else input, hx, kind)
        return self._forward(input, hx, kind)

    def _forward(self, input, hx, kind):
        weight = self.ih_l0.weight
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
                out, last = self._direction(x, state, getattr(self, f"ih_l{k}{sfx}"),
                                            getattr(self, f"hh_l{k}{sfx}"), d == 1)
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


class LSTM(_Recurrent):
    __doc__ = _Recurrent.__doc__
    mode = "LSTM"


class GRU(_Recurrent):
    __doc__ = _Recurrent.__doc__
    mode = "GRU"


class RNN(_Recurrent):
    __doc__ = _Recurrent.__doc__

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, **kw):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNN: unknown nonlinearity {nonlinearity!r}; use 'tanh' or 'relu'")
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, **kw)

    @property
    def mode(self):
        return "RNN_TANH" if self.nonlinearity == "tanh" else "RNN_RELU"

    def extra_repr(self):
        return super().extra_repr() + f", nonlinearity={self.nonlinearity!r}"


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


# ------------------------------------------------------------------------------ conversion and registration


_CLIPPED = {nn.LSTM: LSTM, nn.GRU: GRU, nn.RNN: RNN}


def _fused(layer) -> bool:
    """The configurations converted to the fused type; the others stay generic (module docstring):
    ``proj_size`` (a third, recurrence-dependent projection) and weights that are not the module's own
    plain parameters (a reparametrisation computes them)."""
    if getattr(layer, "proj_size", 0):
        return False
    return all(isinstance(layer._parameters.get(n), nn.Parameter) for n in layer._flat_weights_names)


def _pairs(layer) -> list[tuple[str, str, str]]:
    """``(child name, torch weight name, torch bias name or None)`` in torch's order."""
    out = []
    for k in range(layer.num_layers):
        for sfx in [""] + (["_reverse"] if layer.bidirectional else []):
            for side in ("ih", "hh"):
                out.append((f"{side}_l{k}{sfx}", f"weight_{side}_l{k}{sfx}",
                            f"bias_{side}_l{k}{sfx}" if layer.bias else None))
    return out


def _trainable_pairs(layer) -> list[bool]:
    return [any(p is not None and p.requires_grad for p in (getattr(layer, w), getattr(layer, b) if b else None))
            for _, w, b in _pairs(layer)]


def units(layer) -> int:
    """The clipped Linears a conversion of ``layer`` makes (its per_layer clipping units)."""
    return sum(_trainable_pairs(layer))


def _convert(layer, **clipping):
    clipping.pop("norm", None)
    clipping.pop("input_clip", None)
    clipping.pop("grad_clip", None)
    extra = dict(nonlinearity=layer.nonlinearity) if isinstance(layer, nn.RNN) else {}
    new = _CLIPPED[type(layer)](layer.input_size, layer.hidden_size, num_layers=layer.num_layers, bias=layer.bias,
                                batch_first=layer.batch_first, dropout=layer.dropout,
                                bidirectional=layer.bidirectional, trainable=_trainable_pairs(layer), device="meta",
                                dtype=layer.weight_ih_l0.dtype, **extra, **clipping)
    for child, w, b in _pairs(layer):
        lin = getattr(new, child)
        # The same Parameter objects: an optimizer built before the conversion keeps working.
        lin.weight = getattr(layer, w)
        lin.bias = getattr(layer, b) if b else None
        if hasattr(lin, "_nonfinite"):
            lin._nonfinite = torch.zeros(2, dtype=torch.int64, device=lin.weight.device)
    new.train(layer.training)
    return new


def _plain(layer, x, params):
    """The torch type's output for ``params`` by torch's names (a clipped layer: its torch twin's)."""
    if isinstance(layer, _Recurrent):
        torch_type = next(t for t, c in _CLIPPED.items() if c is type(layer))
        extra = dict(nonlinearity=layer.nonlinearity) if isinstance(layer, RNN) else {}
        layer = torch_type(layer.input_size, layer.hidden_size, num_layers=layer.num_layers, bias=layer.bias,
                           batch_first=layer.batch_first, dropout=layer.dropout, bidirectional=layer.bidirectional,
                           device="meta", **extra).train(layer.training)
    return torch.func.functional_call(layer, params, (x,))[0]


for _torch_type, _clipped_type in _CLIPPED.items():
    registry.register_layer(_torch_type, _clipped_type, convert=_convert, plain=_plain, modes=modes.EXACT,
                            params=lambda layer: tuple(layer._flat_weights_names), fuses=_fused, units=units,
                            composite=True)
