"""``nn.MultiheadAttention`` through the fused exact Linear path (issue 26; bpclip_fast/layers/attention.py).

* Exactness: the release of a never-armed converted model (no noise, no scaling) equals
  ``Σ_i clip(G_i)`` with ``G_i`` example i's gradient from torch's own ``nn.MultiheadAttention``
  run on that example alone in float64, flat and per_layer, batch_first or not, self- and
  cross-attention (``in_proj_weight``'s rows used on different inputs: one parameter, one norm),
  key_padding_mask, a causal attn_mask, add_zero_attn, batches of 4 and 1.
* Conversion: no generic unit is left, the state_dict keys and the Parameter objects are torch's.
* nn.TransformerEncoderLayer / DecoderLayer through make_private; the configurations that stay
  generic (separate q/k/v weights, bias_k/bias_v) are still exact; backprop refuses.

Tolerance: everything runs in float64. Each released entry is a sum over the B examples of c_i
times an entry of G_i, itself a sum of at most K = (L + 2S)·E·heads products through a chain of at
most D = 12 floating-point stages (projection, scores, softmax, weights·v, out_proj and their
backward); the relative error of such a chain is below D·K·u (u = 2^-53) of the sum of absolute
values, which ``Σ_i |c_i G_i|`` bounds up to the chain's absolute values: we use that scale with
D·K·u·16 (16 covering the absolute values' growth through softmax, whose entries are ≤ 1, and
the norm and factor of the clip, each one rounding). A wrong unit (the rows of in_proj clipped per
use, a missing use) is off by a fraction of ‖release‖, ~10^10 times this.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from bpclip_fast import PrivacyEngine, registry
from bpclip_fast import nn as bnn
from bpclip_fast.engine import InsecureSeedWarning
from bpclip_fast.layers.attention import MultiheadAttention

F64 = torch.float64
U64 = 2.0 ** -53
E, H, L, S = 8, 2, 5, 4


class Attn(nn.Module):
    """One attention, its output through a Linear head: ``kind`` picks how it is called."""

    def __init__(self, kind, batch_first, **kw):
        super().__init__()
        self.kind, self.batch_first = kind, batch_first
        self.attn = nn.MultiheadAttention(E, H, batch_first=batch_first, **kw)
        self.head = nn.Linear(E, 3)

    def forward(self, x, mem):
        if not self.batch_first:
            x, mem = x.transpose(0, 1), mem.transpose(0, 1)
        keys = x if self.kind == "self" else mem
        keys = keys if self.batch_first else keys.transpose(0, 1)
        kpm = torch.zeros(keys.shape[:2], dtype=torch.bool)
        kpm[:, -1] = keys[:, 0, 0] > 0  # per example (from its own data): its last key masked or not
        if self.kind == "self":
            mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=x.dtype).isinf()  # bool, as kpm
            out = self.attn(x, x, x, key_padding_mask=kpm, attn_mask=mask, is_causal=True)[0]
        elif self.kind == "cross":  # the decoder's: key is value
            out = self.attn(x, mem, mem, key_padding_mask=kpm)[0]
        else:  # three different inputs
            out = self.attn(x, mem, mem * 2 - 1, key_padding_mask=kpm, need_weights=False)[0]
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out)


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, L, E, generator=g, dtype=F64)
    mem = torch.randn(n, S, E, generator=g, dtype=F64)
    up = torch.randn(n, L, 3, generator=g, dtype=F64)
    up *= torch.logspace(-2, 2, n, base=2, dtype=F64).view(-1, 1, 1) if n > 1 else 1  # some clipped, some not
    return x, mem, up


def truth(model, args, up, groups):
    """``{param id: Σ_i clip(G_i)}`` and ``Σ_i |clip(G_i)|``, each example alone in a float64 copy of
    the torch model; ``groups``: [(params, C)] (flat: one group)."""
    ref = copy.deepcopy(model).double()
    ids = [id(p) for p in model.parameters()]
    per = {i: [] for i in ids}
    for b in range(up.shape[0]):
        ref.zero_grad(set_to_none=True)
        (ref(*(a[b:b + 1] for a in args)) * up[b:b + 1]).sum().backward()
        for i, p in zip(ids, ref.parameters()):
            per[i].append(p.grad.clone())
    per = {i: torch.stack(v) for i, v in per.items()}
    total, scale = {}, {}
    for params, C in groups:
        norm = torch.sqrt(sum(per[id(p)].pow(2).flatten(1).sum(1) for p in params))
        c = torch.clamp(C / norm, max=1.0)
        for p in params:
            term = c.view(-1, *[1] * (p.dim())) * per[id(p)]
            total[id(p)], scale[id(p)] = term.sum(0), term.abs().sum(0)
    return total, scale


def groups(model, mode, C):
    if mode == "flat":
        return [([p for p in model.parameters()], C)]
    return [([p for p in (layer.weight, layer.bias) if p is not None], layer.max_grad_norm)
            for _, layer in bnn.clipped_layers(model)]


def check_release(model, converted, args, up, mode, C):
    """The converted model's noise-free release against the float64 truth (module docstring)."""
    out = converted(*args)
    (out * up).sum().backward()
    torch_of = {id(q): p for q, p in zip(converted.parameters(), model.parameters())}  # the same order
    units = [([torch_of[id(q)] for q in params], c) for params, c in groups(converted, mode, C)]
    want, scale = truth(model, args, up, units)
    K = (L + 2 * S) * E * H
    for q in converted.parameters():
        p = torch_of[id(q)]
        assert p.shape == q.shape
        tol = 12 * K * U64 * 16 * (scale[id(p)] + scale[id(p)].max())
        assert ((q.grad - want[id(p)]).abs() <= tol).all(), (p.shape, (q.grad - want[id(p)]).abs().max())
    return {id(q): want[id(torch_of[id(q)])] for q in converted.parameters()}


def make(kind, batch_first, seed=0, **kw):
    torch.manual_seed(seed)
    return Attn(kind, batch_first, dropout=0.0, **kw).double()


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", ["self", "cross", "qkv"])
@pytest.mark.parametrize("n", [4, 1])
def test_release_equals_float64_truth(mode, batch_first, kind, n):
    model = make(kind, batch_first)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    converted = bnn.convert_model(copy.deepcopy(model), clipping=mode, max_grad_norm=0.5)
    assert type(converted.attn) is MultiheadAttention
    assert type(converted.attn.in_proj) is bnn.Linear and type(converted.attn.out_proj) is bnn.Linear
    assert not registry.generic_units(converted)
    x, mem, up = data(n)
    check_release(model, converted, (x, mem), up, mode, 0.5)
    # the same model converted in place keeps torch's keys and Parameter objects
    bnn.convert_model(model, clipping=mode, max_grad_norm=0.5)
    assert list(model.state_dict()) == keys
    assert [id(p) for p in model.parameters()] == params


def test_one_norm_over_the_uses_of_in_proj():
    """Cross-attention: clipping the query rows and the key/value rows of in_proj_weight as separate
    units gives another release than the truth (so the check above can tell them apart)."""
    model = make("qkv", True)
    converted = bnn.convert_model(copy.deepcopy(model), clipping="per_layer", max_grad_norm=0.05)
    x, mem, up = data(4)
    want = check_release(model, converted, (x, mem), up, "per_layer", 0.05)
    w = converted.attn.in_proj.weight
    split = truth(model, (x, mem), up, [([model.attn.in_proj_weight], 1.0)])[0][id(model.attn.in_proj_weight)]
    assert (split - want[id(w)]).abs().max() > 1e-3 * want[id(w)].abs().max()


@pytest.mark.parametrize("batch_first", [True, False])
def test_add_zero_attn_and_forward_equal_torch(batch_first):
    model = make("cross", batch_first, add_zero_attn=True)
    converted = bnn.convert_model(copy.deepcopy(model), clipping="flat", max_grad_norm=0.5)
    x, mem, up = data(3)
    assert torch.allclose(converted(x, mem), model(x, mem), rtol=0, atol=1e-12)
    check_release(model, converted, (x, mem), up, "flat", 0.5)


def test_dropout_same_seed_same_output():
    torch.manual_seed(0)
    model = nn.MultiheadAttention(E, H, dropout=0.3, batch_first=True).double()
    converted = bnn.convert_model(copy.deepcopy(model), clipping="per_layer", max_grad_norm=1.0)
    x = data(3)[0]
    torch.manual_seed(7)
    a, wa = model(x, x, x)
    torch.manual_seed(7)
    b, wb = converted(x, x, x)
    assert torch.allclose(a, b, rtol=0, atol=1e-12) and torch.allclose(wa, wb, rtol=0, atol=1e-12)


def test_state_dict_loads_both_ways():
    torch.manual_seed(0)
    model = nn.MultiheadAttention(E, H, batch_first=True)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    bnn.convert_model(model, clipping="flat", max_grad_norm=1.0)
    assert list(model.state_dict()) == ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]
    model.load_state_dict(other.state_dict())
    assert torch.equal(model.in_proj_weight, other.in_proj_weight)
    fresh = nn.MultiheadAttention(E, H, batch_first=True)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.in_proj_weight, other.in_proj_weight)


class UserMHA(nn.MultiheadAttention):
    pass


@pytest.mark.parametrize("build", [lambda: nn.MultiheadAttention(E, H, kdim=3, vdim=5, batch_first=True),
                                   lambda: nn.MultiheadAttention(E, H, add_bias_kv=True, batch_first=True),
                                   lambda: UserMHA(E, H, batch_first=True)],
                         ids=["kdim-vdim", "bias_kv", "subclass"])
def test_the_rest_stays_generic_and_exact(build):
    torch.manual_seed(0)
    mha = build().double()
    model = nn.Sequential()
    model.attn = mha
    converted = bnn.convert_model(copy.deepcopy(mha), clipping="flat", max_grad_norm=0.5)
    assert registry.is_generic(converted)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, L, E, generator=g, dtype=F64)
    k = torch.randn(3, S, mha.kdim, generator=g, dtype=F64)
    v = torch.randn(3, S, mha.vdim, generator=g, dtype=F64)
    up = torch.randn(3, L, E, generator=g, dtype=F64) * torch.tensor([0.1, 1, 10], dtype=F64).view(-1, 1, 1)

    class Call(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, k, v):
            return self.m(x, k, v)[0]

    ref, conv = Call(mha), Call(converted)
    (conv(x, k, v) * up).sum().backward()
    want, scale = truth(ref, (x, k, v), up, [(list(ref.parameters()), 0.5)])
    K = (L + 2 * S) * E * H
    for p, q in zip(ref.parameters(), conv.parameters()):
        assert ((q.grad - want[id(p)]).abs() <= 12 * K * U64 * 16 * (scale[id(p)] + scale[id(p)].max())).all()


def test_backprop_refuses_attention():
    with pytest.raises(ValueError, match="0 \\(MultiheadAttention\\): clipping='backprop' has no proved bound"):
        bnn.convert_model(nn.Sequential(nn.MultiheadAttention(E, H)), clipping="backprop", input_clip=1.0,
                          grad_clip=1.0)


class Seq(nn.Module):
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder
        layer = (nn.TransformerDecoderLayer if decoder else nn.TransformerEncoderLayer)(
            E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.block, self.head = layer, nn.Linear(E, 3)

    def forward(self, x):
        if self.decoder:
            mem = x.flip(1)[:, :S] * 0.5
            return self.head(self.block(x, mem, tgt_is_causal=False).mean(1))
        return self.head(self.block(x).mean(1))


SIGMA = 1e-12  # make_private needs σ > 0: small enough for the comparison, bounded in its tolerance


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_transformer_layers_through_make_private(decoder, mode):
    torch.manual_seed(0)
    model = Seq(decoder).double()
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, L, E, generator=g, dtype=F64)
    y = torch.randint(0, 3, (6,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():  # an explicit seed: the Poisson batch below is then fixed (an OS seed
        warnings.simplefilter("ignore", InsecureSeedWarning)  # left it empty 1.6% of the time)
        model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader,
                                                          noise_multiplier=SIGMA, max_grad_norm=1.0, clipping=mode,
                                                          loss_reduction="sum", noise_seed=11)
    inner = model
    assert not registry.generic_units(inner)
    attns = [m for m in inner.modules() if isinstance(m, nn.MultiheadAttention)]
    assert attns and all(type(m) is MultiheadAttention for m in attns)
    assert list(inner.state_dict()) == keys
    xb, yb = next(iter(loader))  # Poisson-sampled from the explicit seed: not empty
    assert len(xb) > 0
    opt.zero_grad()
    nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
    names = {id(p): n for n, p in inner.named_parameters()}
    grads = {names[id(p)]: p.grad.clone() for p in inner.parameters()}
    # float64 truth: per example alone in the torch model
    per = {n: [] for n, _ in ref.named_parameters()}
    for b in range(len(xb)):
        ref.zero_grad()
        nn.functional.cross_entropy(ref(xb[b:b + 1]), yb[b:b + 1], reduction="sum").backward()
        for n, p in ref.named_parameters():
            per[n].append(p.grad.clone())
    by_torch = dict(zip([n for n, _ in ref.named_parameters()], [names[id(p)] for p in inner.parameters()]))
    if mode == "flat":
        units = [(list(per), 1.0)]
    else:
        torch_of = {v: k for k, v in by_torch.items()}
        units = [([torch_of[names[id(p)]] for p in (l.weight, l.bias) if p is not None], l.max_grad_norm)
                 for _, l in bnn.clipped_layers(inner)]
    per = {n: torch.stack(v) for n, v in per.items()}
    for params, C in units:
        norm = torch.sqrt(sum(per[n].pow(2).flatten(1).sum(1) for n in params))
        c = torch.clamp(C / norm, max=1.0)
        for n in params:
            term = c.view(-1, *[1] * (per[n].dim() - 1)) * per[n]
            # the rounding of check_release, and the noise: N(0, (σC)²) per entry stays below 10σC
            tol = 12 * (L + 2 * S) * E * H * U64 * 16 * (term.abs().sum(0) + term.abs().max()) + 10 * SIGMA
            assert ((grads[by_torch[n]] - term.sum(0)).abs() <= tol).all(), n
