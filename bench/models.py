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

from torch import nn

from bpclip_fast.models import cifar10_net, mnist_net, resnet20_gn, vit

ActFactory = Callable[[], nn.Module]

__all__ = ["mlp_1024", "resnet20_nobn", "MODELS"]


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


MODELS = {
    "mnist": (mnist_net, (1, 28, 28), 10),
    "cifar10": (cifar10_net, (3, 32, 32), 10),
    "mlp": (mlp_1024, (1, 28, 28), 10),
    "resnet20": (resnet20_nobn, (3, 32, 32), 10),
    "vit": (vit, (1, 28, 28), 10),
    "resnet20-gn": (resnet20_gn, (1, 28, 28), 10),
}
