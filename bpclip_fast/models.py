"""The networks of the paper (and a tiny one for the demo), as plain ``torch.nn`` modules.

They contain ordinary ``nn.Linear`` / ``nn.Conv2d`` layers; pass them through
``bpclip_fast.nn.convert_model(model, input_clip=..., grad_clip=...)`` for the fused clipped
layers, or through ``bpclip_fast.reference.attach`` for the hook-based reference. ``act`` is a
zero-argument factory called once per activation (a class such as ``nn.ReLU`` or
``bpclip_fast.nn.TemperedSigmoid``), so every activation is its own module.
"""

from __future__ import annotations

import functools
from typing import Callable

from torch import nn

__all__ = ["mnist_net", "cifar10_net", "digits_net", "papernot_mnist_net", "papernot_cifar10_net",
           "ACTIVATIONS", "activation"]

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


#: names accepted by :func:`activation`
ACTIVATIONS = ("relu", "tanh", "tempered")


def activation(name: str, tempered: tuple = (2.0, 2.0, 1.0)) -> ActFactory:
    """The activation factory for a model builder's ``act``: ``"relu"``, ``"tanh"`` or ``"tempered"``.

    ``tempered = (s, T, o)`` gives ``s·sigmoid(T·x) − o`` (Papernot et al. 2021;
    ``bpclip_fast.nn.TemperedSigmoid``); ``(2, 2, 1)`` is tanh.
    """
    if name == "relu":
        return nn.ReLU
    if name == "tanh":
        return nn.Tanh
    if name == "tempered":
        from .nn import TemperedSigmoid

        s, T, o = (float(v) for v in tempered)
        return functools.partial(TemperedSigmoid, s, T, o)
    raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(ACTIVATIONS)}")
