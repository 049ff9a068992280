"""Attack review 48 (of 5975c74), G3: eager flat clipping released one forward's layers once per
backward pass, with the factors of the layers that pass reached. A frozen trunk with k trainable
heads, one forward and one ``backward(retain_graph=True)`` per head's loss, clipped each head at C
on its own: one example moved the release by √k·C (1.414 for k = 2, 2.000 for k = 4) against a
charge for C, and every check passed. A second release of the same forward is now refused, charged,
as the compiled flat path refused it already. (G1 and G2, integer noise: tests/test_integer_noise.py.)"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine
from bpclip_fast.rules import StepRefused


class MultiTask(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.trunk = nn.Linear(6, 6)
        self.trunk.requires_grad_(False)
        self.heads = nn.ModuleList([nn.Linear(6, 2) for _ in range(k)])

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return tuple(head(h) for head in self.heads)


def _private(k, integer_noise, n=8):
    torch.manual_seed(0)
    model = MultiTask(k).double()
    x, y = torch.randn(n, 6, dtype=torch.float64) * 30, torch.zeros(n, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine()
        m, o, dl = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       data_loader=DataLoader(TensorDataset(x, y), batch_size=min(n, 4)),
                                       noise_multiplier=1e-4, clipping="flat", max_grad_norm=1.0, noise_seed=7,
                                       loss_reduction="sum", integer_noise=integer_noise)
    return engine, m, o, dl


@pytest.mark.parametrize("integer_noise", [False, True])
@pytest.mark.parametrize("k", [2, 4])
def test_one_backward_per_head_of_one_forward_is_refused(k, integer_noise):
    engine, m, o, dl = _private(k, integer_noise)
    xb, _ = next(iter(dl))
    o.zero_grad()
    outs = m(xb)
    with pytest.raises(StepRefused, match=r"flat clipping releases one forward's layers together, once, but a later") as info:
        for j, out in enumerate(outs):
            out.sum().backward(retain_graph=j < k - 1)
    assert info.value.charged and all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("integer_noise", [False, True])
def test_one_backward_of_the_heads_summed_losses_is_one_release_within_c(integer_noise):
    """The loop the refusal asks for: each example's joint gradient over the heads is clipped at C
    (a data set of one example, drawn at rate 1: the released norm is at most C, to the noise)."""
    engine, m, o, dl = _private(4, integer_noise, n=1)
    xb, _ = next(iter(dl))
    assert len(xb) == 1
    o.zero_grad()
    sum(out.sum() for out in m(xb)).backward()
    joint = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in m.parameters() if p.grad is not None))
    assert joint <= 1.0 + 1e-3  # C plus σ·C·√(coordinates) at σ = 1e-4 and the integer grid
    o.step()
