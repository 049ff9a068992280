"""The clipped Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2's layers; flat and per_layer).

``Conv1D(nf, nx)`` is a Linear with the weight stored transposed: ``weight [nx, nf] = [in, out]``,
``forward(x) = addmm(bias, x.view(-1, nx), weight)``, i.e. ``F.linear(x, weight.t(), bias)`` over every
position of ``x``. So it runs the fused Linear path on ``weight.t()`` (:data:`bpclip_fast.exact.
TRANSPOSED`), whose norms and release are the Linear's, proofs unchanged (the Frobenius norm of a
per-example gradient does not see the transpose); the release is transposed back into ``weight``'s
layout, each entry once.

Registered only once ``transformers.pytorch_utils`` is imported (a model holding a Conv1D has
imported it): :func:`bpclip_fast.registry.load_optional` imports this module then, so bpclip_fast
neither needs nor imports transformers. Exact modes only: backpropagation clipping's Linear kernels
take the weight as the parameter itself (``autograd._ClippedLinear``), which a Conv1D's is not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D as _HFConv1D

from .. import compiled, exact, modes, registry
from .base import _Clipped, _Public, _ExactOnly, _in_parameter_dtype


class Conv1D(_Public, _ExactOnly, _Clipped, _HFConv1D):
    """Hugging Face's ``Conv1D`` under exact per-example clipping (``flat``/``per_layer``), through the
    fused Linear kernels on the transposed weight (module docstring). Input ``[B, *, nx]``."""

    _bp_weight_layout = exact.TRANSPOSED

    def __init__(self, nf, nx, *, clipping="backprop", max_grad_norm=None, clip_fn="clip", gamma=0.01,
                 norm_method="auto", device=None, dtype=None):
        if not modes.strategy(clipping, "Conv1D").exact:
            raise ValueError("Conv1D: clipping='backprop' has no proved bound for a Conv1D's parameters here (its "
                             "kernels take a Linear's weight); use clipping='flat' or 'per_layer' (exact per-example "
                             "clipping: make_private(..., clipping='flat')), or freeze the Conv1D "
                             "(requires_grad_(False))")
        with torch.device(device if device is not None else torch.get_default_device()):
            super().__init__(nf, nx)
        self._bp_init_clipping(None, None, clip_fn, gamma, clipping, max_grad_norm, norm_method)
        if dtype is not None:  # after _bp_init_clipping: _apply moves its counter too (integer: not cast)
            self.to(dtype)

    @_in_parameter_dtype
    def forward(self, x):
        x = self._bp_check_input(x)
        if x.dim() < 2:
            raise ValueError(f"{self.layer_name}: the input needs a batch dimension, [B, *, {self.nx}]; "
                             f"got shape {tuple(x.shape)}")
        if torch.compiler.is_compiling():  # opaque ops, no Python read per step (compiled.py)
            return compiled.exact_layer(x, self)
        return exact.exact_layer(x, self, self._bp_noise_sensitivity(x))

    def __repr__(self) -> str:
        return f"Conv1D(nf={self.nf}, nx={self.nx}, {self._bp_clip_repr()})"


def _convert_hf_conv1d(layer: _HFConv1D, **clipping) -> Conv1D:
    kw = {k: v for k, v in clipping.items() if k in ("clipping", "max_grad_norm", "clip_fn", "gamma", "norm_method")}
    new = Conv1D(layer.nf, layer.nx, device="meta", dtype=layer.weight.dtype, **kw)
    if layer.bias is None:  # the meta bias would stay (bpclip_fast.nn._convert moves a bias that exists)
        new.register_parameter("bias", None)
    return new


registry.register_layer(_HFConv1D, Conv1D, convert=_convert_hf_conv1d, modes=modes.EXACT,
                        plain=lambda layer, x, p: F.linear(x, p["weight"].t(), p.get("bias")))
