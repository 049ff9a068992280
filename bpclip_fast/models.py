"""The networks of the paper (and a tiny one for the demo), as plain ``torch.nn`` modules.

They contain ordinary ``nn.Linear`` / ``nn.Conv2d`` layers; pass them through
``bpclip_fast.nn.convert_model(model, input_clip=..., grad_clip=...)`` for the fused clipped
layers, or through ``bpclip_fast.reference.attach`` for the hook-based reference. ``act`` is a
zero-argument factory called once per activation (a class such as ``nn.ReLU`` or
``bpclip_fast.nn.TemperedSigmoid``), so every activation is its own module.

:func:`resnet20_gn` and :func:`vit` hold trainable GroupNorm/LayerNorm layers, positional embeddings
and a class token: they are for exact per-example clipping (``clipping="flat"`` / ``"per_layer"``),
whose clipped layers cover those types; backpropagation clipping bounds Linear, Conv2d and Conv1d only
(``bpclip_fast.registry.unbounded(model, "backprop")`` lists what it cannot clip).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch import nn

from .modules import ClassToken, PositionalEmbedding

__all__ = ["mnist_net", "cifar10_net", "digits_net", "mnist1d_net", "papernot_mnist_net", "papernot_cifar10_net",
           "resnet20_gn", "vit", "SelfAttention", "group_count", "ACTIVATIONS", "activation"]

ActFactory = Callable[[], nn.Module]


def mnist_net(act: ActFactory = nn.ReLU) -> nn.Sequential:
    """The paper's MNIST net (Fig. 3, as in the authors' ``mnist_experiment.py``); input ``[B,1,28,28]``.

    Shapes: 28 -> conv(8, s2, p3) 14 -> pool(2, s1) 13 -> conv(4, s2) 5 -> pool(2, s1) 4.
    No biases, as in the authors' code. 25,920 parameters.
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3, bias=False),
        act(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2, bias=False),
        act(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32, bias=False),
        act(),
        nn.Linear(32, 10, bias=False),
    )


def cifar10_net(act: ActFactory = nn.ReLU) -> nn.Sequential:
    """A reconstruction of the paper's CIFAR-10 net (Fig. 4); input ``[B,3,32,32]``.

    The figure could not be consulted, so this is rebuilt to the profile stated in DESIGN.md
    section 4 (about 29M parameters, almost all in the first Linear layer, which is what makes
    per-example gradients and noise generation expensive): four 3x3 convolutions with one 2x2
    max-pool, then Linear(128*16*16 -> 896) holding ~29.4M of the ~29.6M parameters. Timings
    and memory on it are representative of the paper's net, not a reproduction of its accuracy.
    """
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        act(),
        nn.Conv2d(32, 64, 3, padding=1),
        act(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        act(),
        nn.Conv2d(128, 128, 3, padding=1),
        act(),
        nn.Flatten(),
        nn.Linear(128 * 16 * 16, 896),
        act(),
        nn.Linear(896, 10),
    )


def digits_net(act: ActFactory = nn.ReLU) -> nn.Sequential:
    """A small net for scikit-learn's 8x8 digits; input ``[B,1,8,8]``. 17,258 parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        act(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 64),
        act(),
        nn.Linear(64, 10),
    )


def mnist1d_net(act: ActFactory = nn.ReLU, channels: int = 25) -> nn.Sequential:
    """The convolutional baseline of MNIST-1D (Greydanus 2020, the package's ``ConvBase``); input ``[B,1,40]``.

    Shapes: 40 -> conv(5, s2, p1) 19 -> conv(3, s2, p1) 10 -> conv(3, s2, p1) 5, then
    Linear(25*5 -> 10). Conv1d and Linear only, so every clipping mode applies. 5,210 parameters.
    """
    return nn.Sequential(
        nn.Conv1d(1, channels, 5, stride=2, padding=1),
        act(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1),
        act(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1),
        act(),
        nn.Flatten(),
        nn.Linear(channels * 5, 10),
    )


def papernot_mnist_net(act: ActFactory = nn.Tanh) -> nn.Sequential:
    """The MNIST/Fashion-MNIST net of Papernot et al. 2021 ("Tempered Sigmoid Activations for Deep
    Learning with Differential Privacy", Table 1); input ``[B,1,28,28]``.

    conv 16x8x8 (stride 2, padding 3) -> max-pool 2 (stride 1) -> conv 32x4x4 (stride 2) -> max-pool 2
    (stride 1) -> fully connected 32 -> fully connected 10, tanh by default. The same layers as
    :func:`mnist_net` (the paper took its net from there) but with biases. 26,010 parameters.
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3),
        act(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2),
        act(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        act(),
        nn.Linear(32, 10),
    )


def papernot_cifar10_net(act: ActFactory = nn.Tanh) -> nn.Sequential:
    """The CIFAR-10 net of Papernot et al. 2021 (Table 2); input ``[B,3,32,32]``.

    Three blocks of two 3x3 convolutions (32, 64, 128 channels, stride 1, "same" padding) each
    followed by 2x2 average pooling (stride 2), then fully connected 128 and 10; tanh by default.
    550,570 parameters.
    """
    layers: list = []
    channels = 3
    for width in (32, 64, 128):
        layers += [nn.Conv2d(channels, width, 3, padding=1), act(),
                   nn.Conv2d(width, width, 3, padding=1), act(), nn.AvgPool2d(2, 2)]
        channels = width
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * 4 * 4, 128), act(), nn.Linear(128, 10))


def group_count(channels: int, at_most: int) -> int:
    """The largest divisor of ``channels`` that is at most ``at_most``: a GroupNorm group count that
    splits the channels evenly (16 channels, at most 32 -> 16; 48, at most 32 -> 24; 7 -> 7)."""
    if channels < 1 or at_most < 1:
        raise ValueError(f"group_count: channels and at_most must be positive, got {channels}, {at_most}")
    return max(g for g in range(1, min(channels, at_most) + 1) if channels % g == 0)


class _GNBlock(nn.Module):
    """``act(gn2(conv2(act(gn1(conv1(x))))) + shortcut(x))``; the shortcut is a 1x1 strided conv and a
    GroupNorm when the shape changes, the identity otherwise."""

    def __init__(self, cin: int, cout: int, stride: int, act: ActFactory, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(group_count(cout, groups), cout)
        self.act1 = act()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(group_count(cout, groups), cout)
        self.act2 = act()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.GroupNorm(group_count(cout, groups), cout))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x):
        return self.act2(self.gn2(self.conv2(self.act1(self.gn1(self.conv1(x))))) + self.shortcut(x))


def resnet20_gn(act: ActFactory = nn.ReLU, in_channels: int = 1, num_classes: int = 10,
                groups: int = 16) -> nn.Sequential:
    """ResNet-20 (He et al. 2016, CIFAR layout) with GroupNorm after every convolution; input
    ``[B, in_channels, H, W]`` (28x28 digits/MNIST by default; any size, the pooling is global).

    A 3x3 stem of 16 channels, three stages of three basic blocks (16, 32, 64 channels; the second
    and third stages halve the resolution: 28 -> 14 -> 7, with 1x1 strided conv + GroupNorm
    shortcuts), global average pooling and Linear(64 -> num_classes). Each GroupNorm (affine) has
    :func:`group_count` ``(C, groups)`` groups: 16 for every width with the default ``groups=16``
    (1, 2, 4 channels per group). The convolutions have no bias (the GroupNorm after each shifts).
    272,186 parameters with the defaults.
    """
    layers = [nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), nn.GroupNorm(group_count(16, groups), 16), act()]
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(3):
            layers.append(_GNBlock(cin, cout, stride if i == 0 else 1, act, groups))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)]
    return nn.Sequential(*layers)


class SelfAttention(nn.Module):
    """Multi-head self-attention over the tokens of each example: ``[B, T, dim] -> [B, T, dim]``.

    The projections are ``nn.Linear`` (``qkv``: dim -> 3·dim, ``proj``: dim -> dim), so exact
    per-example clipping trains them; the attention itself, ``softmax(QKᵀ/√d_head)·V``, has no
    parameter and mixes tokens within one example only (:meth:`attend`).
    """

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"SelfAttention: dim ({dim}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q, k, v``: ``[B, heads, T, d_head]``; the attention of each example's tokens to its own."""
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return scores.softmax(dim=-1) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, dim = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        out = self.attend(q, k, v)  # [B, heads, T, d_head]
        return self.proj(out.transpose(1, 2).reshape(B, T, dim))


class _EncoderBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, dim: int, heads: int, hidden: int, act: ActFactory):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), act(), nn.Linear(hidden, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _ViT(nn.Module):
    def __init__(self, act, in_channels, num_classes, image_size, patch, dim, depth, heads, mlp_ratio):
        super().__init__()
        if image_size % patch:
            raise ValueError(f"vit: image_size ({image_size}) must be a multiple of patch ({patch})")
        tokens = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.cls_token = ClassToken(dim)
        self.pos_embed = PositionalEmbedding(tokens + 1, dim)
        self.blocks = nn.Sequential(*(_EncoderBlock(dim, heads, int(mlp_ratio * dim), act) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, tokens, dim]
        x = self.pos_embed(self.cls_token(x))
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def vit(act: ActFactory = nn.GELU, in_channels: int = 1, num_classes: int = 10, image_size: int = 28,
        patch: int = 7, dim: int = 64, depth: int = 4, heads: int = 4, mlp_ratio: float = 2.0) -> nn.Module:
    """A small vision transformer (Dosovitskiy et al. 2021); input ``[B, in_channels, image_size, image_size]``.

    Patches by ``nn.Conv2d(in_channels, dim, patch, stride=patch)`` (28x28 with patch 7: 16 tokens),
    a :class:`~bpclip_fast.modules.ClassToken` prepended and a
    :class:`~bpclip_fast.modules.PositionalEmbedding` of 17 x dim added, ``depth`` pre-norm blocks
    (LayerNorm -> :class:`SelfAttention` -> residual, LayerNorm -> Linear(dim, mlp_ratio·dim), act,
    Linear -> residual), a final LayerNorm and Linear(dim -> num_classes) on the class token. No
    dropout. Every trainable parameter is in a Conv2d, Linear, LayerNorm, ClassToken or
    PositionalEmbedding. 139,018 parameters with the defaults (dim 64, depth 4, 4 heads, MLP 128).
    """
    return _ViT(act, in_channels, num_classes, image_size, patch, dim, depth, heads, mlp_ratio)


#: names accepted by :func:`activation`
ACTIVATIONS = ("relu", "tanh", "tempered", "gelu")


def activation(name: str, tempered: tuple = (2.0, 2.0, 1.0)) -> ActFactory:
    """The activation factory for a model builder's ``act``: ``"relu"``, ``"tanh"``, ``"tempered"`` or ``"gelu"``.

    ``tempered = (s, T, o)`` gives ``s·sigmoid(T·x) − o`` (Papernot et al. 2021;
    ``bpclip_fast.nn.TemperedSigmoid``); ``(2, 2, 1)`` is tanh.
    """
    if name == "relu":
        return nn.ReLU
    if name == "tanh":
        return nn.Tanh
    if name == "gelu":
        return nn.GELU
    if name == "tempered":
        from .nn import TemperedSigmoid

        s, T, o = (float(v) for v in tempered)
        return functools.partial(TemperedSigmoid, s, T, o)
    raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(ACTIVATIONS)}")
