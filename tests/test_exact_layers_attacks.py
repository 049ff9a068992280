"""Attacks on the issue-15 layer types (LayerNorm, GroupNorm, Embedding, PositionalEmbedding,
ClassToken) under exact clipping: training loops and inputs that the rest of the library accepts
must either keep the guarantee or be refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast
from bpclip_fast import modules
from bpclip_fast import nn as bnn

VOCAB, DIM, TOKENS = 13, 8, 4


class AllTypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.cls = modules.ClassToken(DIM)
        self.pos = modules.PositionalEmbedding(TOKENS + 1, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.gn = nn.GroupNorm(2, DIM)
        self.head = nn.Linear(DIM, 3)

    def forward(self, idx):
        h = torch.tanh(self.ln(self.pos(self.cls(self.emb(idx)))))
        h = self.gn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h.mean(1))


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("make", [
    lambda: (nn.LayerNorm(4), torch.zeros(0, 3, 4)),
    lambda: (nn.GroupNorm(2, 4), torch.zeros(0, 4, 3)),
    lambda: (nn.GroupNorm(2, 4), torch.zeros(0, 4)),
    lambda: (nn.Embedding(10, 4), torch.zeros(0, 5, dtype=torch.long)),
    lambda: (modules.PositionalEmbedding(5, 4), torch.zeros(0, 5, 4)),
    lambda: (modules.ClassToken(4), torch.zeros(0, 5, 4)),
], ids=["layernorm", "groupnorm", "groupnorm_2d", "embedding", "positional", "class_token"])
def test_an_empty_batch_runs_forward_and_backward(mode, make):
    """The private loader yields [0, ...] batches under Poisson sampling and the loop may run them
    (bpclip_fast.data): every new type's backward must take B = 0 (it raised in reshape(0, -1))."""
    layer, x = make()
    net = bnn.convert_model(nn.Sequential(layer), clipping=mode, max_grad_norm=1.0)
    net(x).sum().backward()
    for p in net.parameters():
        assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_empty_poisson_batch_through_the_engine_is_the_draw_alone(mode):
    """An empty Poisson batch run through forward and backward releases the same update as a loop
    that skips it: the step's draw alone (as tests/test_engine.py for Linear)."""
    ds = TensorDataset(torch.randint(1, VOCAB, (20, TOKENS)), torch.zeros(20, dtype=torch.long))
    outcomes = {}
    for loop in ("forward_on_empty", "skip_empty"):
        torch.manual_seed(0)
        model = AllTypes()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        engine = bpclip_fast.PrivacyEngine()
        with pytest.warns(bpclip_fast.InsecureSeedWarning):
            model, opt, loader = engine.make_private(module=model, optimizer=opt,
                                                     data_loader=DataLoader(ds, batch_size=1), noise_multiplier=1.0,
                                                     clipping=mode, max_grad_norm=1.0, noise_seed=2024, probe=False)
        for x, y in loader:
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            if len(x) or loop == "forward_on_empty":
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if len(x) == 0:
                break
        assert len(x) == 0, "no empty batch within one epoch: pick another seed"
        update = [(b - p).detach() for b, p in zip(before, model.parameters())]
        assert all(u.abs().sum() > 0 for u in update)  # the draw
        outcomes[loop] = update
    for a, b in zip(outcomes["forward_on_empty"], outcomes["skip_empty"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


class InPlaceAfter(nn.Module):
    """In-place ops on each new type's output: ResNet's ``GroupNorm -> ReLU(inplace=True)`` and the like."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = modules.PositionalEmbedding(TOKENS, DIM)
        self.cls = modules.ClassToken(DIM)
        self.ln = nn.LayerNorm(DIM)
        self.gn = nn.GroupNorm(2, DIM)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(DIM, 3)

    def forward(self, idx):
        h = self.emb(idx)
        h.mul_(1.5)
        h = self.pos(h)
        h += 0.5
        h = self.cls(h)
        h.tanh_()
        h = self.relu(self.ln(h))
        h = self.relu(self.gn(h.transpose(1, 2))).transpose(1, 2)
        return self.head(h.mean(1))


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("c", [0.1, 100.0])
def test_in_place_ops_on_the_outputs_give_the_oracle(mode, c):
    """The output used to be a view made inside a custom Function, which torch refuses to modify in
    place ("Output 0 of _Tap is a view and is being modified inplace"): ordinary code such as
    ``ReLU(inplace=True)`` after a GroupNorm failed. Now it runs and gives the clipped sum."""
    import copy

    import exact_oracle as eo

    torch.manual_seed(0)
    net = InPlaceAfter().double()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x, y = torch.randint(0, VOCAB, (6, TOKENS)), torch.randint(0, 3, (6,))
    ref = eo.clipped_sum(eo.per_example_grads(net, x, y), eo.layer_groups(net), c, mode)
    model = bnn.convert_model(copy.deepcopy(net), clipping=mode, max_grad_norm=c)
    eo.sum_cross_entropy(model(x), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref.sums[k], rtol=1e-12, atol=1e-14, msg=k)
