"""Fused exact paths for ``nn.Conv1d`` and Hugging Face's ``Conv1D`` (issue 26).

Before, both were trained by the generic exact path (a vectorised backward per chunk of examples);
now they are registered layer types (bpclip_fast/layers/conv1d.py, hf_conv1d.py) that run the fused
Conv2d (kernel height 1) and Linear (transposed weight) kernels, the release mapped back into the
parameter's own layout (bpclip_fast.exact.kernel_weight / _param_layout).

* Exactness: a zero-noise release (never armed) equals ``Σ_i clip(G_i, C)`` with ``G_i`` computed by
  running each example alone through a float64 copy of the torch module, in flat and per_layer,
  float32 and bfloat16 parameters, stride 2, padding 'same' (even and odd totals), dilation 2,
  groups 2, no bias, a batch of one and a non-contiguous input. The model is
  ``layer -> PositionalEmbedding`` with the loss ``<out, G>``, so both layers' upstream gradient is
  ``G`` exactly in every dtype and flat clips two layers' norms together.
* The input gradient is torch's (from the unclipped upstream gradient).
* A tiny GPT-2 (untied embeddings) through ``PrivacyEngine.make_private``: every Conv1D is fused, no
  generic unit is left, and the step's gradients equal per-example clipping in float64.
* Refusals: backpropagation clipping (HF's Conv1D), padding modes other than zeros.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine, modules, registry
from bpclip_fast import nn as bnn

import fused_release as fr
from fused_release import F64

tf = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from bpclip_fast.layers import hf_conv1d  # noqa: E402  (registered once transformers is imported)


# kind -> (torch module in float64, per-example input shape)
KINDS = {
    "stride2": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1), (3, 9)),
    "same-odd-kernel": (lambda: nn.Conv1d(3, 4, 5, padding="same"), (3, 7)),
    "same-even-kernel": (lambda: nn.Conv1d(3, 4, 4, padding="same"), (3, 7)),  # one more zero on the right
    "valid": (lambda: nn.Conv1d(3, 2, 3, padding="valid"), (3, 6)),
    "dilation2": (lambda: nn.Conv1d(3, 4, 3, dilation=2, padding=2), (3, 8)),
    "groups2": (lambda: nn.Conv1d(4, 6, 3, groups=2), (4, 7)),
    "no-bias": (lambda: nn.Conv1d(3, 4, 2, stride=3, bias=False), (3, 10)),
    "hf-conv1d": (lambda: Conv1D(5, 4), (3, 4)),
    "hf-conv1d-2d": (lambda: Conv1D(3, 6), (6,)),
}


def _layer(kind):
    return fr.layer_of(KINDS, kind)


def _check(kind, mode, dtype, n, contiguous=True):
    return fr.check(KINDS, _scale, kind, mode, dtype, n, contiguous)


def _scale(layer, xi, gi):
    """An upper bound on the Frobenius norm of the absolute products that make example i's gradient
    of the layer: each weight entry sums ``|g_{o,t}|·|x entry|`` over positions t, and a patch
    repeats an input entry at most ``taps`` times (the kernel's width; 1 for Conv1D), so the weight's
    is ``√taps·‖g_i‖·‖x_i‖``; the bias sums ``|g_{o,t}|`` over ``rows`` positions: ``√rows·‖g_i‖``."""
    gn, xn = float(gi.double().norm()), float(xi.double().norm())
    taps = layer.weight[0, 0].numel() if isinstance(layer, nn.Conv1d) else 1
    out_features = layer.weight.shape[0] if isinstance(layer, nn.Conv1d) else layer.weight.shape[1]
    s = math.sqrt(taps) * gn * xn
    if layer.bias is not None:
        s += math.sqrt(gi.numel() // out_features) * gn
    return s + gn  # + the PositionalEmbedding's own gradient, g_i itself


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_release_equals_the_clipped_sum_of_examples_run_alone_in_float64(kind, mode, dtype):
    _check(kind, mode, dtype, n=5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_batch_of_one(kind):
    _check(kind, "flat", torch.float32, n=1)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_non_contiguous_input(kind):
    _check(kind, "per_layer", torch.float32, n=4, contiguous=False)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_clipped_layer_computes_the_torch_forward_and_input_gradient(kind):
    fr.check_forward(KINDS, kind)


# ---------------------------------------------------------------------------------------- GPT-2


class _LastLogits(nn.Module):
    """The last position's logits of a causal LM, with the positions given per example."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        return self.model(input_ids=ids, position_ids=pos).logits[:, -1, :3]


SIGMA = 1e-16


def _gpt2():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                               tie_word_embeddings=False, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                               bos_token_id=0, eos_token_id=0)
        return _LastLogits(tf.GPT2LMHeadModel(config))


def test_gpt2_conv1d_is_fused_and_its_private_step_is_per_example_clipping():
    """Untied GPT-2 (tied embeddings make the whole model one generic unit: one parameter, two uses)
    made private in float64 with negligible noise (the engine needs σ > 0): every Conv1D becomes the fused layer, no generic unit
    is left, and each gradient before the step equals Σ_i clip(G_i, C) with G_i from a batch of one."""
    torch.manual_seed(0)
    model = _gpt2().double()
    reference = copy.deepcopy(model)
    n_conv = sum(type(m) is Conv1D for m in model.modules())
    assert n_conv == 8
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, 100, (12, 10), generator=gen), torch.randint(0, 3, (12,), generator=gen))
    C = 0.05  # below every example's gradient norm here: each one is clipped
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=6), noise_multiplier=SIGMA,
            max_grad_norm=C, clipping="flat", loss_reduction="sum", noise_seed=7)
    fused = [m for m in model.modules() if type(m) is hf_conv1d.Conv1D]
    assert len(fused) == n_conv
    assert not any(registry.is_generic(m) for m in model.modules())
    ids, y = next(iter(loader))
    assert ids.shape[0] > 1
    opt.zero_grad()
    nn.functional.cross_entropy(model(ids), y, reduction="sum").backward()
    names = {id(p): n for n, p in model.named_parameters()}
    got = {names[id(p)]: p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None}
    truth = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for i in range(ids.shape[0]):
        reference.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(reference(ids[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        params = dict(reference.named_parameters())
        norm = math.sqrt(sum(float(p.grad.square().sum()) for p in params.values() if p.grad is not None))
        assert norm > C
        for n, p in params.items():
            if p.grad is not None:
                truth[n] += p.grad * min(1.0, C / norm)
    # float64 both ways through a transformer's backward (as tests/test_hf.py): ≤ ~10³ roundings per
    # entry, each within an ulp of magnitudes that scale with an example's clipped gradient (≤ C); and
    # the noise, std σC per entry: 10 std (a fixed seed; exceeded with probability ~1e-23 per entry)
    eps64 = torch.finfo(F64).eps
    tol = 1000 * eps64 * ids.shape[0] * C + 10 * SIGMA * C
    for n, p in model.named_parameters():
        assert n in got, n
        assert torch.all((got[n] - truth[n]).abs() <= tol), n


# ---------------------------------------------------------------------------------------- refusals


def test_backprop_clipping_is_refused_naming_the_exact_modes():
    """HF's Conv1D only: nn.Conv1d has backprop clipping (tests/test_backprop_conv1d.py)."""
    with pytest.raises(ValueError, match="clipping='backprop' has no proved bound.*'flat' or 'per_layer'"):
        hf_conv1d.Conv1D(4, 3)
    assert hf_conv1d.Conv1D(4, 3, clipping="flat", max_grad_norm=1.0).clipping == "flat"


def test_backprop_conversion_of_a_model_with_conv1d_needs_the_backprop_bounds():
    with pytest.raises(TypeError, match="Conv1d: clipping='backprop' needs input_clip and grad_clip"):
        bnn.Conv1d(2, 2, 3)
    layer = bnn.convert_model(nn.Sequential(nn.Conv1d(2, 2, 3)), clipping="backprop", input_clip=1.0, grad_clip=1.0)[0]
    assert type(layer) is bnn.Conv1d and layer.clipping == "backprop" and layer.norm == "l15"


@pytest.mark.parametrize("mode", ["reflect", "circular", "replicate"])
def test_padding_modes_other_than_zeros_are_refused(mode):
    with pytest.raises(ValueError, match=f"0 \\(Conv1d\\): padding_mode='{mode}'.*torch.nn.functional.pad"):
        bnn.convert_model(nn.Sequential(nn.Conv1d(2, 2, 3, padding=1, padding_mode=mode)), clipping="flat",
                          max_grad_norm=1.0)
    with pytest.raises(ValueError, match=f"padding_mode='{mode}' is not supported"):
        bnn.Conv1d(2, 2, 3, padding=1, padding_mode=mode, clipping="flat", max_grad_norm=1.0)


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_compiled_release_is_per_example_clipping(mode):
    """Under torch.compile (aot_eager: the custom ops' fake kernels and autograd, no codegen) the fused
    layers' weights are mapped too: float64 model, release against float64 per-example clipping
    (a few dozen roundings of float64 per entry, relative to the clipped gradients' scale)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 6, 3, padding=1, groups=2), nn.Flatten(1), Conv1D(5, 6 * 8)).double()
    x = torch.randn(3, 4, 8, dtype=F64, generator=torch.Generator().manual_seed(6))
    grads = {}
    for i in range(3):
        ref = copy.deepcopy(model)
        ref(x[i:i + 1]).square().sum().backward()
        for n, p in ref.named_parameters():
            grads.setdefault(n, []).append(p.grad)
    grads = {n: torch.stack(v) for n, v in grads.items()}
    norm = torch.sqrt(sum(v.flatten(1).square().sum(1) for v in grads.values()))
    C = float(norm.median())
    ours = bnn.convert_model(copy.deepcopy(model), clipping=mode, max_grad_norm=C if mode == "flat" else [C, C])
    assert type(ours[2]) is hf_conv1d.Conv1D
    torch.compile(ours, backend="aot_eager")(x).square().sum().backward()
    if mode == "flat":
        factors = {n: torch.clamp(C / norm, max=1.0) for n in grads}
    else:
        per = {k: torch.sqrt(sum(grads[n].flatten(1).square().sum(1) for n in grads if n.startswith(k)))
               for k in ("0.", "2.")}
        factors = {n: torch.clamp(C / per[n[:2]], max=1.0) for n in grads}
    for n, p in ours.named_parameters():
        want = (grads[n] * factors[n].reshape(-1, *[1] * (grads[n].dim() - 1))).sum(0)
        torch.testing.assert_close(p.grad, want, rtol=0, atol=1e-12 * C)
