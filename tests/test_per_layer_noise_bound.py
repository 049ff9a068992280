"""per_layer scales every layer's noise to (Σ_l C_l²)^½: that value must be an upper bound on the
exact root, in exact rational arithmetic, also where the squares under- or overflow in double."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
from torch import nn

import bpclip_fast.nn as bnn
from bpclip_fast.modes.per_layer import noise_bound


def _covers(bound: float, thresholds) -> bool:
    return bound > 0 and Fraction(bound) ** 2 >= sum(Fraction(c) ** 2 for c in thresholds)


@pytest.mark.parametrize("scale", [1e-170, 1e-160, 1.0, 1e150, 1e160])
def test_noise_bound_is_an_upper_bound_on_the_exact_root(scale):
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 30):
        for _ in range(50):
            cs = [scale * rng.uniform(0.1, 10.0) for _ in range(n)]
            assert _covers(noise_bound(cs), cs), (n, cs)


def test_tiny_per_layer_thresholds_keep_their_noise():
    """Thresholds of 1e-170 squared underflow to 0 in double: the layers' noise bound (and with it
    the noise std σ·noise_bound) was 0, so the step released its clipped sum without noise."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    bnn.convert_model(model, clipping="per_layer", max_grad_norm=[1e-170, 2e-170])
    layers = [m for _, m in bnn.clipped_layers(model)]
    for layer in layers:
        assert _covers(layer.noise_bound, [1e-170, 2e-170])


def test_a_backprop_layer_refuses_max_grad_norm_instead_of_dropping_it():
    with pytest.raises(TypeError, match="max_grad_norm applies to clipping='flat' or 'per_layer'"):
        bnn.Linear(3, 4, clipping="backprop", input_clip=1.0, grad_clip=1.0, max_grad_norm=5.0)
