"""The machinery of the per-example bound fuzzer (tests/test_bound_fuzz.py, issue 24) and of its
regression tests (tests/test_fuzz_regressions.py): how a drawn case is built, and what is checked.

A :class:`Case` is one clipped layer of a registered type (bpclip_fast/registry.py) in one mode,
dtype, clip function and norm method, with a batch laid out in memory in some way and filled with
(possibly adversarial) values, and an upstream gradient ``g`` fed straight into the layer's
backward (so any vector, however adversarial, can reach it; no loss is needed). :func:`check`
runs it and asserts, for every example ``i``:

1. **bound** — its contribution, measured two ways, is at most the bound the noise is scaled to
   (``C`` under flat/per_layer, the layer's ``Δ`` under backprop):

   * *stored*: ``C̃_i``, the float64 truth of what the release holds of example ``i`` — the clipped
     values as the kernels store them (``clip_rows``/``scale_rows`` output, the kept per-example
     gradients, the rounded per-example gradients of the instantiating layers) and the factors
     the layer takes (from its own norm bound), multiplied out in float64. This is the quantity
     the proofs in csrc/exact.cpp, bpclip_fast/exact.py and bpclip_fast/layers/ bound, so it is held
     to the bound with only float64's own evaluation error as slack;
   * *removal*: ``R(D) − R(D∖{i})``, the layer run (noise off) on the batch and on the batch
     without ``i``, both releases read in float64: the quantity the accountant assumes. It is held
     to the bound plus the rounding of the two releases (:func:`release_error`).

2. **truth** — the release ``R(D)`` equals ``Σ_i c_i G_i``, with ``G_i`` example ``i``'s exact
   gradient (float64 ``torch.func`` on batches of one, of the data as stored in the dtype) and
   ``c_i = f(‖G_i‖; C)`` (exact_oracle.clip_factor; backprop: the float64 reference clipping of
   ``x`` and ``g``), within a tolerance derived term by term from the dtype and the computation:
   the layer's norm bound may exceed the norm by its proved margin (asserted separately:
   :func:`norm_margin`), the release rounds ``c·g`` toward zero to the dtype, and accumulates in
   ``u_acc`` (float32 for the half types). Nothing is tuned to what happened to pass.

Also asserted on the way: the reconstruction ``Σ_i C̃_i`` equals the layer's release within its
rounding (so the stored values are the ones the release used), and the layer's norm bound lies in
``[‖G_i‖, ‖G_i‖ + margin]``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import types
from dataclasses import dataclass

import torch
from torch import nn

from bpclip_fast import _ops, exact, modules, registry
from bpclip_fast import examples as examples_mod
from bpclip_fast.layers import conv3d as conv3d_layer
from bpclip_fast import nn as bnn
from bpclip_fast import reference as ref

import exact_oracle as eo
from test_exact import per_example, position_norms64, spread
from fuzz_tolerances import (BF16, DTYPES, F16, F32, F64, RZ, UNIT, V, acc_unit, dense_margin, example_error,
                             bounded_terms, factor_change, gamma, norm_margin, positions, release_error, subnormal_step)

KINDS = ("linear", "conv", "layer_norm", "group_norm", "rms_norm", "instance_norm1d", "instance_norm2d",
         "instance_norm3d", "embedding", "positional", "class_token",
         "embedding_bag", "conv1d", "conv3d")
TORCH_TYPE = {"linear": nn.Linear, "conv": nn.Conv2d, "layer_norm": nn.LayerNorm, "group_norm": nn.GroupNorm,
              "rms_norm": nn.RMSNorm, "instance_norm1d": nn.InstanceNorm1d, "instance_norm2d": nn.InstanceNorm2d,
              "instance_norm3d": nn.InstanceNorm3d,
              "embedding": nn.Embedding, "positional": modules.PositionalEmbedding,
              "class_token": modules.ClassToken,
              "embedding_bag": nn.EmbeddingBag, "conv1d": nn.Conv1d, "conv3d": nn.Conv3d}
INDEXED = ("embedding", "embedding_bag")  # inputs are table indices
# torch's InstanceNorm took a `bias` option after 2.11 (the GPU machines' torch): a bias-free one
# exists only where it has it, so cases without a bias are drawn only there.
INSTANCE_NORM_BIAS_OPTION = "bias" in inspect.signature(nn.InstanceNorm1d.__init__).parameters
try:  # Hugging Face's Conv1D: registered once transformers is imported (registry.load_optional)
    from transformers.pytorch_utils import Conv1D as HFConv1D
    KINDS += ("hf_conv1d",)
    TORCH_TYPE["hf_conv1d"] = HFConv1D
    registry.layer_types()  # registers it now, before any test reads the registry's table
except ImportError:
    HFConv1D = None
# The kinds whose norms and release are the fused Linear/Conv2d ops' (exact._norms, _release): Conv1d
# as a Conv2d of height 1, HF's Conv1D as a Linear on the transposed weight, Conv3d as a Linear over
# its patches.
GEMM_KINDS = ("linear", "conv", "conv1d", "hf_conv1d", "conv3d")
LAYOUTS = ("contiguous", "channels_last", "nhwc_view", "permuted", "transposed", "expanded", "broadcast", "strided")
VALUES = ("normal", "scaled", "huge", "tiny", "subnormal", "spike", "zero", "cancel", "offset")


@dataclass
class Case:
    """One drawn case. ``geometry``: the layer's constructor arguments; ``shape``: the input's
    shape without the batch dim; ``values_x``/``values_g``: one value kind per example."""

    kind: str
    mode: str
    dtype: torch.dtype
    clip_fn: str
    bias: bool
    geometry: dict
    shape: tuple
    batch: int
    layout: str = "contiguous"
    layout_g: str = "contiguous"
    values_x: tuple = ()
    values_g: tuple = ()
    seed: int = 0
    norm_method: str = "auto"
    conv_norm: str = "l15"
    bound: float = 1.0            # C (exact modes); C_x = C_g = bound under backprop
    gamma: float = 0.01


# ------------------------------------------------------------------------------ building


def plain_layer(case: Case) -> nn.Module:
    """The torch layer, with parameters drawn from the case's seed (not torch's 1/0 affine init),
    already rounded to the case's dtype: its float64 copy is the truth's layer."""
    g = case.geometry
    k = case.kind
    if k == "linear":
        layer = nn.Linear(g["fin"], g["fout"], bias=case.bias, dtype=F64)
    elif k == "conv":
        layer = nn.Conv2d(g["cin"], g["cout"], g["kernel"], stride=g["stride"], padding=g["padding"],
                          dilation=g["dilation"], groups=g["groups"], bias=case.bias, dtype=F64)
    elif k == "conv1d":
        layer = nn.Conv1d(g["cin"], g["cout"], g["kernel"], stride=g["stride"], padding=g["padding"],
                          dilation=g["dilation"], groups=g["groups"], bias=case.bias, dtype=F64)
    elif k == "conv3d":
        layer = nn.Conv3d(g["cin"], g["cout"], g["kernel"], stride=g["stride"], padding=g["padding"],
                          dilation=g["dilation"], bias=case.bias, dtype=F64)
    elif k == "hf_conv1d":  # always biased (its forward is addmm(bias, ...))
        layer = HFConv1D(g["fout"], g["fin"]).to(F64)
    elif k == "layer_norm":
        layer = nn.LayerNorm(g["normalized"], bias=case.bias, dtype=F64)
    elif k == "group_norm":
        layer = nn.GroupNorm(g["groups"], g["channels"], dtype=F64)
    elif k == "rms_norm":  # an explicit eps: the float64 truth computes the same function
        layer = nn.RMSNorm(g["normalized"], eps=g["eps"], dtype=F64)
    elif k.startswith("instance_norm"):
        layer = TORCH_TYPE[k](g["channels"], affine=True, dtype=F64, **({} if case.bias else {"bias": False}))
    elif k == "embedding":
        layer = nn.Embedding(g["vocab"], g["dim"], padding_idx=g["padding_idx"], dtype=F64)
    elif k == "embedding_bag":
        layer = nn.EmbeddingBag(g["vocab"], g["dim"], mode=g["mode"], padding_idx=g["padding_idx"], dtype=F64)
    elif k == "positional":
        layer = modules.PositionalEmbedding(*case.shape, dtype=F64)
    else:
        layer = modules.ClassToken(g["dim"], g["tokens"], dtype=F64)
    gen = torch.Generator().manual_seed(case.seed + 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
    return layer.to(case.dtype)


def converted(case: Case, layer: nn.Module) -> nn.Sequential:
    """A one-layer model converted to the case's mode (noise off: never armed)."""
    model = nn.Sequential(copy.deepcopy(layer))
    if case.mode == "backprop":
        bnn.convert_model(model, clipping="backprop", input_clip=case.bound, grad_clip=case.bound,
                          norm=case.conv_norm, clip_fn=case.clip_fn, gamma=case.gamma)
    else:
        bnn.convert_model(model, clipping=case.mode, max_grad_norm=case.bound, clip_fn=case.clip_fn,
                          gamma=case.gamma, norm_method=case.norm_method)
    return model


def _magnitudes(dtype):
    """(huge, tiny, subnormal) entry magnitudes for ``dtype``: huge keeps every per-example sum of
    products finite in the float32 accumulation (so no example is dropped as non-finite, which
    would test the non-finite path instead of the bound); tiny is near the smallest normal."""
    info = torch.finfo(dtype)
    huge = min(info.max / 64, 1e15)
    return huge, info.tiny * 4, info.tiny / 8


def _values(kind: str, shape, dtype, gen, other=False):
    """One example's values of ``kind`` (float64, to be rounded to ``dtype``). ``cancel``: along the
    flattened positions, pairs (v, −2v) for the upstream gradient and (u, u/2) for the input, so
    that their products cancel exactly in the weight gradient (g_1 x_1ᵀ + g_2 x_2ᵀ = 0)."""
    huge, tiny, sub = _magnitudes(dtype)
    z = torch.randn(shape, generator=gen, dtype=F64)
    if kind == "normal":
        return z
    if kind == "scaled":  # up to 1e6 where the dtype holds it (fp16's largest value is 65504)
        top = 3 if dtype == F16 else 6
        return z * 10.0 ** float(torch.randint(-6, top + 1, (1,), generator=gen))
    if kind == "huge":
        return z * huge
    if kind == "tiny":
        return z * tiny
    if kind == "subnormal":
        return z * sub
    if kind == "spike":
        out = z * 1e-3
        out.reshape(-1)[int(torch.randint(out.numel(), (1,), generator=gen))] = 1e3
        return out
    if kind == "zero":
        return torch.zeros(shape, dtype=F64)
    if kind == "offset":  # a large mean and a small spread: the normalisations' cancellation
        return 30.0 + z * 0.5
    # cancel: the last dim holds the features; pair up the positions before it
    scale = 10.0 ** float(torch.randint(-3, 4, (1,), generator=gen))
    if len(shape) >= 3:  # [C, H, W]: positions are H·W, features the channels
        flat = z.reshape(shape[0], -1).clone()
        base = flat[:, :1] * scale
        for t in range(flat.shape[1]):
            flat[:, t:t + 1] = base * ((-2.0 if not other else 0.5) if t % 2 else 1.0)
        return flat.reshape(shape)
    flat = z.reshape(-1, shape[-1]).clone()
    base = flat[:1] * scale
    for t in range(flat.shape[0]):
        flat[t:t + 1] = base * ((-2.0 if not other else 0.5) if t % 2 else 1.0)
    return flat.reshape(shape)


def lay_out(t: torch.Tensor, layout: str, seed: int) -> torch.Tensor:
    """``t`` (values unchanged) in memory layout ``layout``. ``expanded`` and ``broadcast`` need
    values that are constant along the expanded dim (:func:`make_uniform`)."""
    if layout == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "nhwc_view" and t.dim() >= 3:  # a [B, *, C] tensor viewed as [B, C, *] by permute
        order = [0, *range(2, t.dim()), 1]
        return t.permute(order).contiguous().permute([0, t.dim() - 1, *range(1, t.dim() - 1)])
    if layout in ("permuted", "channels_last") and t.dim() >= 2:
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(t.dim(), generator=gen).tolist()
        if perm == list(range(t.dim())):
            perm = perm[::-1]
        inverse = [perm.index(i) for i in range(t.dim())]
        return t.permute(perm).contiguous().permute(inverse)
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "expanded" and t.shape[0] > 0:
        return t[:1].expand(t.shape)
    if layout == "broadcast" and t.dim() >= 2:
        return t.narrow(-1, 0, 1).expand(t.shape)
    if layout == "strided" and t.dim() >= 2:
        big = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    return t.contiguous()


def make_uniform(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The values ``lay_out(·, layout)`` can hold: equal examples for ``expanded``, a constant last
    dim for ``broadcast``."""
    if layout == "expanded" and t.shape[0] > 0:
        return t[:1].expand(t.shape).clone()
    if layout == "broadcast" and t.dim() >= 2:
        return t.narrow(-1, 0, 1).expand(t.shape).clone()
    return t


def inputs(case: Case, layer: nn.Module):
    """(x values, g values) as float64 tensors already rounded to the dtype (x: indices for an
    embedding), before any layout."""
    gen = torch.Generator().manual_seed(case.seed)
    b = case.batch
    if case.kind in INDEXED:
        x = torch.randint(0, case.geometry["vocab"], (b, *case.shape), generator=gen)
        for i, kind in enumerate(case.values_x):
            if kind == "cancel":  # one token throughout: all positions' gradients add in one row
                x[i] = x[i].reshape(-1)[0]
    else:
        x = torch.stack([_values(k, case.shape, case.dtype, gen, other=True) for k in case.values_x])
        x = x.to(case.dtype).double()
    x = make_uniform(x, case.layout)
    with torch.no_grad():
        out_shape = tuple(copy.deepcopy(layer).double()(x[:1]).shape[1:])
    # cancellation needs both sides: an example whose input cancels gets a cancelling gradient
    kinds_g = ["cancel" if kx == "cancel" else kg for kx, kg in zip(case.values_x, case.values_g)]
    g = torch.stack([_values(k, out_shape, case.dtype, gen) for k in kinds_g])
    g = make_uniform(g.to(case.dtype).double(), case.layout_g)
    return x, g


def laid_out(case: Case, x: torch.Tensor, g: torch.Tensor):
    """x and g in the case's dtype and layouts (x: the input the layer gets)."""
    xd = x if case.kind in INDEXED else x.to(case.dtype)
    return lay_out(xd, case.layout, case.seed), lay_out(g.to(case.dtype), case.layout_g, case.seed + 7)


def _allowance_spent(case: Case) -> bool:
    """Half the cases run with the pass's kept allowance (exact.KEPT_BYTES) spent, in the layer's
    release and in :func:`stored` alike, so that the release that recomputes from x and g is fuzzed
    wherever instantiation keeps otherwise."""
    return case.seed % 2 == 1


@contextlib.contextmanager
def _allowance(case: Case):
    """The release's allowance as :func:`_allowance_spent` says: none left (only the memory-neutral
    rule keeps), as :func:`stored`'s spent book. Until the eighteenth session only ``stored`` spent
    it, so in those cases the tie check compared a kept release with the recomputing path's values
    (seed 52: ``RZ(c g)`` of a subnormal ``g`` times an ``x`` of 1e3, against ``RZ(c Σ g x)``)."""
    if not _allowance_spent(case):
        yield
        return
    before = exact.KEPT_BYTES
    exact.KEPT_BYTES = 0
    try:
        yield
    finally:
        exact.KEPT_BYTES = before


def release(model: nn.Sequential, case: Case, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The layer's noise-free release on the batch (x, g) given as float64 values, laid out as the
    case says: ``[∇W, ∇b]`` flattened, read in float64."""
    xl, gl = laid_out(case, x, g)
    model.zero_grad(set_to_none=True)
    with _allowance(case):
        model(xl).backward(gl)
    layer = model[0]
    parts = [layer.weight.grad] + ([layer.bias.grad] if getattr(layer, "bias", None) is not None else [])
    for p in parts:
        assert p is not None and p.dtype == case.dtype, case
    return torch.cat([p.double().reshape(-1) for p in parts])


def truth_grads(case: Case, layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Each example's exact gradient of ``<layer(x_i), g_i>`` in float64 (torch.func), ``[B, P]``."""
    plain = copy.deepcopy(layer).double()
    grads = per_example(plain, x, g)
    names = ["weight"] + (["bias"] if "bias" in grads else [])
    return torch.cat([grads[n].reshape(x.shape[0], -1) for n in names], dim=1)


# ------------------------------------------------------------------------------ the layer's own values


@dataclass
class Stored:
    """What the release holds of each example, in float64: ``contrib`` ``[B, P]`` (``C̃_i``);
    ``terms`` ``[B]``, the Frobenius norm of the sum of the absolute values of the products that
    make up ``C̃_i`` (what the release's accumulation errs relative to: the spread
    ``Σ_t ‖g̃_t‖‖[x̃_t; 1]‖`` of the clipped values for a GEMM over positions, ``‖C̃_i‖`` for a sum of
    formed per-example gradients); ``factor`` ``[B]`` (backprop: ``[B, 2]``, input and gradient);
    the layer's norm ``bound`` ``[B]`` (exact modes); ``gs`` the instantiating layers' stored
    per-example gradient at factor 1; ``kept``: the release sums kept per-example gradients."""

    contrib: torch.Tensor
    terms: torch.Tensor
    factor: torch.Tensor
    bound: torch.Tensor | None = None
    gs: torch.Tensor | None = None
    kept: bool = False


def _geometry(layer):
    if isinstance(layer, nn.Conv1d):  # the clipped Conv1d's own Conv2d geometry (height 1)
        return layer._geometry
    if isinstance(layer, nn.Conv2d):
        return [list(layer.stride), list(layer._explicit_padding), list(layer.dilation), layer.groups]
    return None


def stored(case: Case, model: nn.Sequential, plain: nn.Module, xl: torch.Tensor, gl: torch.Tensor) -> Stored:
    """The layer's clipped values for the batch (xl, gl) as laid out, through the same ops its
    backward runs (clip_rows/scale_rows, the norm ops, exact.factors), multiplied out in float64."""
    layer = model[0]
    plain64 = copy.deepcopy(plain).double()
    b = xl.shape[0]
    scratch = torch.zeros(1, dtype=torch.int64)
    if case.mode == "backprop":
        xs, fx, _ = _ops.clip_rows(xl, scratch, case.bound, "l2", case.clip_fn, case.gamma)
        if case.kind == "conv1d":  # the kernels clip the [B, O, 1, L] view (the l15 norm's layout)
            gs, fg, _ = _ops.clip_rows(gl.unsqueeze(2), scratch, case.bound, _upstream_norm(case), case.clip_fn,
                                       case.gamma)
            gs = gs.squeeze(2)
        else:
            gs, fg, _ = _ops.clip_rows(gl, scratch, case.bound, _upstream_norm(case), case.clip_fn, case.gamma)
        contrib = truth_grads(case, plain, xs.double(), gs.double())
        return Stored(contrib, spread(plain64, xs.double(), gs.double()), torch.stack([fx, fg], 1).double())
    mask = [True, layer.bias is not None]
    if case.kind in GEMM_KINDS:
        xk, gk = (xl.unsqueeze(2), gl.unsqueeze(2)) if case.kind == "conv1d" else (xl, gl)  # the kernels' view
        if case.kind == "conv3d":  # the Linear's: patches [B, T, d], upstream [B, T, O]
            xk, gk = conv3d_layer._patches(layer, xl)[0], gl.flatten(2).transpose(1, 2)
        spent = types.SimpleNamespace(kept_bytes=exact.KEPT_BYTES) if _allowance_spent(case) else None
        bound, kept = exact._norms(layer, xk, gk.contiguous(), _geometry(layer), mask, book=spent)
        factor = exact.factors(bound, case.bound, case.clip_fn, case.gamma, scratch, case.dtype)
        if kept is not None:
            kw, kb = kept
            if case.kind == "hf_conv1d":  # kept in the Linear's [out, in] layout; the release is [in, out]
                kw = kw.reshape(b, *layer.weight.shape[::-1]).transpose(1, 2)
            parts = [kw.double()] + ([kb.double()] if mask[1] else [])
            c = factor.double().unsqueeze(1)
            contrib = torch.cat([c * t.reshape(b, -1) for t in parts], 1)
            return Stored(contrib, contrib.norm(dim=1), factor.double(), bound, kept=True)
        acc = F64 if case.dtype == F64 else F32  # the release scales in the accumulation dtype
        gs = _ops.scale_rows(gl.contiguous().to(acc), factor)
        xs = _ops.scale_rows(xl.to(acc), (factor > 0).to(factor.dtype))
        contrib = truth_grads(case, plain, xs.double(), gs.double())
        return Stored(contrib, spread(plain64, xs.double(), gs.double()), factor.double(), bound)
    # The instantiating layers: their per-example gradients as the backward builds them.
    w, bias = layer.weight.detach(), (layer.bias.detach() if layer.bias is not None else None)
    _, saved = layer._forward(layer._bags(xl, None, None) if case.kind == "embedding_bag" else xl, w, bias, True)
    examples = layer._examples(saved, gl.contiguous(), mask)
    bound = examples.bound(mask)
    factor = exact.factors(bound, case.bound, case.clip_fn, case.gamma, scratch, case.dtype)
    if isinstance(examples, examples_mod.RowExamples):
        dense = torch.zeros(b, layer.num_embeddings, examples.rows.shape[1], dtype=F64)
        dense.index_put_((examples.example, examples.index), examples.rows.double(), accumulate=True)
        scaled = torch.zeros_like(dense)
        scaled.index_put_((examples.example, examples.index),
                          _ops.scale_rows(examples.rows, factor[examples.example]).double(), accumulate=True)
        gs, contrib = dense.reshape(b, -1), scaled.reshape(b, -1)
    else:
        parts = [t for t, m in zip((examples.gw, examples.gb), mask) if m and t is not None]
        gs = torch.cat([t.reshape(b, -1).double() for t in parts], 1)
        contrib = torch.cat([_ops.scale_rows(t.reshape(b, -1), factor).double() for t in parts], 1)
    return Stored(contrib, contrib.norm(dim=1), factor.double(), bound, gs=gs)


# ------------------------------------------------------------------------------ the check


class BoundExceeded(AssertionError):
    """An example's contribution above the bound the noise is scaled to (property 1)."""


class TruthMismatch(AssertionError):
    """The release off the float64 truth by more than the derived tolerance (property 2)."""


def _upstream_norm(case: Case) -> str:
    """The norm backprop clipping takes of the upstream gradient: the case's for a convolution."""
    return case.conv_norm if case.kind in ("conv", "conv1d") else "l2"


def _bound_of(case: Case, model: nn.Sequential, xl: torch.Tensor) -> float:
    layer = model[0]
    if case.mode == "backprop":
        return layer.sensitivity_for(tuple(xl.shape))
    return layer._bp_noise_bound


def check(case: Case, removal: bool = True) -> dict:
    """Runs the case and asserts properties 1 and 2 (module docstring). Returns the worst ratios."""
    assert torch.get_float32_matmul_precision() == "highest", "the margins assume full fp32 GEMMs"
    layer = plain_layer(case)
    model = converted(case, layer)
    x, g = inputs(case, layer)
    xl, gl = laid_out(case, x, g)
    bound = _bound_of(case, model, xl)
    T = positions(case, layer, x)
    full = release(model, case, x, g)
    assert int(model[0]._bp_nonfinite.sum()) == 0, f"finite data counted as non-finite: {case}"
    st = stored(case, model, layer, xl, gl)
    b = case.batch
    out = {"stored": 0.0, "removal": 0.0, "truth": 0.0}

    # 1a. what the release holds of each example, in float64: <= the bound (float64's own error only)
    eval_err = gamma(T + 4, V) * st.terms
    norms = st.contrib.norm(dim=1)
    for i in range(b):
        if norms[i] > bound + float(eval_err[i]) + 4 * V * bound:
            raise BoundExceeded(f"example {i}: stored contribution {float(norms[i]):.9g} = "
                                f"{float(norms[i]) / bound:.6g} x the bound {bound:.9g}\n{case}")
    out["stored"] = float(norms.max() / bound) if b and bound > 0 else 0.0

    # A release beyond the dtype's range rounds to ±inf (a bound such as backprop's Δ = C_g·C_x above
    # fp16's 65504): post-processing of the noised sum, not a leak, but nothing left to compare. Only
    # allowed where the exact sum of the stored contributions is itself out of range there.
    rows = list(range(b))
    if _overflowed(case, st, rows, T, full):
        out["overflow"] = True
        return out

    # the release is the sum of those values, within its own rounding (ties the two together)
    tie = float((full - st.contrib.sum(0)).norm()) if b else float(full.norm())
    assert tie <= release_error(case, st, rows, T) + 4 * V * float(full.norm()), \
        f"release off the sum of the stored contributions by {tie:.3g} > {release_error(case, st, rows, T):.3g}" \
        f"\n{case}"

    # 1b. removal through the layer
    if removal:
        for i in range(b):
            keep = [j for j in rows if j != i]
            part = release(model, case, x[keep], g[keep])
            if _overflowed(case, st, keep, T, part):  # a sub-batch's sum can leave the range the full one is in
                out["overflow"] = True
                continue
            diff = float((full - part).norm())
            tol = release_error(case, st, rows, T) + release_error(case, st, keep, T) + 4 * V * float(full.norm())
            if diff > bound + tol:
                raise BoundExceeded(f"example {i}: removal changes the release by {diff:.9g} = {diff / bound:.6g} x "
                                    f"the bound {bound:.9g} (rounding allowance {tol:.3g})\n{case}")
            out["removal"] = max(out["removal"], diff / bound if bound > 0 else diff)  # Δ = 0: nothing read

    # 2. the release against the float64 truth
    if case.mode == "backprop":
        xt = ref.clip_input(x, case.bound, case.clip_fn, case.gamma)
        gt = ref.clip_upstream(g, case.bound, _upstream_norm(case), case.clip_fn,
                               case.gamma)
        gtrue = truth_grads(case, layer, xt, gt)
        want = gtrue.sum(0)
        # each stored clipped row is RZ(s·row) with s off the exact factor by clip_rows' norm (N
        # entries summed in double: (N + 4)·v), its shrink of C by η_N <= 2(N + 4)·v
        # (csrc/include/bpclip_fast/clip.h) and the factor's roundings (<= 4 of u_acc): relative error
        # dx = (1 + r)(1 + 3(N + 4)v + 4 u_acc) − 1 per row; the bilinear gradient moves by
        # (dx + dg + dx dg)·A, A <= the spread of the true clipped values. global: a row within that of
        # its bound may go either way, moving the gradient by the whole example.
        rows_n = max(x[0].numel(), g[0].numel())
        dx = (1 + RZ[case.dtype]) * (1 + 3 * (rows_n + 4) * V + 4 * acc_unit(case.dtype)) - 1
        spread_t = spread(copy.deepcopy(layer).double(), xt, gt)
        per = (2 * dx + dx * dx) * spread_t
        # below the normal range RZ loses up to one subnormal step per entry, absolutely: a change δ of
        # the clipped gradient moves G by <= Σ_t ‖δ_t‖‖[P_t(x̃); 1]‖ <= ‖δ‖_1 √(‖x̃‖² + 1) (a patch holds
        # distinct entries), and a change δ of x̃ by <= Σ_t ‖g̃_t‖‖P_t(δ)‖ <= ‖g̃‖_1 ‖δ‖
        step = subnormal_step(case.dtype)
        b_ = x.shape[0]
        xn = xt.reshape(b_, -1).norm(dim=1) * (1 + dx)
        g1 = gt.reshape(b_, -1).abs().sum(1) * (1 + dx)
        ng, nx = gt[0].numel(), xt[0].numel()
        per = per + ng * step * (xn + math.sqrt(nx) * step + 1) + g1 * math.sqrt(nx) * step
        if case.clip_fn == "global":
            norm = _upstream_norm(case)
            nx = ref.l2_norm(x)
            ng = ref.l2_norm(g) if norm == "l2" else ref.l15_norm(g)
            edge = ((nx - case.bound).abs() <= 4 * dx * case.bound) | ((ng - case.bound).abs() <= 4 * dx * case.bound)
            per = per + edge.double() * (truth_grads(case, layer, x, g).norm(dim=1) + spread_t)
        tol = release_error(case, st, rows, T) + float(per.sum())
    else:
        gtrue = truth_grads(case, layer, x, g)
        n = gtrue.norm(dim=1)
        c = eo.clip_factor(n, case.bound, case.clip_fn, case.gamma)
        want = (c.unsqueeze(1) * gtrue).sum(0)
        if case.kind in GEMM_KINDS:
            P = spread(copy.deepcopy(layer).double(), x, g)
            d, p = _dims(case)
            pX = spread(copy.deepcopy(layer).double(), x, torch.ones_like(g))  # √p·Σ_t ‖[x_t; 1]‖
            xn, gn = position_norms64(copy.deepcopy(layer).double(), x.double(), g.double())
            Pb, pXb, sums = bounded_terms(case, T, d, p, xn, gn)
            margin = norm_margin(case, T, d, p, torch.maximum(P, Pb), n, torch.maximum(pX, pXb), sums)
            # the proof's bound is >= the exact norm with no exception (underflow included, csrc/exact.cpp):
            # only float64's own error in n, which sums <= T² + dp + 4 terms bounded by P², is allowed
            low = n - gamma(T * T + d * p + 4, V) * P
            assert (st.bound >= low).all(), f"norm bound {st.bound.tolist()} below the norm {n.tolist()}\n{case}"
            assert (st.bound <= n + margin).all(), \
                f"norm bound {st.bound.tolist()} above the norm {n.tolist()} + margin {margin.tolist()}\n{case}"
            # the release holds Σ_t RZ(c·g_t)[x_t; 1]ᵀ with c·g rounded toward zero to the accumulation
            # dtype: relative r per entry, and below the normal range one subnormal step absolutely,
            # which moves the example's part by <= q·√p·X (csrc/exact.cpp)
            acc = F64 if case.dtype == F64 else F32
            held = st.factor * (RZ[acc] + gamma(T + 2, V)) * P + subnormal_step(acc) * pX
            per = held + factor_change(case, st.bound, n, case.bound)
        else:
            delta = example_error(case, x, g, gtrue)
            ns = st.gs.norm(dim=1)
            gap = (st.gs - gtrue).norm(dim=1)
            assert (gap <= delta + 4 * V * ns).all(), \
                f"stored per-example gradients off the truth by {gap.tolist()} > {delta.tolist()}\n{case}"
            # the squares the bound sums: an embedding's rows are summed over its positions
            terms = case.geometry["dim"] * math.prod(case.shape) if case.kind in INDEXED else st.gs.shape[1]
            # (float64 squares of float64 data below ~1e-154 underflow: up to terms·tiny lost in ŝ)
            under = math.sqrt(terms * torch.finfo(F64).tiny)
            within = (st.bound >= ns * (1 - 4 * V) - under) & (st.bound <= ns + dense_margin(terms, ns) + under)
            assert within.all(), \
                f"norm bound {st.bound.tolist()} not within its margin of the stored norm {ns.tolist()}\n{case}"
            # the factor from the stored norm's bound instead of the true norm (|ns − n| <= delta),
            # the stored gradient's own error, and RZ(c·G) (relative r)
            worst = torch.maximum(factor_change(case, st.bound, n, case.bound),
                                  factor_change(case, (n + delta), n, case.bound))
            worst = torch.maximum(worst, factor_change(case, (n - delta).clamp(min=0), n, case.bound))
            # RZ(c·G) to the dtype: relative r, and below the normal range one subnormal step per entry
            rz_abs = math.sqrt(st.gs.shape[1]) * subnormal_step(case.dtype)
            per = st.factor * (delta + RZ[case.dtype] * ns) + rz_abs + worst + (st.factor - c).abs() * delta
            per = torch.where(delta.isinf(), torch.full_like(per, math.inf), per)  # not comparable
        tol = release_error(case, st, rows, T) + float(per.sum())
    off = float((full - want).norm())
    tol = tol + 8 * V * (float(want.norm()) + float(full.norm()))
    if not off <= tol:
        raise TruthMismatch(f"release off the float64 truth by {off:.6g} > derived tolerance {tol:.6g} "
                            f"(|truth| {float(want.norm()):.6g})\n{case}")
    out["truth"] = off / tol if tol > 0 else 0.0
    return out


def _overflowed(case: Case, st: Stored, rows, T: int, rel: torch.Tensor) -> bool:
    """Whether the release ``rel`` of ``rows`` is non-finite, asserting it may be: only coordinates
    whose exact sum of stored contributions is (within the release's rounding) beyond the dtype's
    largest value may round to ±inf."""
    over = ~torch.isfinite(rel)
    if not over.any():
        return False
    top = torch.finfo(case.dtype).max
    exact_sum = st.contrib[rows].sum(0).abs()
    assert (exact_sum[over] >= top - release_error(case, st, rows, T)).all(), \
        f"a non-finite release where the exact sum is within the dtype's range\n{case}"
    return True


def _dims(case: Case):
    """(d, p): the input and output widths of one channel group's weight block."""
    g = case.geometry
    if case.kind in ("linear", "hf_conv1d"):
        return g["fin"], g["fout"]
    if case.kind == "conv1d":
        return g["cin"] // g["groups"] * g["kernel"], g["cout"] // g["groups"]
    if case.kind == "conv3d":
        return g["cin"] * math.prod(g["kernel"]), g["cout"]
    kh, kw = g["kernel"]
    return g["cin"] // g["groups"] * kh * kw, g["cout"] // g["groups"]


def _instance(t):
    return {nn.Linear: lambda: nn.Linear(1, 1), nn.Conv2d: lambda: nn.Conv2d(1, 1, 1),
            nn.LayerNorm: lambda: nn.LayerNorm(1), nn.GroupNorm: lambda: nn.GroupNorm(1, 1),
            nn.RMSNorm: lambda: nn.RMSNorm(1), nn.InstanceNorm1d: lambda: nn.InstanceNorm1d(1, affine=True),
            nn.InstanceNorm2d: lambda: nn.InstanceNorm2d(1, affine=True),
            nn.InstanceNorm3d: lambda: nn.InstanceNorm3d(1, affine=True),
            nn.Embedding: lambda: nn.Embedding(1, 1),
            modules.PositionalEmbedding: lambda: modules.PositionalEmbedding(1),
            modules.ClassToken: lambda: modules.ClassToken(1),
            nn.EmbeddingBag: lambda: nn.EmbeddingBag(1, 1), nn.Conv1d: lambda: nn.Conv1d(1, 1, 1),
            nn.Conv3d: lambda: nn.Conv3d(1, 1, 1),
            HFConv1D: lambda: HFConv1D(1, 1)}[t]()


def modes_of(kind: str) -> tuple:
    return registry.layer_type(_instance(TORCH_TYPE[kind])).modes


def largest_spread(case: Case) -> float:
    """The largest per-example spread ``Σ_t ‖g_t‖‖[x_t; 1]‖`` of the case's data (an upper bound on
    every per-example gradient entry and norm): what decides whether float32 squares overflow."""
    layer = plain_layer(case)
    x, g = inputs(case, layer)
    if not case.batch or case.kind not in GEMM_KINDS:
        return 0.0
    return float(spread(copy.deepcopy(layer).double(), x, g).max())
