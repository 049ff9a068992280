"""The layer types whose per-example gradients are instantiated (issue 15): LayerNorm, GroupNorm,
Embedding (through index equality), PositionalEmbedding and ClassToken, under ``flat`` and
``per_layer`` clipping.

* Exactness (noise off, float64): our release equals the clipped sum of torch.func per-example
  gradients (tests/exact_oracle.py) and Opacus' own per-sample clipping (its grad samplers for
  LayerNorm, GroupNorm, Embedding and Linear; functorch for our two modules, which it does not know).
* Bounds: removing one example changes the release by at most ``C`` (flat, over all layers) or
  ``C_l`` (per layer), on ordinary, huge and repeated-token examples; one example's release is
  within ``C`` exactly (fractions) from the stored values in fp32/bf16/fp16.
* Refusals: backprop clipping, Embedding options that mix examples or edit the table, bad inputs.
* Through the engine: the noise on every new parameter has std ``σC/B̄``.
"""

from __future__ import annotations

import copy
import math
import warnings
from fractions import Fraction

import pytest
import torch
from torch import nn

import bpclip_fast
import bpclip_fast.models
from bpclip_fast import modules
from bpclip_fast import nn as bnn
import exact_oracle as eo

VOCAB, DIM, TOKENS = 13, 8, 4


class AllTypes(nn.Module):
    """Token ids ``[B, TOKENS]`` -> 5 logits, through every new type and a Linear head. GroupNorm
    runs on the sequence as ``[B, DIM, TOKENS + 1]`` channels."""

    def __init__(self, groups=2, padding_idx=0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
        self.cls = modules.ClassToken(DIM)
        self.pos = modules.PositionalEmbedding(TOKENS + 1, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.gn = nn.GroupNorm(groups, DIM)
        self.head = nn.Linear(DIM, 5)

    def forward(self, idx):
        h = self.pos(self.cls(self.emb(idx)))
        h = torch.tanh(self.ln(h))
        h = self.gn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h.mean(1))


def tokens(n, seed=0):
    """Ids with repeats inside an example (the index-equality norm) and padding (no gradient)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, VOCAB, (n, TOKENS), generator=g)
    idx[0, 1] = idx[0, 0]  # a repeated token
    if n > 1:
        idx[1, :2] = 0  # padding
    return idx


def perturbed(net, seed=0):
    """Non-trivial affine parameters (torch initialises them to 1 and 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return net


def ours(net, x, y, clipping, c, **kw):
    model = copy.deepcopy(net)
    bnn.convert_model(model, clipping=clipping, max_grad_norm=c, **kw)
    eo.sum_cross_entropy(model(x), y).backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, scale, what):
    assert a.keys() == b.keys(), what
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-8, atol=1e-10 * scale, msg=f"{what}: {k}")


@pytest.mark.parametrize("n", [1, 3])
def test_flat_equals_the_oracle_and_opacus(n):
    pytest.importorskip("opacus")
    torch.manual_seed(0)
    net = perturbed(AllTypes()).double()
    x, y = tokens(n), torch.arange(n) % 5
    per_ex = eo.per_example_grads(net, x, y)
    groups = eo.layer_groups(net)
    norms = sum(v.flatten(1).pow(2).sum(1) for v in per_ex.values()).sqrt()
    c = 0.5 * float(norms.min()) if n == 1 else float(norms.median())  # some examples clipped, some not
    got = ours(net, x, y, "flat", c)
    assert_same(got, eo.clipped_sum(per_ex, groups, c, "flat").sums, c, "oracle")
    # Opacus' embedding grad sampler gives the padding row a gradient (torch gives it none), so its
    # side runs without padding_idx (id 0 then is an ordinary token, read by example 1).
    free = AllTypes(padding_idx=None).double()
    free.load_state_dict(net.state_dict())
    per_ex = eo.per_example_grads(free, x, y)
    want = eo.clipped_sum(per_ex, groups, c, "flat").sums
    assert_same(ours(free, x, y, "flat", c), want, c, "oracle, no padding")
    opacus = eo.opacus_clipped_sum(free, x, y, eo.sum_cross_entropy, c, "flat", dtype=torch.float64)
    assert_same(opacus, eo.clipped_sum(per_ex, groups, c, "flat", eps=1e-6).sums, c, "opacus vs oracle")


@pytest.mark.parametrize("clip_fn", ["clip", "global", "normalize"])
def test_per_layer_equals_the_oracle(clip_fn):
    torch.manual_seed(1)
    net = perturbed(AllTypes(), seed=1).double()
    x, y = tokens(4, seed=1), torch.tensor([0, 1, 2, 3])
    per_ex = eo.per_example_grads(net, x, y)
    groups = eo.layer_groups(net)
    thresholds = [0.05, 0.3, 0.02, 0.4, 0.1, 2.0]  # named_modules order: emb, cls, pos, ln, gn, head
    assert [name for name, _ in groups] == ["emb", "cls", "pos", "ln", "gn", "head"]
    got = ours(net, x, y, "per_layer", thresholds, clip_fn=clip_fn, gamma=0.01)
    want = eo.clipped_sum(per_ex, groups, thresholds, "per_layer", clip_fn=clip_fn, gamma=0.01)
    assert_same(got, want.sums, 1.0, clip_fn)
    factors = torch.stack(list(want.factors.values()))
    assert (factors < 1).any() and (factors == 1).any() if clip_fn == "clip" else True


def test_embedding_norm_uses_index_equality():
    """Two positions of one example reading the same row add before the norm (‖g_1 + g_2‖, not
    √(‖g_1‖² + ‖g_2‖²)); padding positions add nothing."""
    emb = bnn.convert_model(nn.Embedding(5, 3, padding_idx=0).double(), clipping="per_layer", max_grad_norm=1e9)
    idx = torch.tensor([[2, 2, 0, 4]])
    g = torch.tensor([[[1.0, 0, 0], [1.0, 0, 0], [7.0, 7, 7], [0, 2.0, 0]]], dtype=torch.float64)
    examples = emb._examples((idx,), g, [True, False])
    assert float(examples.bound([True, False])[0]) == pytest.approx(math.sqrt(2.0 ** 2 + 2.0 ** 2), rel=1e-12)
    emb(idx).backward(g)
    want = torch.zeros(5, 3, dtype=torch.float64)
    want[2, 0], want[4, 1] = 2.0, 2.0
    assert torch.equal(emb.weight.grad, want)


def release(model, x, y):
    model.zero_grad(set_to_none=True)
    eo.sum_cross_entropy(model(x), y).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("clip_fn", ["clip", "global", "normalize"])
@pytest.mark.parametrize("kind", ["normal", "huge", "repeated"])
def test_each_examples_contribution_is_within_the_bound(mode, clip_fn, kind):
    """Removing example i changes the release by its contribution: at most C over all layers
    (flat), at most C_l per layer (per_layer), in float64."""
    torch.manual_seed(2)
    net = perturbed(AllTypes(), seed=2).double()
    n, c = 5, 0.3
    x, y = tokens(n, seed=3), torch.randint(0, 5, (n,), generator=torch.Generator().manual_seed(3))
    if kind == "repeated":
        x[2] = x[2, 0]  # one token throughout: the embedding row gets T times one gradient
    if kind == "huge":
        with torch.no_grad():
            net.emb.weight[x[3]] *= 1e6  # a huge activation through LayerNorm/GroupNorm
    model = copy.deepcopy(net)
    bnn.convert_model(model, clipping=mode, max_grad_norm=c, clip_fn=clip_fn, gamma=0.01)
    full = release(model, x, y)
    groups = {name: keys for name, keys in eo.layer_groups(model)}
    attained = 0.0
    for i in range(n):
        keep = [j for j in range(n) if j != i]
        part = release(model, x[keep], y[keep])
        diff = {k: full[k] - part[k] for k in full}
        if mode == "flat":
            norm = math.sqrt(sum(float(v.pow(2).sum()) for v in diff.values()))
            assert norm <= c * (1 + 1e-12)
            attained = max(attained, norm)
        else:
            for keys in groups.values():
                cl = c / math.sqrt(len(groups))
                norm = math.sqrt(sum(float(diff[k].pow(2).sum()) for k in keys))
                assert norm <= cl * (1 + 1e-12)
                attained = max(attained, norm / cl)
    if clip_fn == "clip":  # clipped examples sit at the bound (global drops them, normalize stays below)
        assert attained > (c if mode == "flat" else 1.0) * (1 - 1e-9)


def exact_sq(t):
    return sum((Fraction(v) ** 2 for v in t.double().reshape(-1).tolist()), Fraction(0))


def one_example(kind, dtype, gen):
    """A bare converted layer, one example's input and an upstream gradient for it."""
    if kind == "layer_norm":
        layer, x = nn.LayerNorm(6, dtype=dtype), torch.randn(1, 3, 6, generator=gen).to(dtype)
    elif kind == "group_norm":
        layer, x = nn.GroupNorm(2, 4, dtype=dtype), torch.randn(1, 4, 3, 3, generator=gen).to(dtype)
    elif kind == "embedding":
        layer, x = nn.Embedding(7, 5, dtype=dtype), torch.tensor([[1, 3, 1, 6]])
    elif kind == "positional":
        layer, x = modules.PositionalEmbedding(3, 5, dtype=dtype), torch.randn(1, 3, 5, generator=gen).to(dtype)
    else:
        layer, x = modules.ClassToken(5, 2, dtype=dtype), torch.randn(1, 3, 5, generator=gen).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(dtype))
    with torch.no_grad():
        out = layer(x)
    return layer, x, torch.randn(out.shape, generator=gen).to(dtype)


KINDS = ["layer_norm", "group_norm", "embedding", "positional", "class_token"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_examples_release_is_within_the_bound_exactly_from_stored_values(kind, dtype):
    """B = 1: the release is the stored RZ(c·G) itself, so its norm is computed exactly (fractions)
    from the parameters' gradients, with C set just below the example's norm (the case rounding
    could push over)."""
    if dtype == torch.float16 and kind == "group_norm":
        pytest.skip("torch has no fp16 GroupNorm on the CPU")
    gen = torch.Generator().manual_seed(5)
    for trial in range(6):
        layer, x, g = one_example(kind, dtype, gen)
        free = copy.deepcopy(layer)
        free(x).backward(g.to(dtype))
        exact_norm = math.sqrt(float(sum(exact_sq(p.grad) for p in free.parameters())))
        c = exact_norm * (1 - 2.0 ** -(trial + 4))
        clipped = bnn.convert_model(copy.deepcopy(layer), clipping="per_layer", max_grad_norm=c)
        clipped(x).backward(g)
        contribution = sum(exact_sq(p.grad) for p in clipped.parameters())
        assert contribution <= Fraction(c) ** 2, f"trial {trial}: {math.sqrt(contribution)!r} > {c!r}"
        assert contribution > 0


@pytest.mark.parametrize("kind", ["layer_norm", "group_norm"])
def test_affine_example_grads_equal_torch_func(kind):
    torch.manual_seed(6)
    if kind == "layer_norm":
        layer, x = nn.LayerNorm((3, 4)).double(), torch.randn(5, 2, 3, 4, dtype=torch.float64)
    else:
        layer, x = nn.GroupNorm(3, 6).double(), torch.randn(5, 6, 2, 3, dtype=torch.float64)
    perturbed(layer)
    g = torch.randn_like(x)

    def one(params, xi, gi):
        out = torch.func.functional_call(layer, params, (xi.unsqueeze(0),))
        return (out * gi.unsqueeze(0)).sum()

    params = {k: v.detach() for k, v in layer.named_parameters()}
    want = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))(params, x, g)
    clipped = bnn.convert_model(copy.deepcopy(layer), clipping="per_layer", max_grad_norm=1.0)
    with torch.enable_grad():
        _, saved = clipped._forward(x, clipped.weight, clipped.bias, True)
    examples = clipped._examples(saved, g, [True, True])
    torch.testing.assert_close(examples.gw, want["weight"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(examples.gb, want["bias"], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("make", [lambda **k: bnn.LayerNorm(4, **k), lambda **k: bnn.GroupNorm(2, 4, **k),
                                  lambda **k: bnn.Embedding(5, 4, **k), lambda **k: bnn.PositionalEmbedding(3, 4, **k),
                                  lambda **k: bnn.ClassToken(4, **k)])
def test_backprop_clipping_is_refused_naming_the_exact_modes(make):
    with pytest.raises(ValueError, match="clipping='backprop' has no proved bound.*'flat' or 'per_layer'"):
        make()
    layer = make(clipping="flat", max_grad_norm=1.0)
    assert layer.clipping == "flat"


def test_convert_model_and_make_private_refuse_backprop_before_changing_anything():
    net = AllTypes()
    before = [type(m) for m in net.modules()]
    with pytest.raises(ValueError, match=r"(?s)emb \(Embedding\).*ln \(LayerNorm\).*clipping='flat' or 'per_layer'"):
        bnn.convert_model(net, input_clip=1.0, grad_clip=1.0)
    assert [type(m) for m in net.modules()] == before
    engine = bpclip_fast.PrivacyEngine
    assert len(engine.validate(net)) == 5  # for make_private's default mode, backprop: each of the five
    assert engine.validate(net, tokens(2), clipping="flat") == []
    data = torch.utils.data.TensorDataset(tokens(8), torch.arange(8) % 5)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    with pytest.raises(ValueError, match="no proved bound"):
        bpclip_fast.PrivacyEngine().make_private(module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                                 data_loader=loader, noise_multiplier=1.0, input_clip=1.0,
                                                 grad_clip=1.0)
    frozen = AllTypes()
    for m in (frozen.emb, frozen.cls, frozen.pos, frozen.ln, frozen.gn):
        m.requires_grad_(False)
    bnn.convert_model(frozen, input_clip=1.0, grad_clip=1.0)  # frozen: nothing to bound, so allowed
    assert isinstance(frozen.head, bnn.Linear) and type(frozen.ln) is nn.LayerNorm


@pytest.mark.parametrize("option,value,words", [("max_norm", 1.0, "max_norm rewrites"),
                                                ("scale_grad_by_freq", True, "one example changes another"),
                                                ("sparse", True, "sparse gradients")])
def test_embedding_options_that_break_the_bound_are_refused(option, value, words):
    net = nn.Sequential(nn.Embedding(5, 3, **{option: value}))
    with pytest.raises(ValueError, match=words):
        bnn.convert_model(net, clipping="flat", max_grad_norm=1.0)
    with pytest.raises(ValueError, match=words):
        bnn.Embedding(5, 3, clipping="flat", max_grad_norm=1.0, **{option: value})


def test_bad_inputs_name_the_layer_and_the_shape():
    ln = bnn.convert_model(nn.Sequential(nn.LayerNorm(4)), clipping="flat", max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"the input must be \[B, \*, 4\].*got \(3, 5\)"):
        ln(torch.randn(3, 5))
    pos = bnn.PositionalEmbedding(3, 4, clipping="per_layer", max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"\[B, 3, 4\]"):
        pos(torch.randn(2, 4, 4))
    emb = bnn.Embedding(5, 3, clipping="per_layer", max_grad_norm=1.0)
    with pytest.raises(TypeError, match="int64/int32 tensor of indices"):
        emb(torch.randn(2, 3))
    with pytest.raises(ValueError, match="nothing to clip"):
        bnn.LayerNorm(4, elementwise_affine=False, clipping="flat", max_grad_norm=1.0)


def test_non_finite_example_is_dropped_and_counted():
    # float64: the comparison is of a batch of three with one dropped against a batch of two, whose
    # sums fp32 kernels may order differently; in float64 that differs by ~1e-16, not 1e-7.
    net = perturbed(AllTypes().double())
    model = bnn.convert_model(copy.deepcopy(net), clipping="flat", max_grad_norm=0.5)
    x = tokens(3)
    with torch.no_grad():
        model.emb.weight[x[2, 3]] = float("nan")  # example 2 alone reads this row
    assert not (x[:2] == x[2, 3]).any()
    model(x).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    clean = bnn.convert_model(copy.deepcopy(net), clipping="flat", max_grad_norm=0.5)
    clean(x[:2]).sum().backward()
    for (k, p), q in zip(model.named_parameters(), clean.parameters()):
        if k != "emb.weight":
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=k)
    with pytest.raises(bnn.NonFiniteError):
        bnn.check_finite(model)


# ---------------------------------------------------------------------------------------- the engine


def test_engine_noise_on_every_new_parameter_is_sigma_c_over_b():
    """make_private(flat) over every type: with the gradient signal removed (lr 0, all examples'
    ids the padding row, which has no gradient, and the loss independent of the rest), every
    parameter's gradient is the draw alone, with std σC/B̄."""
    torch.manual_seed(7)
    net = AllTypes()
    n, sigma, c = 64, 2.0, 3.0
    data = torch.utils.data.TensorDataset(torch.zeros(4096, TOKENS, dtype=torch.long), torch.zeros(4096, 5))
    loader = torch.utils.data.DataLoader(data, batch_size=n)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    engine = bpclip_fast.PrivacyEngine(accountant="zcdp")
    warnings.simplefilter("ignore", bpclip_fast.InsecureSeedWarning)  # a fixed seed keeps the test deterministic
    model, opt, loader = engine.make_private(module=net, optimizer=opt, data_loader=loader, noise_multiplier=sigma,
                                             clipping="flat", max_grad_norm=c, poisson_sampling=False,
                                             loss_reduction="mean", probe=False, noise_seed=11)
    x, _ = next(iter(loader))
    opt.zero_grad()
    (model(x) * 0.0).sum().backward()
    opt.step()
    expected = sigma * c / n
    pooled = []
    for k, p in model.named_parameters():
        if k.startswith("head"):
            continue
        z = p.grad.double().reshape(-1) / expected
        assert 0.5 < float(z.std()) < 2.0, k  # every parameter is noised, at the right scale
        pooled.append(z)
    z = torch.cat(pooled)
    assert float(z.std()) == pytest.approx(1.0, rel=0.2) and abs(float(z.mean())) < 0.3
    draws = torch.cat([p.grad.reshape(-1) for k, p in model.named_parameters()])
    assert len(set(draws.tolist())) == draws.numel()  # no two layers share a draw


@pytest.mark.parametrize("build", [lambda: bpclip_fast.models.vit(depth=1, dim=16, heads=2),
                                   lambda: bpclip_fast.models.resnet20_gn(groups=4)], ids=["vit", "resnet20_gn"])
def test_issue_models_flat_release_equals_opacus(build):
    """End to end on the two models of issue 15 (float64, noise off): our flat release equals Opacus'
    per-sample clipping and the torch.func oracle, with one example clipped and one not."""
    pytest.importorskip("opacus")
    torch.manual_seed(8)
    net = perturbed(build(), seed=8).double()
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    y = torch.tensor([3, 7])
    per_ex = eo.per_example_grads(net, x, y)
    norms = sum(v.flatten(1).pow(2).sum(1) for v in per_ex.values()).sqrt()
    c = float(norms.mean())  # between the two
    assert float(norms.min()) < c < float(norms.max())
    groups = eo.layer_groups(net)
    assert_same(ours(net, x, y, "flat", c), eo.clipped_sum(per_ex, groups, c, "flat").sums, c, "oracle")
    opacus = eo.opacus_clipped_sum(net, x, y, eo.sum_cross_entropy, c, "flat", dtype=torch.float64)
    assert_same(opacus, eo.clipped_sum(per_ex, groups, c, "flat", eps=1e-6).sums, c, "opacus vs oracle")
