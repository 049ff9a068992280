"""Mixed precision (issue 26): torch.autocast around the forward in every mode, and
torch.amp.GradScaler refused clearly.

Under autocast the fused layers compute in their parameters' dtype (the input cast to it, so their
kernels and proved bounds are the fp32 ones), the ops around them and the generic units' own ops in
autocast's dtype; each example's contribution stays within C."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast.nn as bnn
from bpclip_fast import PrivacyEngine

U32 = 2.0 ** -24


class UserRMSNorm(nn.RMSNorm):
    """A subclass: not converted to the fused RMSNorm, so a generic unit (as the attention)."""


class Net(nn.Module):
    def __init__(self, generic=True):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.inp = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True) if generic else None
        self.rms = UserRMSNorm(8) if generic else None
        self.head = nn.Linear(8, 3)

    def forward(self, x, tokens):
        h = self.norm(torch.tanh(self.inp(x)) + self.emb(tokens))
        if self.attn is not None:
            h = self.rms(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(h.mean(1))


def _data(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, 4, generator=g), torch.randint(0, 20, (n, 5), generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_example_moves_the_release_by_at_most_C_under_autocast(mode, dtype):
    """Removal, noise off: the fp32 releases with and without example j differ by ≤ C. Each release
    sums B clipped terms of norm ≤ C in fp32, so the two roundings add at most ~2·B·u₃₂·B·C."""
    torch.manual_seed(1)
    base = Net()
    x, t, y = _data()
    B, C = x.shape[0], 0.2

    def release(rows):
        model = copy.deepcopy(base)
        bnn.convert_model(model, clipping=mode, max_grad_norm=C)
        with torch.autocast("cpu", dtype=dtype):
            out = model(x[rows], t[rows])
        nn.functional.cross_entropy(out.float(), y[rows], reduction="sum").backward()
        return torch.cat([p.grad.double().flatten() for p in model.parameters()])

    full = release(list(range(B)))
    slack = 2 * B * B * U32
    for j in range(B):
        diff = float((full - release([i for i in range(B) if i != j])).norm())
        assert diff <= C * (1 + slack), (j, diff)


@pytest.mark.parametrize("mode", ["backprop", "flat", "per_layer"])
def test_make_private_trains_under_bf16_autocast(mode):
    torch.manual_seed(2)
    model = Net(generic=mode != "backprop") if mode != "backprop" else nn.Sequential(nn.Linear(4, 8), nn.Tanh(),
                                                                                      nn.Linear(8, 3))
    x, t, y = _data(32)
    data = TensorDataset(x, t, y) if mode != "backprop" else TensorDataset(x.mean(1), y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(max_grad_norm=1.0) if mode != "backprop" else dict(input_clip=1.0, grad_clip=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt,
                                                      data_loader=DataLoader(data, batch_size=8),
                                                      noise_multiplier=1.0, clipping=mode, **kw)
    for *inputs, target in loader:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(*inputs)
        nn.functional.cross_entropy(out.float(), target).backward()
        opt.step()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_grad_scaler_is_refused_before_anything_is_released():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, _, y = _data(32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt,
                                                      data_loader=DataLoader(TensorDataset(x.mean(1), y), batch_size=8),
                                                      noise_multiplier=1.0, clipping="flat", max_grad_norm=1.0)
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    xb, yb = next(iter(loader))
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(xb)
    scaler.scale(nn.functional.cross_entropy(out.float(), yb)).backward()
    with pytest.raises(RuntimeError, match=r"GradScaler is not supported.*bfloat16"):
        scaler.step(opt)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
