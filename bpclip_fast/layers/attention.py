"""``nn.MultiheadAttention`` under exact clipping (``flat``/``per_layer``), through the fused Linear path.

No new clipped type and no new bound: :func:`unpack` turns a torch ``nn.MultiheadAttention`` (in
place, same object, same ``Parameter`` objects) into a :class:`MultiheadAttention` whose two
projections are plain ``nn.Linear`` children, ``in_proj`` (``in_proj_weight`` ``[3E, E]`` and
``in_proj_bias``) and ``out_proj``, which ``convert_model`` then converts like every other Linear
(:mod:`bpclip_fast.layers.linear`): their per-example gradients are normed, clipped and released
by the proved exact Linear path, and the probes of :mod:`bpclip_fast.validate` see two Linears.
The attention between them has no parameter and computes within each example.

One parameter, one per-example gradient. Self-attention (``query is key is value``) is one Linear
over ``x``. In cross-attention the rows ``0:E`` of ``in_proj_weight`` project the query, ``E:2E``
the key and ``2E:3E`` the value, each its own input: the distinct inputs are concatenated along the
positions into ``X = [query; key(; value)]`` (``[B, L+S(+S), E]``), ``in_proj`` runs once on
``X`` and each of ``q``, ``k``, ``v`` is its block of rows and positions of the output. Example
``i``'s gradient of the weight is then ``Σ_t g_t x_tᵀ`` over all positions of ``X`` where ``g_t``,
the upstream gradient of position ``t``, is zero outside the rows that position's use reads (the
slicing's backward): rows ``0:E`` get ``Σ_{t∈query} g_t x_tᵀ``, rows ``E:2E`` the key positions'
sum, rows ``2E:3E`` the value positions', which is exactly the gradient of the parameter summed
over its three uses; the bias likewise. So the Linear path's norm is that of the whole parameter's
per-example gradient, and the layer runs once per forward (flat pairs its norm with the other
layers' by row, per_layer clips it as one layer). The cost: the projection computes all ``3E``
outputs on every position of ``X`` (a third of them used in cross-attention).

What is not unpacked (:func:`not_fused`) stays a generic unit (:mod:`bpclip_fast.generic`, exact
too): separate ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` (``kdim``/``vdim`` not
``embed_dim``: three weights sharing one bias), ``add_bias_kv`` (``bias_k``/``bias_v``), a
subclass, or an ``out_proj`` that is not a plain Linear. ``clipping="backprop"`` has no proved
bound for attention's parameters and refuses it (``registry.unbounded``).

State-dict keys stay torch's (``in_proj_weight``, ``in_proj_bias``, ``out_proj.weight``,
``out_proj.bias``, in that order; a checkpoint of either form loads into the other); the attributes
``in_proj_weight``/``in_proj_bias`` read the Linear's parameters. ``named_parameters`` names them
``in_proj.weight``/``in_proj.bias``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .. import registry

_PARAMS = ("in_proj_weight", "in_proj_bias")


def not_fused(module: nn.MultiheadAttention) -> str | None:
    """Why ``module`` stays a generic unit (``None``: it is unpacked)."""
    if type(module) is not nn.MultiheadAttention:
        return "a subclass (its forward may differ from torch's)"
    if not module._qkv_same_embed_dim:
        return "kdim/vdim differ from embed_dim (separate q/k/v projection weights sharing one bias)"
    if module.bias_k is not None or module.bias_v is not None:
        return "add_bias_kv=True (bias_k/bias_v are appended to the keys and values)"
    if set(module._modules) != {"out_proj"} or type(module.out_proj) not in (nn.Linear, NonDynamicallyQuantizableLinear):
        return "its out_proj is not a plain Linear"
    if {n for n, p in module._parameters.items() if p is not None} - set(_PARAMS):
        return "it holds parameters besides in_proj_weight/in_proj_bias"
    return None


class MultiheadAttention(nn.MultiheadAttention):
    """A torch ``nn.MultiheadAttention`` unpacked by :func:`unpack` (never built directly): the same
    forward (training semantics of ``F.multi_head_attention_forward``: masks, ``is_causal`` with its
    ``attn_mask``, dropout on the attention weights, ``need_weights``/``average_attn_weights``,
    ``add_zero_attn``, ``batch_first``), computed batch-first with the projections as Linears."""

    def __init__(self, *args, **kwargs):
        raise TypeError("bpclip_fast MultiheadAttention: build a torch nn.MultiheadAttention; convert_model "
                        "(make_private) unpacks it")

    @property
    def in_proj_weight(self):
        return self._modules["in_proj"].weight

    @property
    def in_proj_bias(self):
        return self._modules["in_proj"].bias

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if query.dim() != 3:
            raise ValueError(f"MultiheadAttention: private training needs batched input (3-D query with a batch "
                             f"dimension); got shape {tuple(query.shape)}")
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if is_causal and attn_mask is None:  # torch's rule: is_causal is a hint about the attn_mask given
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                               "method `generate_square_subsequent_mask` to create this mask.")
        # The distinct inputs (by identity, as torch's projection tells self- from cross-attention),
        # batch-first: the Linears clip row i of dimension 0 as example i.
        first = {}
        for t in (query, key, value):
            first.setdefault(id(t), t if self.batch_first else t.transpose(0, 1))
        q_in, k_in, v_in = (first[id(t)] for t in (query, key, value))
        if q_in.shape[-1] != self.embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but got {q_in.shape[-1]}")
        if key.shape != value.shape:
            raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
        parts, at = list(first.values()), {}
        for t in parts:
            at[id(t)] = sum(p.shape[1] for p in parts[:len(at)])
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        proj = self.in_proj(x)  # module docstring: one call, one per-example gradient of the parameter
        E, tgt_len, src_len = self.embed_dim, q_in.shape[1], k_in.shape[1]
        q = proj[:, :tgt_len, :E]
        k = proj[:, at[id(k_in)]:at[id(k_in)] + src_len, E:2 * E]
        v = proj[:, at[id(v_in)]:at[id(v_in)] + src_len, 2 * E:]
        out, weights = _attend(self, q, k, v, key_padding_mask, attn_mask, need_weights)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        return out, weights

    def extra_repr(self):
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"


def _attend(mha, q, k, v, key_padding_mask, attn_mask, need_weights):
    """``(attention output [B, L, E] before out_proj, weights [B, H, L, S] or None)`` as
    ``F.multi_head_attention_forward`` computes them (its need_weights path, whose head layout
    ``b·H + h`` and dropout shape this keeps), from batch-first projections."""
    bsz, tgt_len, E = q.shape
    heads = mha.num_heads
    head_dim = E // heads
    if head_dim * heads != E:
        raise AssertionError(f"embed_dim {E} not divisible by num_heads {heads}")

    def split(t):  # [B, T, E] -> [B·H, T, hd]
        return t.reshape(bsz, t.shape[1], heads, head_dim).transpose(1, 2).reshape(bsz * heads, t.shape[1], head_dim)

    q, k, v = split(q), split(k), split(v)
    src_len = k.shape[1]
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(tgt_len, src_len)}.")
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (bsz * heads, tgt_len, src_len):
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(bsz * heads, tgt_len, src_len)}.")
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
    if mha.add_zero_attn:
        zeros = q.new_zeros(bsz * heads, 1, head_dim)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
        src_len += 1
    if key_padding_mask is not None:
        if key_padding_mask.shape != (bsz, src_len):
            raise AssertionError(f"expecting key_padding_mask shape of {(bsz, src_len)}, but got "
                                 f"{tuple(key_padding_mask.shape)}")
        kpm = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src_len)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    scores = q * math.sqrt(1.0 / float(head_dim))
    scores = (torch.baddbmm(attn_mask, scores, k.transpose(-2, -1)) if attn_mask is not None
              else torch.bmm(scores, k.transpose(-2, -1)))
    weights = F.softmax(scores, dim=-1)
    if mha.training and mha.dropout > 0.0:
        weights = F.dropout(weights, p=mha.dropout)
    out = torch.bmm(weights, v)  # [B·H, L, hd]
    out = out.reshape(bsz, heads, tgt_len, head_dim).transpose(1, 2).reshape(bsz, tgt_len, E)
    return out, (weights.view(bsz, heads, tgt_len, src_len) if need_weights else None)


def _save_torch_keys(module, state_dict, prefix, local_metadata):
    """State-dict hook: ``in_proj.weight``/``in_proj.bias`` saved as torch's ``in_proj_weight``/
    ``in_proj_bias``; this module's keys (the last ones written) re-inserted in torch's order."""
    ours = [k for k in state_dict if k.startswith(prefix)]
    items = [(k, state_dict.pop(k)) for k in ours]
    for k, v in items:
        rest = k[len(prefix):]
        if rest in ("in_proj.weight", "in_proj.bias"):
            k = prefix + rest.replace(".", "_")
        state_dict[k] = v
    return state_dict


def _load_torch_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """Load pre-hook: torch's keys (or ours) load into ``in_proj``."""
    for name in _PARAMS:
        if prefix + name in state_dict:
            state_dict[prefix + name.replace("in_proj_", "in_proj.")] = state_dict.pop(prefix + name)


def unpack(module: nn.MultiheadAttention) -> MultiheadAttention:
    """``module`` (a torch ``nn.MultiheadAttention`` that :func:`not_fused` accepts), in place, as a
    :class:`MultiheadAttention`: ``in_proj_weight``/``in_proj_bias`` moved into a child Linear
    ``in_proj`` (the same ``Parameter`` objects), ``out_proj`` a plain ``nn.Linear`` (torch's
    ``NonDynamicallyQuantizableLinear`` is one but for its name, which the registry refuses as a
    subclass). :func:`pack` undoes it."""
    reason = not_fused(module)
    if reason is not None:
        raise ValueError(f"MultiheadAttention: not unpacked: {reason}")
    weight = module._parameters.pop("in_proj_weight")
    bias = module._parameters.pop("in_proj_bias")
    in_proj = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    in_proj.weight = weight
    if bias is not None:
        in_proj.bias = bias
    in_proj.train(module.training)
    module.out_proj.__class__ = nn.Linear
    module._modules = {"in_proj": in_proj, **module._modules}  # torch's order: in_proj before out_proj
    module.__class__ = MultiheadAttention
    module._bp_hooks = (module._register_state_dict_hook(_save_torch_keys),
                        module._register_load_state_dict_pre_hook(_load_torch_keys, with_module=True))
    return module


def pack(module: MultiheadAttention) -> nn.MultiheadAttention:
    """Undoes :func:`unpack` (the probes' in-place fallback, bpclip_fast.validate)."""
    if type(module) is not MultiheadAttention or not isinstance(module.in_proj, nn.Linear) or type(module.in_proj) is not nn.Linear:
        raise ValueError("MultiheadAttention: only an unpacked, unconverted attention can be packed back")
    for h in module.__dict__.pop("_bp_hooks"):
        h.remove()
    in_proj = module._modules.pop("in_proj")
    module.__class__ = nn.MultiheadAttention
    module.register_parameter("in_proj_weight", in_proj.weight)
    module.register_parameter("in_proj_bias", in_proj.bias)
    module.out_proj.__class__ = NonDynamicallyQuantizableLinear
    return module


registry.register_composite(nn.MultiheadAttention, not_fused=not_fused, unpack=unpack, pack=pack)
