"""``make_private(integer_noise=True)`` (bpclip_fast/integer_noise.py): every layer's gradient
released through integers.

- each released coordinate is ``γ·(integer)/multiplier``, in every mode, loss reduction and float
  dtype, and a layer no backward reached releases noise alone, also on the grid;
- end to end, removing one example moves the released integers by at most the bound the charge is
  proved from (``Δ/γ + 2√D``; the noise is the same draw on both data sets, so the difference of the
  two releases is the difference of the rounded sums, exactly);
- the noise has the std ``⌈σΔ/γ⌉γ`` (over the coordinates of one step);
- the accountant: ``σ/EFFECTIVE_FACTOR`` at integer RDP orders, never less ε than the float noise;
  ``make_private_with_epsilon`` keeps its target;
- the two steps of the module docstring's proof about the discrete Gaussian's RDP, numerically: the
  moments at integer orders equal the continuous Gaussian's, and the symmetric two-point inequality;
- the refusals (banded noise, PLD, half-precision parameters, a non-bool) and the checkpoint's check.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine, integer_noise
from bpclip_fast.accounting import RDPAccountant

MODES = {
    "flat": dict(clipping="flat", max_grad_norm=1.0),
    "per_layer": dict(clipping="per_layer", max_grad_norm=1.0),
    "backprop": dict(clipping="backprop", input_clip=2.0, grad_clip=1.0),
}


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _private(model, x, y, batch_size, sigma=1.0, seed=7, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the explicit noise_seed's warning
        engine = PrivacyEngine(kw.pop("accountant", "rdp"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        m, o, dl = engine.make_private(module=model, optimizer=opt, data_loader=DataLoader(
            TensorDataset(x, y), batch_size=batch_size), noise_multiplier=sigma, noise_seed=seed,
            integer_noise=True, **kw)
    return engine, m, o, dl


def _one_step(engine, m, o, dl, loss_reduction="mean"):
    xb, yb = next(iter(dl))
    o.zero_grad()
    nn.functional.cross_entropy(m(xb), yb, reduction=loss_reduction).backward()
    o.step()
    return [(st, [p.grad.detach().clone() for p in st.params]) for st in engine._steps_of]


def _integers(st, grads, multiplier):
    e = integer_noise.grid_exp(float(st.layer.sensitivity), st.integer_bits)
    return [g.double() * multiplier * 2.0 ** -e for g in grads]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_every_released_coordinate_is_on_the_grid(mode, dtype, loss_reduction):
    x, y = torch.randn(64, 6, dtype=dtype), torch.randint(0, 3, (64,))
    engine, m, o, dl = _private(_model(dtype), x, y, 16, loss_reduction=loss_reduction, **MODES[mode])
    multiplier = 16.0 if loss_reduction == "mean" else 1.0
    for st, grads in _one_step(engine, m, o, dl, loss_reduction):
        for z in _integers(st, grads, multiplier):
            assert torch.equal(z, z.round())
            assert float(z.abs().max()) > 0


def test_a_layer_no_backward_reached_releases_noise_on_the_grid():
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    model = _model()
    engine, m, o, dl = _private(model, x, y, 16, **MODES["per_layer"])
    xb, yb = next(iter(dl))
    o.zero_grad()
    out = m[0](xb)  # the second layer is not reached
    out.sum().backward()
    o.step()
    st = engine._steps_of[1]
    z = _integers(st, [p.grad for p in st.params], 16.0)
    sigma = integer_noise.sigma_units(engine.gradient_noise_multiplier, float(st.layer.sensitivity),
                                      integer_noise.grid_exp(float(st.layer.sensitivity), st.integer_bits))
    flat = torch.cat([t.reshape(-1) for t in z])
    assert torch.equal(flat, flat.round())
    assert 0.3 * sigma < float(flat.std()) < 3 * sigma  # noise alone, of its std (27 coordinates)


def _removal_pair(mode, dtype):
    """The releases of one step on D and on D less example 0, with the same seed and sum loss: one
    shuffled batch of the whole data set (zCDP), so that each step's batch is the data set."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, 6, generator=gen, dtype=dtype) * 3
    y = torch.randint(0, 3, (24,), generator=gen)
    out = []
    for xs, ys in ((x, y), (x[1:], y[1:])):
        engine, m, o, dl = _private(_model(dtype, seed=5), xs, ys, len(xs), loss_reduction="sum", accountant="zcdp",
                                    poisson_sampling=False, **MODES[mode])
        out.append(_one_step(engine, m, o, dl, "sum"))
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_removing_an_example_moves_the_integers_within_the_proved_bound(mode, dtype):
    with_all, without = _removal_pair(mode, dtype)
    coords = sum(p.numel() for st, _ in with_all for p in st.params)
    total = 0.0
    for (st, g1), (st2, g2) in zip(with_all, without):
        z1, z2 = _integers(st, g1, 1.0), _integers(st2, g2, 1.0)
        diff = torch.cat([(a - b).reshape(-1) for a, b in zip(z1, z2)])
        assert torch.equal(diff, diff.round())
        e = integer_noise.grid_exp(float(st.layer.sensitivity), st.integer_bits)
        bound = float(st.layer.sensitivity) * 2.0 ** -e + 2 * math.sqrt(coords)
        if mode == "backprop":  # each layer its own mechanism: its own bound
            assert float(diff.norm()) <= bound
        total += float(diff.norm()) ** 2
    if mode != "backprop":  # one Δ over all the layers, one grid
        assert math.sqrt(total) <= bound
    assert total > 0  # the example moved the release


def test_the_noise_has_the_std_of_its_units():
    x, y = torch.zeros(512, 6), torch.zeros(512, dtype=torch.long)
    model = nn.Sequential(nn.Linear(6, 400))
    engine, m, o, dl = _private(model, x, y, 128, sigma=2.0, **MODES["flat"])
    xb, _ = next(iter(dl))
    o.zero_grad()
    (m(xb) * 0).sum().backward()  # clipped sum 0: the release is γ(k + Y)/B̄ with k = 0
    o.step()
    st = engine._steps_of[0]
    delta = float(st.layer.sensitivity)
    e = integer_noise.grid_exp(delta, st.integer_bits)
    s = integer_noise.sigma_units(2.0, delta, e)
    assert s >= 2.0 * delta * 2.0 ** -e
    z = torch.cat([t.reshape(-1) for t in _integers(st, [p.grad for p in st.params], 128.0)])
    n = z.numel()
    assert abs(float(z.pow(2).mean()) / s ** 2 - 1) <= 6 * math.sqrt(2 / n)


def test_the_accountant_is_charged_sigma_over_the_factor_at_integer_orders():
    x, y = torch.randn(200, 6), torch.randint(0, 3, (200,))
    engine, m, o, dl = _private(_model(), x, y, 20, sigma=1.3, **MODES["flat"])
    for _ in range(3):
        _one_step(engine, m, o, dl)
    assert engine.effective_noise_multiplier == pytest.approx(1.3 / integer_noise.EFFECTIVE_FACTOR, rel=1e-15)
    ref = RDPAccountant(orders=integer_noise.INTEGER_ORDERS)
    for _ in range(3):
        ref.step(noise_multiplier=1.3 / integer_noise.EFFECTIVE_FACTOR, sample_rate=0.1)
    assert engine.get_epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)
    float_ref = RDPAccountant()
    for _ in range(3):
        float_ref.step(noise_multiplier=1.3, sample_rate=0.1)
    assert engine.get_epsilon(1e-5) >= float_ref.get_epsilon(1e-5)


def test_make_private_with_epsilon_keeps_its_target():
    x, y = torch.randn(200, 6), torch.randint(0, 3, (200,))
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine()
        m, o, dl = engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=20), target_epsilon=2.0, target_delta=1e-5,
            epochs=1, integer_noise=True, clipping="flat", max_grad_norm=1.0)
    for _ in range(len(dl)):
        _one_step(engine, m, o, dl)
    assert engine.get_epsilon(1e-5) <= 2.0
    assert engine.get_epsilon(1e-5) >= 2.0 * 0.97  # and spends it (the search's tolerance)


# ---------------------------------------------------------------- the RDP facts of the module docstring


@pytest.mark.parametrize("s", [1.0, 2.0, 3.5])
@pytest.mark.parametrize("mu", [1, 2, 5])
def test_discrete_gaussian_moments_at_integer_orders_equal_the_continuous(s, mu):
    y = np.arange(-4000, 4001, dtype=np.float64)
    log_p0 = -y ** 2 / (2 * s * s)
    log_p1 = -(y - mu) ** 2 / (2 * s * s)
    log_z = np.logaddexp.reduce(log_p0)
    for lam in (2, 3, 5, 8):
        moment = np.logaddexp.reduce(log_p0 - log_z + lam * (log_p1 - log_p0))
        # 8001 float64 terms, each exponent rounded once: |error| <= 8001·2^-53 < 1e-12 on the log
        assert moment == pytest.approx(lam * (lam - 1) * mu * mu / (2 * s * s), rel=1e-12, abs=8001 * 2.0 ** -53)


def test_the_symmetric_two_point_inequality_holds_exactly_on_a_grid():
    """Step 2 of the module docstring's proof, in exact rational arithmetic (integer orders λ, rational
    q and x, so no tolerance): ``G(x) = h(u) + x·h(v) = (u − 1)(r(u) − r(1/v)) ≥ 0`` with
    ``h(t) = t^λ − t^(1−λ)``, ``r(t) = h(t)/(t − 1)``, ``u = 1 − q + qx``, ``v = 1 − q + q/x``, and
    ``uv ≥ 1``; near x = 1, where G shrinks like (x − 1)⁴, as well as far from it."""
    from fractions import Fraction as F

    xs = [F(1), F(1001, 1000), F(999, 1000), F(11, 10), F(3, 2), F(2), F(7), F(1000), F(1, 3), F(1, 50)]
    qs = [F(0), F(1, 1000), F(1, 10), F(1, 2), F(9, 10), F(1)]
    for lam in (2, 3, 7, 32):
        h = lambda t: t ** lam - t ** (1 - lam)  # noqa: E731
        r = lambda t: h(t) / (t - 1)  # noqa: E731
        for q in qs:
            for x in xs:
                u, v = 1 - q + q * x, 1 - q + q / x
                g = h(u) + x * h(v)
                assert g >= 0, (lam, q, x)
                assert u * v >= 1
                if u != 1 and v != 1:
                    assert g == (u - 1) * (r(u) - r(1 / v)), (lam, q, x)


# ---------------------------------------------------------------- refusals


def _make(**kw):
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    model = _model(kw.pop("dtype", torch.float32))
    engine = PrivacyEngine(kw.pop("accountant", "rdp"))
    return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               data_loader=DataLoader(TensorDataset(x, y), batch_size=kw.pop("batch_size", 16)),
                               noise_multiplier=1.0, **{**MODES["flat"], **kw})


@pytest.mark.parametrize("kw, match", [
    (dict(integer_noise=True, noise="banded", bands=2), r"integer_noise=True is not available here: correlated"),
    (dict(integer_noise=True, accountant="pld"), r"integer_noise=True is not available here: the PLD accountant"),
    (dict(integer_noise=True, dtype=torch.bfloat16), r"integer_noise=True needs float32 or float64 parameters"),
    (dict(integer_noise=1), r"integer_noise must be True or False"),
])
def test_refusals(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _make(**kw)


def test_a_checkpoint_resumes_only_with_its_integer_noise():
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    engine, m, o, dl = _private(_model(), x, y, 16, **MODES["flat"])
    _one_step(engine, m, o, dl)
    state = engine.state_dict()
    model = _model()
    other = PrivacyEngine()
    other.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       data_loader=DataLoader(TensorDataset(x, y), batch_size=16), noise_multiplier=1.0,
                       **MODES["flat"])
    with pytest.raises(ValueError, match=r"integer_noise=True, this engine has integer_noise=False"):
        other.load_state_dict(state)


# ---------------------------------------------------------------- every path releases on the grid


class _Custom(nn.Module):
    """A module of the user's own: the generic path trains it (two same-shaped parameters)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.shift = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return torch.tanh(x * self.scale + self.shift)


def _check_grid(engine, multiplier):
    for st in engine._steps_of:
        e = integer_noise.grid_exp(float(st.layer.sensitivity), st.integer_bits)
        for p in st.params:
            if p.grad is not None:
                z = p.grad.double() * multiplier * 2.0 ** -e
                assert torch.equal(z, z.round()), st.name


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_generic_units_and_exact_layers_release_on_the_grid_with_their_own_positions(mode):
    model = nn.Sequential(_Custom(6), nn.LayerNorm(6), nn.Linear(6, 3))
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    engine, m, o, dl = _private(model, x, y, 16, **MODES[mode])
    xb, yb = next(iter(dl))
    o.zero_grad()
    nn.functional.cross_entropy(m(xb), yb).backward()
    _check_grid(engine, 16.0)
    unit = model[0]
    # the unit's two parameters hold different draws (positions 0..5 and 6..11 of the unit)
    assert not torch.equal(unit.scale.grad, unit.shift.grad)


def test_a_small_vit_releases_on_the_grid():
    from bpclip_fast import models
    model = models.vit(dim=16, depth=1, heads=2)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    engine, m, o, dl = _private(model, x, y, 4, **MODES["flat"])
    xb, yb = next(iter(dl))
    o.zero_grad()
    nn.functional.cross_entropy(m(xb), yb).backward()
    _check_grid(engine, 4.0)


@pytest.mark.parametrize("mode", ["flat", "backprop"])
def test_a_compiled_model_releases_on_the_grid(mode):
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    engine, m, o, dl = _private(_model(), x, y, 16, **MODES[mode])
    compiled = torch.compile(m)
    for i, (xb, yb) in enumerate(dl):
        o.zero_grad()
        nn.functional.cross_entropy(compiled(xb), yb).backward()
        _check_grid(engine, 16.0)
        o.step()
        if i == 1:
            break


# ---------------------------------------------------------------- micro-batches (reviews 46 F1, 47 N1, N2)


def _two_halves(engine, m, o, dl, how):
    xb, yb = next(iter(dl))
    o.zero_grad()
    half = len(xb) // 2
    parts = (slice(0, half), slice(half, None))
    if how == "micro-batches":
        for part in parts:
            nn.functional.cross_entropy(m(xb[part]), yb[part], reduction="sum").backward()
    else:  # two forwards, one backward of their summed loss: each layer's backward runs twice in one pass
        sum(nn.functional.cross_entropy(m(xb[part]), yb[part], reduction="sum") for part in parts).backward()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("how", ["micro-batches", "one backward of two forwards"])
def test_a_second_backward_of_a_layer_in_a_step_is_refused_before_it_lands(mode, how):
    """A later backward's clipped sum would land raw on the released integers (``.grad/γ`` modulo 1
    showed it noise-free), and a draw per backward would release a split whose examples move
    between the passes: refused, charged, before anything of it reaches ``.grad``."""
    from bpclip_fast.rules import StepRefused

    x, y = torch.randn(64, 6, dtype=torch.float64), torch.randint(0, 3, (64,))
    engine, m, o, dl = _private(_model(torch.float64), x, y, 16, loss_reduction="sum", **MODES[mode])
    with pytest.raises(StepRefused, match=r"integer_noise=True") as info:
        _two_halves(engine, m, o, dl, how)
    assert info.value.rule == "integer-passes" and info.value.charged
    assert all(p.grad is None for p in m.parameters())  # discarded
    assert len(engine.accountant) == 1


def test_a_pass_that_lands_nothing_then_the_backward_is_released_once():
    """``torch.autograd.grad`` with respect to the inputs (adversarial examples) runs the layers'
    backward without landing; the training backward after it is the step's one release."""
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    engine, m, o, dl = _private(_model(), x, y, 16, **MODES["flat"])
    xb, yb = next(iter(dl))
    o.zero_grad()
    xb = xb.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(nn.functional.cross_entropy(m(xb), yb), xb)
    nn.functional.cross_entropy(m((xb + 0.01 * gx.sign()).detach()), yb).backward()
    _check_grid(engine, 16.0)
    o.step()
    assert len(engine.accountant) == 1


def test_make_private_with_epsilon_refuses_pld_before_calibrating(monkeypatch):
    from bpclip_fast import accounting

    def calibrated(**kw):
        raise AssertionError("calibrated before the refusal")

    monkeypatch.setattr(accounting, "get_noise_multiplier", calibrated)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    model = _model()
    engine = PrivacyEngine("pld")
    with pytest.raises(ValueError, match=r"make_private_with_epsilon: integer_noise=True is not available here: the PLD"):
        engine.make_private_with_epsilon(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         data_loader=DataLoader(TensorDataset(x, y), batch_size=16), target_epsilon=2.0,
                                         target_delta=1e-5, epochs=1, integer_noise=True, clipping="flat",
                                         max_grad_norm=1.0)


@pytest.mark.parametrize("clear", ["zero_grad", "set_to_none=False", "grad = None"])
@pytest.mark.parametrize("what", ["the second half", "the whole batch again"])
def test_clearing_the_gradient_does_not_allow_a_second_release(clear, what):
    """Review 48 G1: a clear between two landing passes gave the second a fresh draw, so a loop read
    one release per pass, charged once (the whole batch m times: a membership test at 0.84 where the
    charge allows 0.55). A landing pass after the step's first is refused whatever was cleared."""
    from bpclip_fast.rules import StepRefused

    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    engine, m, o, dl = _private(_model(), x, y, 16, **MODES["flat"])
    xb, yb = next(iter(dl))
    o.zero_grad()
    first = xb[: len(xb) // 2] if what == "the second half" else xb
    nn.functional.cross_entropy(m(first), yb[: len(first)]).backward()
    if clear == "zero_grad":
        o.zero_grad()
    elif clear == "set_to_none=False":
        o.zero_grad(set_to_none=False)
    else:
        for p in m.parameters():
            p.grad = None
    second = xb[len(xb) // 2:] if what == "the second half" else xb
    with pytest.raises(StepRefused, match=r"integer_noise=True") as info:
        nn.functional.cross_entropy(m(second), yb[len(xb) - len(second):]).backward()
    assert info.value.rule == "integer-passes"


@pytest.mark.parametrize("mode", ["flat", "per_layer", "backprop"])
def test_a_pass_that_lands_nothing_may_run_a_layer_twice(mode):
    """Review 48 G2: gradients with respect to the inputs over two forwards run each layer's backward
    twice in a pass that lands nothing: not a release, not refused; the training backward after it is
    the step's one release."""
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    engine, m, o, dl = _private(_model(), x, y, 16, **MODES[mode])
    xb, yb = next(iter(dl))
    o.zero_grad()
    xa = xb.clone().requires_grad_(True)
    loss = nn.functional.cross_entropy(m(xa[:8]), yb[:8]) + nn.functional.cross_entropy(m(xa[8:]), yb[8:])
    (gx,) = torch.autograd.grad(loss, xa)
    nn.functional.cross_entropy(m((xb + 0.01 * gx.sign()).detach()), yb).backward()
    _check_grid(engine, 16.0)
    o.step()
    assert len(engine.accountant) == 1
