"""The benchmark's models: the paper's two nets, two more shapes of network, and the two models of
exact per-example clipping.

Every model is built from plain ``torch.nn`` modules (no BatchNorm), so each training method of
``bench.step`` wraps the very same module: ``convert_model`` for ``bpclip_fast``, hooks for
``bpclip_fast.reference``, ``make_private`` for Opacus. ``vit`` and ``resnet20-gn`` hold trainable
LayerNorm/GroupNorm layers, a class token and positional embeddings, which backpropagation clipping
does not bound: ``bpclip_fast`` and ``bpclip_reference`` record them as ``unsupported``.

``MODELS`` maps a name to ``(factory(act) -> nn.Module, input shape without the batch dim,
number of classes)``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from bpclip_fast.models import cifar10_net, mnist_net, resnet20_gn, vit

ActFactory = Callable[[], nn.Module]

__all__ = ["mlp_1024", "resnet20_nobn", "lstm", "transformer", "conv1d", "gpt2", "gpt2_lora", "MODELS"]


def mlp_1024(act: ActFactory = nn.Tanh) -> nn.Sequential:
    """Three Linear layers of width 1024 on MNIST-shaped input ``[B,1,28,28]``: 784 -> 1024 -> 1024 -> 10.

    1,863,690 parameters; matrix products only, so the clipping and noise overheads are measured on
    a model with no convolution at all.
    """
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(28 * 28, 1024),
        act(),
        nn.Linear(1024, 1024),
        act(),
        nn.Linear(1024, 10),
    )


class _Block(nn.Module):
    """``act(conv2(act(conv1(x))) + shortcut(x))``; a 1x1 strided conv shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int, act: ActFactory):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
        self.act1 = act()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.act2 = act()
        self.shortcut = nn.Conv2d(cin, cout, 1, stride=stride) if (stride != 1 or cin != cout) else nn.Identity()

    def forward(self, x):
        return self.act2(self.conv2(self.act1(self.conv1(x))) + self.shortcut(x))


def resnet20_nobn(act: ActFactory = nn.Tanh) -> nn.Sequential:
    """ResNet-20's layout (He et al. 2016, CIFAR variant) without BatchNorm; input ``[B,3,32,32]``.

    A 3x3 stem (16 channels), three stages of three residual blocks (16, 32, 64 channels; the
    second and third stages halve the resolution, with 1x1 strided conv shortcuts), global average
    pooling and Linear(64 -> 10): 21 convolutions and one Linear, 271,690 parameters. Without
    BatchNorm (which mixes examples, so neither backpropagation clipping nor per-example clipping
    can bound one example's influence); every layer is used once per forward.
    """
    layers = [nn.Conv2d(3, 16, 3, padding=1), act()]
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(3):
            layers.append(_Block(cin, cout, stride if i == 0 else 1, act))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
    return nn.Sequential(*layers)


class _Sequence(nn.Module):
    """A sequence classifier over float sequences ``[B, T, d]``: ``body`` then the mean over
    positions and a Linear. The issue-26 models: their bodies have no fused clipped layer, so the
    exact modes train them by the generic path (bpclip_fast/generic.py)."""

    def __init__(self, body: nn.Module, width: int, first_output: bool = False):
        super().__init__()
        self.body, self.first_output = body, first_output
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        h = self.body(x)
        return self.head((h[0] if self.first_output else h).mean(1))


def lstm(act: ActFactory = nn.Tanh) -> nn.Module:
    """One LSTM layer (64 -> 128) over ``[B, 32, 64]``, mean over time, Linear(128 -> 10): 99,850 parameters."""
    return _Sequence(nn.LSTM(64, 128, batch_first=True), 128, first_output=True)


def transformer(act: ActFactory = nn.Tanh) -> nn.Module:
    """Two ``nn.TransformerEncoderLayer`` (d 128, 4 heads, feed-forward 256, no dropout) over
    ``[B, 32, 128]``: their MultiheadAttention by the generic path, their Linear/LayerNorm fused."""
    layer = lambda: nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)  # noqa: E731
    return _Sequence(nn.Sequential(layer(), layer()), 128)


def conv1d(act: ActFactory = nn.Tanh) -> nn.Module:
    """Two Conv1d (64 -> 128 -> 128, kernel 5) over ``[B, 64, 128]`` (channels first), mean, Linear."""
    body = nn.Sequential(nn.Conv1d(64, 128, 5, padding=2), act(), nn.Conv1d(128, 128, 5, padding=2), act())
    return nn.Sequential(body, _Mean(), nn.Linear(128, 10))


class _Mean(nn.Module):
    def forward(self, x):
        return x.mean(-1)


class _GPT2(nn.Module):
    """Hugging Face's GPT-2 (from a config: 4 layers, d 128, 4 heads, tied embeddings of 1000 tokens,
    no dropout) as a classifier of float sequences ``[B, 32, 128]`` fed as ``inputs_embeds``, positions
    per example; ``lora``: LoRA (r 8) on ``c_attn`` through peft, the rest frozen. Needs transformers
    (and peft)."""

    def __init__(self, lora: bool = False):
        super().__init__()
        import transformers

        cfg = transformers.GPT2Config(vocab_size=1000, n_positions=32, n_embd=128, n_layer=4, n_head=4,
                                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0)
        model = transformers.GPT2Model(cfg)
        if lora:
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True))
        self.gpt2 = model
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        h = self.gpt2(inputs_embeds=x, position_ids=positions, use_cache=False).last_hidden_state
        return self.head(h.mean(1))


def gpt2(act: ActFactory = nn.Tanh) -> nn.Module:
    return _GPT2()


def gpt2_lora(act: ActFactory = nn.Tanh) -> nn.Module:
    return _GPT2(lora=True)


MODELS = {
    "mnist": (mnist_net, (1, 28, 28), 10),
    "cifar10": (cifar10_net, (3, 32, 32), 10),
    "mlp": (mlp_1024, (1, 28, 28), 10),
    "resnet20": (resnet20_nobn, (3, 32, 32), 10),
    "vit": (vit, (1, 28, 28), 10),
    "resnet20-gn": (resnet20_gn, (1, 28, 28), 10),
    "lstm": (lstm, (32, 64), 10),
    "transformer": (transformer, (32, 128), 10),
    "conv1d": (conv1d, (64, 128), 10),
    "gpt2": (gpt2, (32, 128), 10),
    "gpt2-lora": (gpt2_lora, (32, 128), 10),
}
