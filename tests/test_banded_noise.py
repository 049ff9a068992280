"""Correlated noise (``make_private(noise="banded", bands=b)``, :mod:`bpclip_fast.banded`): the
noise rows satisfy ``C·w = σΔ·z`` with the regenerated Philox draws, their covariance across steps is
``σ²Δ²·C⁻¹C⁻ᵀ``, the rows do not depend on the data, ``bands=1`` is independent noise bit for bit,
each row is drawn once, the groups are b-min-separated, and what cannot be supported is refused."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast
from bpclip_fast import _ops, banded
from bpclip_fast.engine._common import InsecureSeedWarning

SEED = 1234
N, BATCH = 64, 4
EPS32 = torch.finfo(torch.float32).eps


def data(seed=0, d=12, k=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, d, generator=g), torch.randint(0, k, (N,), generator=g)


def make(X, Y, *, mode="flat", noise="banded", bands=4, sigma=0.7, lr=0.0, width=24, model_seed=0, device="cpu",
         **kw):
    torch.manual_seed(model_seed)
    model = nn.Sequential(nn.Linear(X.shape[1], width), nn.ReLU(), nn.Linear(width, 3)).to(device)
    opt = kw.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=lr)
    bounds = dict(max_grad_norm=1.0) if mode != "backprop" else dict(input_clip=1.0, grad_clip=1.0)
    engine = bpclip_fast.PrivacyEngine(kw.pop("accountant", "rdp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureSeedWarning)
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(X, Y), batch_size=BATCH),
            noise_multiplier=sigma, clipping=mode, noise=noise, bands=bands, noise_seed=kw.pop("seed", SEED),
            **bounds, **kw)
    return engine, model, opt, loader


def flat_grads(model):
    return torch.cat([p.grad.detach().reshape(-1).double().cpu() for p in model.parameters()])


def run(engine, model, opt, loader, steps, zero_loss=False):
    """Released gradients (flat, float64) and the batches' indices of ``steps`` steps."""
    out, batches = [], []
    it = iter(loader)
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        batches.append(engine._counter.last_t)
        device = next(model.parameters()).device
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y) if len(x) else model(x).sum()
        (loss * 0 if zero_loss else loss).backward()
        out.append(flat_grads(model))
        opt.step()
    return torch.stack(out), batches


def std_of(engine):
    """The release's noise std per coordinate: σC/B̄ (flat, mean loss)."""
    return engine.gradient_noise_multiplier * 1.0 / engine.expected_batch_size


def layer_rows(engine, t):
    """The regenerated draws ``z_t`` of every layer, flat in parameter order (float64)."""
    out = []
    for index, st in enumerate(engine._steps_of):
        numel = sum(p.numel() for p in st.params)
        z = torch.empty(numel, dtype=torch.float32, device=st.params[0].device)
        _ops.philox_noise_(z, engine._stream.seed, engine._stream.offset_at(t, index), 1.0)
        out.append(z.double().cpu())
    return torch.cat(out)


def inverse_strategy(c, T):
    """``C⁻¹`` (T×T, float64) of the lower-triangular banded Toeplitz ``C``."""
    C = torch.zeros(T, T, dtype=torch.float64)
    for j, cj in enumerate(c):
        C += cj * torch.diag(torch.ones(T - j, dtype=torch.float64), -j)
    return torch.linalg.inv(C)


# ----------------------------------------------------------------------------- the strategy
def test_bsr_coefficients_are_the_normalised_square_root_of_the_workload():
    """(Σ_j c_j x^j)² matches 1/(1−x) (and 1/((1−x)(1−βx))) up to the normalisation, through x^{b−1}."""
    for beta in (0.0, 0.9):
        for b in (1, 2, 5, 16):
            c = torch.tensor(banded.bsr_coefficients(b, beta), dtype=torch.float64)
            assert abs(c.norm().item() - 1) < 1e-15 * b
            square = torch.zeros(b, dtype=torch.float64)
            for i in range(b):
                for j in range(b - i):
                    square[i + j] += c[i] * c[j]
            workload = torch.tensor([sum(beta ** m for m in range(k + 1)) for k in range(b)], dtype=torch.float64)
            assert torch.allclose(square / square[0], workload, rtol=1e-13, atol=0)
    assert banded.bsr_coefficients(1) == (1.0,)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4", banded.MAX_BANDS + 1])
def test_bands_out_of_range_are_refused(bad):
    X, Y = data()
    with pytest.raises(ValueError, match="bands"):
        make(X, Y, bands=bad)


def test_a_row_std_outside_the_kernels_range_is_refused_at_make_private():
    """Rows are drawn at σΔ/(B̄·c₀) (c₀ < 1): under the sum loss σΔ = 9e29 passes the independent
    draw's range but gives rows above 1e30, which failed the first step's op (review 40 F8); now
    make_private refuses it, naming the layers."""
    X, Y = data()
    c0 = banded.bsr_coefficients(2)[0]
    assert 9e29 / c0 >= 1e30 > 9e29
    with pytest.raises(ValueError, match=r"noise='banded' would draw rows outside the kernels' range .*: "
                                         r"0: rows' std 1\.01e\+30; 2: rows' std 1\.01e\+30"):
        make(X, Y, bands=2, sigma=9e29, loss_reduction="sum")
    make(X, Y, bands=2, sigma=8e29, loss_reduction="sum")  # 8e29/c₀ < 1e30: accepted


# ----------------------------------------------------------------------------- the noise rows
@pytest.mark.parametrize("mode, device", [("flat", "cpu"), ("per_layer", "cpu"), ("backprop", "cpu"),
                                          pytest.param("flat", "cuda", marks=pytest.mark.cuda),
                                          pytest.param("backprop", "cuda", marks=pytest.mark.cuda)])
def test_rows_solve_the_recursion_with_the_regenerated_draws(mode, device):
    """With a zero loss the release is the noise row alone: ``Σ_j c_j w_{t−j} = σΔ z_t`` with ``z_t``
    regenerated from its Philox key, to fp32 rounding of the recursion; the engine's stored rows are
    the released ones bit for bit."""
    X, Y = data()
    engine, model, opt, loader = make(X, Y, mode=mode, bands=4, device=device)
    T = 10
    W, batches = run(engine, model, opt, loader, T, zero_loss=True)
    assert batches == list(range(T))
    c = engine.band_coefficients
    stds = torch.cat([torch.full((sum(p.numel() for p in st.params),), _layer_std(engine, st), dtype=torch.float64)
                      for st in engine._steps_of])
    for t in range(T):
        y = sum(c[j] * W[t - j] for j in range(len(c)) if t - j >= 0)
        z = layer_rows(engine, t)
        # each w is the fp32 result of ≤ b rounded steps on terms of size ≤ σΔ|z|/c_0 + Σ|c_j/c_0||w|:
        scale = stds * z.abs() + sum(abs(c[j]) * W[t - j].abs() for j in range(1, len(c)) if t - j >= 0)
        assert ((y - stds * z).abs() <= 2 * len(c) * EPS32 * scale + 1e-30).all()
    stored = torch.cat([st.band.newest_row().double().cpu() for st in engine._steps_of])
    assert torch.equal(stored, W[-1])


def _layer_std(engine, st):
    from bpclip_fast.engine import correlated
    return correlated.std(engine, st)


def test_covariance_across_steps_is_the_inverse_strategy_gram():
    """Empirical covariance of the rows over ~20k coordinates against ``σ²Δ²·C⁻¹C⁻ᵀ``: each entry
    within 6 standard errors (``√((Σ_tt Σ_ss + Σ_ts²)/P)`` for Gaussian pairs)."""
    X, Y = data(d=100)
    engine, model, opt, loader = make(X, Y, bands=3, width=200)
    T = 8
    W, _ = run(engine, model, opt, loader, T, zero_loss=True)
    P = W.shape[1]
    s = std_of(engine)
    M = inverse_strategy(engine.band_coefficients, T)
    sigma = s * s * (M @ M.T)
    emp = (W @ W.T) / P
    se = torch.sqrt((torch.outer(sigma.diagonal(), sigma.diagonal()) + sigma ** 2) / P)
    assert ((emp - sigma).abs() <= 6 * se).all(), ((emp - sigma) / se).abs().max()
    # the per-step marginal std is the claim, and beyond the first step it is not σΔ: the rows are correlated
    assert sigma[1, 0] < 0 and abs(emp[1, 0] / se[1, 0]) > 6


def test_bands_one_is_independent_noise_bit_for_bit():
    X, Y = data()
    a = run(*make(X, Y, noise="independent", bands=1, lr=0.1), 6)[0]
    b = run(*make(X, Y, noise="banded", bands=1, lr=0.1), 6)[0]
    assert torch.equal(a, b)


def test_rows_do_not_depend_on_the_data_and_the_clipping_holds():
    """Two runs from one seed on data sets that differ in one example: the same batches, the same
    noise; the releases differ only where that example was drawn, by at most 2C/B̄ (replace-one)."""
    X, Y = data()
    X2 = X.clone()
    k = 5
    X2[k] = 100 * X2[k] + 3
    ra, ba = run(*make(X, Y, bands=4), 24)
    eb = make(X2, Y, bands=4)
    rb, bb = run(*eb, 24)
    assert ba == bb
    sampler = eb[0].data_loader.batch_sampler
    for t in range(24):
        diff = (ra[t] - rb[t]).norm().item()
        if k in sampler.global_batch(t).tolist():
            assert diff <= 2 * 1.0 / BATCH * (1 + 1e-5)
        else:
            assert diff == 0.0


def test_each_example_is_in_at_most_one_of_every_b_consecutive_batches():
    X, Y = data()
    engine, model, opt, loader = make(X, Y, bands=4)
    sampler = engine.data_loader.batch_sampler
    members = [set(sampler.global_batch(t).tolist()) for t in range(200)]
    for t in range(200 - 3):
        seen = [i for s in members[t:t + 4] for i in s]
        assert len(seen) == len(set(seen))
    assert math.isclose(engine.accounting_sample_rate, BATCH / (N // 4))


# ----------------------------------------------------------------------------- refusals
def test_a_second_draw_within_a_step_is_refused_and_charged():
    """zero_grad between two backward passes of one step: the first pass's row may have been seen;
    a fresh row would release the past rows' noise again, so the step is refused (charged)."""
    X, Y = data()
    engine, model, opt, loader = make(X, Y, bands=3)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.zero_grad()
    with pytest.raises(bpclip_fast.StepRefused) as info:
        nn.functional.cross_entropy(model(x), y).backward()
    assert info.value.rule == "banded-redraw" and info.value.charged
    assert len(engine.accountant) == 1


@pytest.mark.parametrize("kw, match", [
    (dict(adaptive=True), "adaptive"),
    (dict(poisson_sampling=False, accountant="zcdp"), "cyclic Poisson"),
    (dict(noise="independent", bands=3), "needs noise='banded'"),
    (dict(noise="correlated"), "noise must be one of"),
])
def test_what_banded_noise_cannot_do_is_refused(kw, match):
    X, Y = data()
    with pytest.raises(ValueError, match=match):
        make(X, Y, **kw)


def test_half_precision_parameters_are_refused():
    X, Y = data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 3)).half()
    engine = bpclip_fast.PrivacyEngine()
    with pytest.raises(ValueError, match="float32 or float64 parameters"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=DataLoader(TensorDataset(X.half(), Y), batch_size=BATCH),
                            noise_multiplier=1.0, clipping="flat", max_grad_norm=1.0, noise="banded", bands=2)


# ----------------------------------------------------------------------------- checkpoints
def test_resume_keeps_the_groups_and_restarts_the_band():
    X, Y = data()
    engine, model, opt, loader = make(X, Y, bands=4, seed=None)
    run(engine, model, opt, loader, 5)
    state = opt.state_dict()
    assert "noise_seed" not in str(state) and all("band" not in k or k == "bands"
                                                  for k in state["bpclip_fast_privacy_engine"])
    e2, m2, o2, l2 = make(X, Y, bands=4, seed=None)
    o2.load_state_dict(state)
    s1, s2 = engine.data_loader.batch_sampler, e2.data_loader.batch_sampler
    assert s2.partition_seed == s1.partition_seed
    assert all(st.band.next_row is None and st.band.ring is None for st in e2._steps_of)
    W, batches = run(e2, m2, o2, l2, 3)
    assert batches == [5, 6, 7] and len(e2.accountant) == 8
    e3 = make(X, Y, bands=2, seed=None)
    with pytest.raises(ValueError, match="bands=4"):
        e3[2].load_state_dict(state)


class _Scale(nn.Module):
    """A module no fused layer covers (a trainable per-feature scale): trained by the generic path."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.scale


@pytest.mark.parametrize("mode", ["flat", "per_layer", "backprop", "generic"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_row_of_a_layer_has_its_one_std(mode, reduction, monkeypatch):
    """Rows made in a backward (each path passes its own std) and rows made at the charge or the
    fallback use one number per layer, ``LayerStep.band_std``: the backward's own std is checked to
    be it, and a path whose std differed is refused rather than released at another scale."""
    X, Y = data()
    kw = {}
    if mode == "generic":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(X.shape[1], 24), _Scale(24), nn.ReLU(), nn.Linear(24, 3))
        kw["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.0)
        mode = "flat"
    seen = []
    real = banded.LayerBand.row
    monkeypatch.setattr(banded.LayerBand, "row", lambda self, row, std, *a, **k: (
        seen.append((self, std)), real(self, row, std, *a, **k))[1])
    if kw:
        engine = bpclip_fast.PrivacyEngine()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = engine.make_private(
                module=model, optimizer=kw["optimizer"], data_loader=DataLoader(TensorDataset(X, Y), batch_size=BATCH),
                noise_multiplier=0.7, clipping=mode, max_grad_norm=1.0, noise="banded", bands=4, noise_seed=SEED,
                loss_reduction=reduction)
        assert any("_bp_slots" in st.layer.__dict__ for st in engine._steps_of)
    else:
        engine, model, opt, loader = make(X, Y, mode=mode, bands=4, loss_reduction=reduction)
    run(engine, model, opt, loader, 3)
    one = {st.band: st.band_std for st in engine._steps_of}
    assert len(seen) == 3 * len(one) and all(std == one[band] for band, std in seen)
    st = engine._steps_of[0]
    st.band_std *= 1 + 1e-9  # what a path computing another std would meet: refused, never released
    x, y = next(iter(loader))
    with pytest.raises(Exception, match="one scale"):
        nn.functional.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("mode", ["flat", "per_layer", "backprop"])
@pytest.mark.parametrize("input_pass", ["autograd.grad", "backward(inputs=[x])"])
def test_an_input_gradient_pass_before_the_backward_leaves_the_row_to_it(mode, input_pass):
    """Adversarial training: the input's gradient first (its parameter gradients never reach .grad,
    autograd drops them unseen), then the step's backward on the perturbed batch. The first pass
    makes no row; the backward gets row t, whose release solves the recursion with the regenerated
    draws as in any step; a capture of the parameters' gradients stays refused."""
    X, Y = data()
    engine, model, opt, loader = make(X, Y, mode=mode, bands=3)
    W = []
    it = iter(loader)
    for _ in range(4):
        x, y = next(it)
        t = engine._counter.last_t
        opt.zero_grad()
        x = x.clone().requires_grad_(True)
        loss = nn.functional.cross_entropy(model(x), y) if len(x) else model(x).sum()
        if input_pass == "autograd.grad":
            (gx,) = torch.autograd.grad(loss, x)
        else:
            loss.backward(inputs=[x])
            gx = x.grad
        assert not any(st.band.made(t) for st in engine._steps_of)
        x_adv = (x + 0.1 * gx.sign()).detach()
        out = model(x_adv)
        (out.sum() * 0).backward()  # zero loss: the release is the noise row alone
        W.append(flat_grads(model))
        opt.step()
    W = torch.stack(W)
    c = engine.band_coefficients
    from bpclip_fast.engine import correlated
    stds = torch.cat([torch.full((st.band_layout()[1],), correlated.std(engine, st), dtype=torch.float64)
                      for st in engine._steps_of])
    for t in range(4):
        y = sum(c[j] * W[t - j] for j in range(len(c)) if t - j >= 0)
        z = layer_rows(engine, t)
        scale = stds * z.abs() + sum(abs(c[j]) * W[t - j].abs() for j in range(1, len(c)) if t - j >= 0)
        assert ((y - stds * z).abs() <= 2 * len(c) * EPS32 * scale + 1e-30).all()
    x, y = next(it)
    opt.zero_grad()
    with pytest.raises(bpclip_fast.StepRefused) as info:
        torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()))
    assert info.value.rule == "captured"
