"""Second attack review of issue 26's guarantee-touching pieces: the generic path's recomputation of
non-finite examples (generic._isolate_nonfinite), its masks, and the GradScaler refusal. Each test
was written to fail on ddc02f3."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast
import bpclip_fast.nn as bnn
from bpclip_fast import PrivacyEngine

EPS64 = torch.finfo(torch.float64).eps


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _removal(base, unit, inputs, y, j, C, mode="per_layer"):
    """The unit's released gradient (no noise: convert_model alone) with and without example ``j``,
    in float64. Example ``j`` is non-finite, so its own factor is 0: the two must be equal."""
    def run(keep):
        m = copy.deepcopy(base)
        bnn.convert_model(m, clipping=mode, max_grad_norm=[C, 1e6] if mode == "per_layer" else C)
        out = m(*(t[keep] for t in inputs))
        nn.functional.cross_entropy(out, y[keep], reduction="sum").backward()
        return torch.cat([p.grad.flatten() for p in getattr(m, unit).parameters()])

    B = y.shape[0]
    with_j = run(list(range(B)))
    without_j = run([i for i in range(B) if i != j])
    return with_j, without_j


# ------------------------------------------------ 1. the recomputation keeps other examples' inputs


class UserLSTM(nn.LSTM):
    """A subclass keeps this regression test on the generic exact path (the fused path's own:
    tests/test_fused_recurrent.py)."""


class Stateful(nn.Module):
    """An LSTM started from a per-example cell state (log-scaled features through exp, as a model of
    durations might): ``hx`` is ``[layers, B, H]`` also with ``batch_first=True``."""

    def __init__(self):
        super().__init__()
        self.rnn = UserLSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x, z):
        c0 = torch.exp(z).unsqueeze(0)  # a feature of 1000 overflows to inf: a record the path must drop alone
        out, _ = self.rnn(x, (torch.zeros_like(c0), c0))
        return self.head(out[:, -1])


def test_an_overflowing_hidden_state_drops_only_its_own_example():
    """ddc02f3 zeroed the other examples' floating inputs along dimension 0 only: an LSTM's ``hx``
    ([1, B, H] with batch_first=True) kept example j's infinite cell state in every recomputation, so
    every example's gradient stayed NaN and all were dropped; removing j restored them (0.056 > C =
    0.05 here; up to (B−1)·C)."""
    torch.manual_seed(0)
    base = Stateful().double()
    g = torch.Generator().manual_seed(1)
    B = 4
    x = torch.randn(B, 5, 3, generator=g, dtype=torch.float64)
    z = torch.randn(B, 4, generator=g, dtype=torch.float64)
    z[0] = 1000.0
    y = torch.randint(0, 2, (B,), generator=g)
    a, b = _removal(base, "rnn", (x, z), y, 0, C=0.05)
    assert float(b.norm()) > 0.05  # the others are clipped and released
    # float64, the same computations on the same rows but for the masks: ~10² roundings of scale C
    assert torch.all((a - b).abs() <= 1000 * EPS64 * 0.05 * B)



class UserMHA(nn.MultiheadAttention):
    """A user subclass, left to the generic path these tests are about (a plain nn.MultiheadAttention
    is unpacked into fused Linears: tests/test_fused_attention.py)."""


class Padded(nn.Module):
    """Self-attention over padded sequences; an empty sequence (all padding) gives NaN rows, which
    the model zeroes, as padded models do."""

    def __init__(self):
        super().__init__()
        self.attn = UserMHA(4, 2, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x, pad):
        o, _ = self.attn(x, x, x, key_padding_mask=pad)
        return self.head(torch.nan_to_num(o).sum(1))


def test_an_empty_sequence_drops_no_other_example():
    """ddc02f3: a boolean key_padding_mask is not floating, so the recomputation kept example j's
    all-padding row; j's NaN attention reached every example's recomputed gradient (0·NaN) and the
    whole batch was dropped by one empty record."""
    torch.manual_seed(0)
    base = Padded().double()
    g = torch.Generator().manual_seed(1)
    B = 4
    x = torch.randn(B, 5, 4, generator=g, dtype=torch.float64)
    pad = torch.zeros(B, 5, dtype=torch.bool)
    pad[0] = True
    y = torch.randint(0, 2, (B,), generator=g)
    a, b = _removal(base, "attn", (x, pad), y, 0, C=0.05)
    assert float(b.norm()) > 0.05
    assert torch.all((a - b).abs() <= 1000 * EPS64 * 0.05 * B)


# ------------------------------------------------ 2. a non-finite upstream row and the masks


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return x * self.w


class ExpAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.unit = Scale()
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.exp(self.unit(x)))


@pytest.mark.parametrize("mode", ["per_layer", "flat"])
def test_a_non_finite_upstream_row_drops_only_its_own_example(mode):
    """ddc02f3 masked the upstream gradient by multiplying with 0/1 rows: example j's NaN upstream
    row (its loss overflowed after the unit) became 0·NaN = NaN in every example's mask, in the
    recomputation too, so every example of the unit was dropped because of j."""
    torch.manual_seed(0)
    base = ExpAfter().double()
    g = torch.Generator().manual_seed(1)
    B = 6
    x = torch.rand(B, 3, generator=g, dtype=torch.float64) + 1.0  # aligned gradients: the sum exceeds C
    x[0] = 1000.0
    y = torch.zeros(B, dtype=torch.long)
    C = 0.05
    a, b = _removal(base, "unit", (x,), y, 0, C=C, mode=mode)
    assert float(b.norm()) > C
    assert torch.all((a - b).abs() <= 1000 * EPS64 * C * B)


class Masked(nn.Module):
    """Attention with a per-example additive mask ``[B·heads, T, S]`` (as the Hugging Face models
    build from each example's attention mask)."""

    def __init__(self):
        super().__init__()
        self.attn = UserMHA(4, 2, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x, bias):
        o, _ = self.attn(x, x, x, attn_mask=bias.repeat_interleave(2, dim=0))
        return self.head(torch.nan_to_num(o).sum(1))


def test_a_per_example_attention_mask_of_minus_infinity_drops_only_its_own_example():
    """ddc02f3: a float ``[B·heads, T, S]`` mask has no B rows in dimension 0 (heads > 1), so the
    recomputation kept example j's all −∞ mask and every example was dropped."""
    torch.manual_seed(0)
    base = Masked().double()
    g = torch.Generator().manual_seed(1)
    B, T = 4, 5
    x = torch.randn(B, T, 4, generator=g, dtype=torch.float64)
    bias = torch.zeros(B, T, T, dtype=torch.float64)
    bias[0] = float("-inf")
    y = torch.randint(0, 2, (B,), generator=g)
    a, b = _removal(base, "attn", (x, bias), y, 0, C=0.05)
    assert float(b.norm()) > 0.05
    assert torch.all((a - b).abs() <= 1000 * EPS64 * 0.05 * B)


# ------------------------------------------------ 4. the GradScaler refusal after a backward pass


def _private_linear(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3))
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
                                             noise_multiplier=1.0, clipping="flat", max_grad_norm=1.0)
    return engine, model, opt, loader


def _steps(engine):
    return sum(n for _, _, n in engine.accountant.history)


def test_a_grad_scaler_refusal_after_a_backward_pass_is_charged():
    """ddc02f3 refused GradScaler uncharged, but the noise is added in the backward: the batch's noised
    gradient was in .grad before scaler.step(), and a loop that read it and caught the refusal got a
    release of every batch for free (ε stayed 0 over any number of batches)."""
    engine, model, opt, loader = _private_linear()
    scaler = torch.amp.GradScaler("cpu")
    it = iter(loader)
    seen = []
    for k in range(3):
        xb, yb = next(it)
        scaler.scale(nn.functional.cross_entropy(model(xb), yb)).backward()
        seen.append(model[0].weight.grad.clone())  # the release, readable before the step
        with pytest.raises(bpclip_fast.StepRefused, match=r"GradScaler is not supported.*bfloat16") as info:
            scaler.step(opt)
        assert info.value.charged and _steps(engine) == k + 1
        assert all(p.grad is None for p in model.parameters())
    xb, yb = next(it)  # a normal step still works after the refusals, with a fresh draw
    nn.functional.cross_entropy(model(xb), yb).backward()
    assert not any(torch.equal(model[0].weight.grad, s) for s in seen)
    opt.step()
    assert _steps(engine) == 4


def test_a_grad_scaler_refusal_with_no_batch_drawn_is_not_charged():
    engine, model, opt, loader = _private_linear()
    with pytest.raises(bpclip_fast.StepRefused, match="GradScaler") as info:
        opt.step(grad_scaler=torch.amp.GradScaler("cpu"))
    assert not info.value.charged and _steps(engine) == 0


# ------------------------------------------------ the charging of a backward with no batch drawn


def test_backward_passes_on_the_last_batch_after_its_step_release_nothing_uncharged():
    """ddc02f3: after a step, the loop ran the previous batch's backward again (no new batch drawn),
    read .grad, zero_grad, and repeated: each pass held the same clipped sum under a fresh draw (a
    cleared gradient is redrawn), none was charged (ε of one step), so averaging them recovered the
    clean sum. Now refused before anything of the pass is computed."""
    engine, model, opt, loader = _private_linear()
    xb, yb = next(iter(loader))
    nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
    opt.zero_grad()
    released = []
    for _ in range(3):
        try:
            nn.functional.cross_entropy(model(xb), yb).backward()
        except RuntimeError as exc:
            assert "no batch was drawn" in str(exc) and all(p.grad is None for p in model.parameters())
            break
        released.append(model[0].weight.grad.clone())
        opt.zero_grad()
    assert released == [] and _steps(engine) == 1
    xb, yb = next(iter(loader))  # the next batch trains as usual
    nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
    assert _steps(engine) == 2
