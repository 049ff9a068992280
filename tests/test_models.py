"""The models of issue 15 (bpclip_fast.models.resnet20_gn, vit), bpclip_fast.fix_model, and the
batch-independence probe on a transformer whose attention mixes examples."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bpclip_fast
from bpclip_fast import registry
from bpclip_fast.models import SelfAttention, group_count, mnist_net, resnet20_gn, vit
from bpclip_fast.modules import ClassToken, PositionalEmbedding
from bpclip_fast.validate import dynamic_problems, static_problems, validate

# The types whose parameters issue 15's exact clipping trains; the models hold parameters nowhere else.
ISSUE15_TYPES = (nn.Linear, nn.Conv2d, nn.LayerNorm, nn.GroupNorm, nn.Embedding, PositionalEmbedding, ClassToken)


def conv_params(cin, cout, k, bias):
    return cin * cout * k * k + (cout if bias else 0)


def linear_params(fan_in, fan_out):
    return fan_in * fan_out + fan_out


def resnet20_gn_params(in_channels=1, classes=10):
    """ResNet-20's layout counted from the paper's description: bias-free convolutions, an affine
    GroupNorm (2·C) after each, 1x1 conv + GroupNorm shortcuts where the width changes."""
    total = conv_params(in_channels, 16, 3, False) + 2 * 16
    cin = 16
    for width in (16, 32, 64):
        for block in range(3):
            total += conv_params(cin, width, 3, False) + 2 * width + conv_params(width, width, 3, False) + 2 * width
            if cin != width:
                total += conv_params(cin, width, 1, False) + 2 * width
            cin = width
    return total + linear_params(64, classes)


def vit_params(in_channels=1, classes=10, image=28, patch=7, dim=64, depth=4, mlp=128):
    tokens = (image // patch) ** 2
    block = (2 * dim                     # LayerNorm before attention
             + linear_params(dim, 3 * dim) + linear_params(dim, dim)
             + 2 * dim                   # LayerNorm before the MLP
             + linear_params(dim, mlp) + linear_params(mlp, dim))
    return (conv_params(in_channels, dim, patch, True) + dim + (tokens + 1) * dim
            + depth * block + 2 * dim + linear_params(dim, classes))


def n_params(model):
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------ the models


def test_group_count_is_the_largest_divisor_not_above_the_limit():
    assert [group_count(c, 32) for c in (64, 48, 32, 7, 1)] == [32, 24, 32, 7, 1]
    assert [group_count(c, 16) for c in (16, 32, 64, 12)] == [16, 16, 16, 12]
    assert group_count(12, 5) == 4
    with pytest.raises(ValueError, match="positive"):
        group_count(0, 4)


@pytest.mark.parametrize("kw, shape", [({}, (1, 28, 28)), ({"in_channels": 3, "num_classes": 5}, (3, 32, 32))])
def test_resnet20_gn_shapes_and_parameter_count(kw, shape):
    model = resnet20_gn(**kw)
    assert model(torch.randn(2, *shape)).shape == (2, kw.get("num_classes", 10))
    assert n_params(model) == resnet20_gn_params(kw.get("in_channels", 1), kw.get("num_classes", 10))


def test_resnet20_gn_layers():
    model = resnet20_gn(groups=4)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(convs) == 19 + 2 and len(norms) == len(convs)  # 19 3x3 convs, 2 shortcut convs: each normalised
    assert all(gn.num_groups == 4 and gn.affine for gn in norms)
    assert sorted({gn.num_channels for gn in norms}) == [16, 32, 64]
    assert [type(m) for m in model.modules() if isinstance(m, nn.Linear)] == [nn.Linear]
    assert all(gn.num_groups == 16 for gn in resnet20_gn().modules() if isinstance(gn, nn.GroupNorm))
    # the resolution after each stage: 28 -> 28 -> 14 -> 7
    sizes = [model[:i](torch.zeros(1, 1, 28, 28)).shape[-1] for i in (6, 9, 12)]
    assert sizes == [28, 14, 7]


def test_vit_shapes_parameter_count_and_layers():
    model = vit()
    x = torch.randn(3, 1, 28, 28)
    assert model(x).shape == (3, 10)
    assert n_params(model) == vit_params()
    small = vit(dim=32, depth=2, heads=2, mlp_ratio=3, num_classes=4)
    assert small(x).shape == (3, 4) and n_params(small) == vit_params(dim=32, depth=2, mlp=96, classes=4)
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(nn.LayerNorm) == 2 * 4 + 1 and kinds.count(nn.Linear) == 4 * 4 + 1
    assert kinds.count(ClassToken) == 1 and kinds.count(PositionalEmbedding) == 1
    assert not any(m.p > 0 for m in model.modules() if isinstance(m, nn.Dropout))
    with pytest.raises(ValueError, match="multiple of heads"):
        vit(dim=30, heads=4)


@pytest.mark.parametrize("build", [resnet20_gn, vit])
def test_every_trainable_parameter_is_in_a_layer_type_of_issue_15(build):
    model = build()
    owners = [(name, type(m)) for name, m in model.named_modules() if list(m.parameters(recurse=False))]
    assert owners and all(kind in ISSUE15_TYPES for _, kind in owners), owners
    assert sum(p.numel() for _, m in model.named_modules() for p in m.parameters(recurse=False)) == n_params(model)


def test_attention_is_scaled_dot_product_attention_within_each_example():
    torch.manual_seed(0)
    attn = SelfAttention(16, 4).double()
    x = torch.randn(3, 5, 16, dtype=torch.double)
    q, k, v = attn.qkv(x).reshape(3, 5, 3, 4, 4).permute(2, 0, 3, 1, 4)
    expected = attn.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(3, 5, 16))
    torch.testing.assert_close(attn(x), expected)
    # each example attends to its own tokens: example 0 alone gives the same output as in the batch
    torch.testing.assert_close(attn(x[:1]), attn(x)[:1])


def backprop_unclipped(model):
    return registry.unbounded(model, "backprop")


def test_backprop_unclipped_names_the_norms_and_embeddings():
    assert backprop_unclipped(mnist_net()) == []
    names = backprop_unclipped(vit())
    assert "cls_token (ClassToken)" in names and "pos_embed (PositionalEmbedding)" in names
    assert "blocks.0.ln1 (LayerNorm)" in names and not any("Linear" in n or "Conv2d" in n for n in names)
    assert "1 (GroupNorm)" in backprop_unclipped(resnet20_gn())
    frozen = vit()
    for m in frozen.modules():
        if isinstance(m, (nn.LayerNorm, ClassToken, PositionalEmbedding)):
            m.requires_grad_(False)
    assert backprop_unclipped(frozen) == []


@pytest.mark.parametrize("build", [resnet20_gn, lambda: vit(depth=1)])
def test_opacus_per_example_gradients_are_exact(build):
    """dpsgd trains these models through Opacus: its grad samplers (LayerNorm, GroupNorm) and its
    functorch fallback (our ClassToken/PositionalEmbedding) against one backward per example."""
    pytest.importorskip("opacus")
    from opacus import GradSampleModule

    torch.manual_seed(0)
    model = build().double()
    x, y = torch.randn(3, 1, 28, 28, dtype=torch.double), torch.tensor([0, 3, 7])
    expected = []
    for i in range(3):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        expected.append({n: p.grad.clone() for n, p in model.named_parameters()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampled = GradSampleModule(model, loss_reduction="sum")
        sampled.zero_grad()
        F.cross_entropy(sampled(x), y, reduction="sum").backward()
    for name, p in model.named_parameters():
        for i in range(3):
            torch.testing.assert_close(p.grad_sample[i], expected[i][name], msg=name)


# ------------------------------------------------------------------------------ the batch-independence probe

# Each probe test runs with the norms and embeddings trainable (the probes then follow them too)
# and frozen (the probes see only the Linear/Conv2d layers).


def frozen_norms(model, freeze=True):
    if not freeze:
        return model
    for m in model.modules():
        if isinstance(m, (nn.LayerNorm, nn.GroupNorm, ClassToken, PositionalEmbedding)):
            m.requires_grad_(False)
    return model


class BatchMixingAttention(SelfAttention):
    """The bug: attention over the batch dimension (``[B, H, T, d]`` read as if the batch were the
    sequence), so every example attends to the other examples' tokens."""

    def attend(self, q, k, v):
        return super().attend(*(t.transpose(0, 2) for t in (q, k, v))).transpose(0, 2)


def mixing_vit(**kw):
    model = vit(**kw)
    for block in model.blocks:
        buggy = BatchMixingAttention(block.attn.qkv.in_features, block.attn.heads)
        buggy.load_state_dict(block.attn.state_dict())
        block.attn = buggy
    return model


@pytest.mark.parametrize("freeze", [False, True])
def test_the_correct_vit_passes_every_probe(freeze):
    model = frozen_norms(vit(depth=2), freeze)
    assert validate(model, torch.randn(4, 1, 28, 28)) == []


def test_the_buggy_attention_really_mixes_examples():
    # (on the attention itself: in the whole model the class token, which the head reads, attends
    # only to the other examples' class tokens, all equal, so the outputs do not show the bug)
    torch.manual_seed(0)
    attn = BatchMixingAttention(16, 4)
    h = torch.randn(4, 5, 16)
    changed = h.clone()
    changed[0] += 1
    with torch.no_grad():
        assert not torch.allclose(attn(h)[1:], attn(changed)[1:])


@pytest.mark.parametrize("freeze", [False, True])
def test_attention_across_the_batch_is_refused_by_the_probe(freeze):
    model = frozen_norms(mixing_vit(depth=2), freeze)
    assert static_problems(model) == []  # nothing to see without running it
    problems = dynamic_problems(model, torch.randn(4, 1, 28, 28))
    mixing = [p for p in problems if "batch independence" in p]
    assert mixing, problems
    # the first layer after the first attention is the first whose input mixes
    assert mixing[0].startswith("blocks.0.attn.proj (Linear): its input changed"), mixing


@pytest.mark.parametrize("freeze", [False, True])
def test_make_private_refuses_attention_across_the_batch(freeze):
    from torch.utils.data import DataLoader, TensorDataset

    model = frozen_norms(mixing_vit(depth=1), freeze)
    data = TensorDataset(torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    with pytest.raises(ValueError, match="batch independence"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bpclip_fast.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, 8),
            noise_multiplier=1.0, clipping="flat", max_grad_norm=1.0, noise_seed=0)


# ------------------------------------------------------------------------------ fix_model


class BNResNet(nn.Module):
    """A ResNet-like block with BatchNorm2d, one BatchNorm shared by two paths."""

    def __init__(self, affine=True):
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 3, padding=1)
        self.bn = nn.BatchNorm2d(64, affine=affine)
        self.body = nn.Sequential(nn.Conv2d(64, 48, 3, padding=1), nn.BatchNorm2d(48, affine=affine, eps=1e-3),
                                  nn.ReLU())
        self.shortcut = nn.Conv2d(64, 48, 1)
        self.head = nn.Linear(48, 10)

    def forward(self, x):
        h = torch.relu(self.bn(self.stem(x)))
        return self.head((self.body(h) + self.shortcut(h)).mean((2, 3)))


def bn_mlp(affine=True):
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.BatchNorm1d(16, affine=affine), nn.ReLU(),
                         nn.Linear(16, 3))


def fixed(model):
    with pytest.warns(UserWarning, match="fix_model") as record:
        out = bpclip_fast.fix_model(model)
    assert out is model  # in place
    return "\n".join(str(w.message) for w in record)


def test_fix_model_replaces_batchnorm2d_in_place():
    torch.manual_seed(0)
    model = BNResNet()
    x = torch.randn(2, 3, 8, 8)
    shape = model(x).shape
    with torch.no_grad():
        model.body[1].weight.fill_(2.0)
    assert any("BatchNorm" in p for p in static_problems(model))
    message = fixed(model)
    assert type(model.bn) is nn.GroupNorm and type(model.body[1]) is nn.GroupNorm
    assert (model.bn.num_groups, model.bn.num_channels) == (32, 64)
    assert (model.body[1].num_groups, model.body[1].num_channels, model.body[1].eps) == (24, 48, 1e-3)
    assert model.bn.affine and all(p.requires_grad for p in model.parameters())
    assert torch.equal(model.body[1].weight, torch.full((48,), 2.0))  # the affine parameters carried over
    assert "bn: BatchNorm2d(64) -> GroupNorm(32, 64)" in message
    assert "body.1: BatchNorm2d(48) -> GroupNorm(24, 48)" in message
    assert model(x).shape == shape
    problems = static_problems(model)
    assert not any("BatchNorm" in p for p in problems), problems
    assert problems == []


def test_fix_model_replaces_batchnorm1d_on_feature_vectors():
    model = bn_mlp()
    x = torch.randn(5, 3, 4)
    message = fixed(model)
    gn = model[2]
    assert type(gn) is nn.GroupNorm and (gn.num_groups, gn.num_channels) == (1, 16) and gn.affine
    assert "2: BatchNorm1d(16) -> GroupNorm(1, 16)" in message
    out = model(x)
    assert out.shape == (5, 3)
    # normalised within each example: example 0 alone gives what it gives in the batch
    torch.testing.assert_close(model(x[:1]), out[:1])
    # and a [B, C, L] input goes through as well
    assert gn(torch.randn(5, 16, 7)).shape == (5, 16, 7)


def test_fixed_models_pass_validation():
    """Without affine parameters nothing trainable is left outside Linear/Conv2d: every check and
    probe passes today; with them, once the clipped GroupNorm is registered."""
    for model, x in [(BNResNet(affine=False), torch.randn(3, 3, 8, 8)), (bn_mlp(affine=False), torch.randn(4, 12))]:
        fixed(model)
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        assert validate(model, x) == []
    model = BNResNet()
    fixed(model)
    assert validate(model, torch.randn(3, 3, 8, 8)) == []


def test_fix_model_shares_one_groupnorm_and_keeps_devices_modes_and_frozen_flags():
    shared = nn.BatchNorm2d(8)
    shared.weight.requires_grad_(False)
    model = nn.Sequential(nn.Conv2d(2, 8, 1), shared, nn.Conv2d(8, 8, 1), shared).double().eval()
    message = fixed(model)
    assert model[1] is model[3] and type(model[1]) is nn.GroupNorm
    assert message.count("-> GroupNorm(8, 8)") == 1
    assert model[1].weight.dtype == torch.double and not model[1].training
    assert not model[1].weight.requires_grad and model[1].bias.requires_grad


def test_fix_model_is_silent_without_batchnorm_and_handles_a_bare_layer():
    model = mnist_net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bpclip_fast.fix_model(model) is model
    with pytest.warns(UserWarning, match=r"BatchNorm3d\(6\) by GroupNorm\(6, 6\)"):
        gn = bpclip_fast.fix_model(nn.BatchNorm3d(6))
    assert type(gn) is nn.GroupNorm
    with pytest.raises(ValueError, match="forward pass before fix_model"):
        bpclip_fast.fix_model(nn.Sequential(nn.LazyBatchNorm2d()))


def test_the_batchnorm_message_suggests_fix_model():
    problems = validate(BNResNet())
    assert problems and all("bpclip_fast.fix_model(model)" in p for p in problems if "BatchNorm" in p)
