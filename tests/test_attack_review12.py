"""Attack review 12: correlated noise (``make_private(noise="banded", bands=b)``) against ordinary
training loops. Each test is a finding; see its docstring."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast
from bpclip_fast.engine._common import InsecureSeedWarning

N, BATCH = 64, 4


def data(seed=0, d=12, k=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, d, generator=g), torch.randint(0, k, (N,), generator=g)


def make(X, Y, *, mode="flat", noise="banded", bands=2, sigma=0.7, loader_kw=None, engine_kw=None, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(X.shape[1], 8), nn.ReLU(), nn.Linear(8, 3)).to(X.dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    bounds = dict(max_grad_norm=1.0) if mode != "backprop" else dict(input_clip=1.0, grad_clip=1.0)
    engine = bpclip_fast.PrivacyEngine("rdp", **(engine_kw or {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureSeedWarning)
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(X, Y), batch_size=BATCH,
                                                                **(loader_kw or {})),
            noise_multiplier=sigma, clipping=mode, noise=noise, bands=bands, noise_seed=1234, **bounds, **kw)
    return engine, model, opt, loader


def step(model, opt, x, y):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward() if len(x) else model(x).sum().backward()
    opt.step()


# ----------------------------------------------------------------------------- budget
def test_max_epsilon_holds_after_skipped_batches():
    """Finding 1 (high: the budget is exceeded). Under banded noise a step's charge takes the
    accountant to length ``t + 1`` for its batch ``t`` (``budget.charge``: skipped batches are rows,
    charged), but the budget gate (``budget.need``) counted one step per batch drawn, as for plain
    Poisson sampling. A loop that breaks out of a loader with workers (their prefetched batches are
    skipped) was handed a batch whose step pushed ε past ``max_epsilon``.

    ``bands=2``, ``max_epsilon`` just above the ε of one event per group: after the first step one
    more step fits (the next is in the other group); two batches are skipped, so the next delivered
    batch ``t = 3`` would be charged three steps (two events in group 0). It must be refused,
    uncharged, and ε must never exceed the budget."""
    X, Y = data()
    probe = make(X, Y)[0]
    q = probe.accounting_sample_rate
    acc = bpclip_fast.accounting.make_accountant("rdp", bands=2)
    acc.step(noise_multiplier=probe.effective_noise_multiplier, sample_rate=q)
    acc.step(noise_multiplier=probe.effective_noise_multiplier, sample_rate=q)
    eps_one_each = acc.get_epsilon(1e-5)
    engine, model, opt, loader = make(
        X, Y, max_epsilon=eps_one_each * 1.001, delta=1e-5,
        loader_kw=dict(num_workers=1, prefetch_factor=2, multiprocessing_context="fork"))
    for x, y in loader:  # the workers claim batches 0, 1, 2 ahead; 1 and 2 are skipped
        step(model, opt, x, y)
        break
    assert engine._counter.claimed == 3 and len(engine.accountant) == 1
    try:
        for x, y in loader:  # batch 3 (group 1) would be charged with rows 1 and 2
            step(model, opt, x, y)
            break
    except bpclip_fast.accounting.PrivacyBudgetError:
        pass
    assert engine.get_epsilon(1e-5) <= eps_one_each * 1.001


# ----------------------------------------------------------------------------- checkpoints
def test_a_state_with_secrets_is_refused_under_banded_noise():
    """Finding 2 (medium: past noise released). ``state_dict(include_secrets=True)`` promises a
    bit-for-bit resume; under banded noise the resumed run restarts the band (the rows are never
    saved) with the same seed, so its first release at row ``t`` is ``g_t + σΔz_t/c_0`` where the run
    that went on from the checkpoint released ``g_t + (σΔz_t − Σ_j c_j w_{t−j})/c_0``: same batch, same
    draw, and the difference is the past rows' secret noise. Measured before the fix (lr 0, same
    model): the two continuations' releases differed by up to 0.33 (independent noise: equal bit for
    bit). Such a state cannot keep its promise without the rows, so it is refused, naming the
    argument."""
    X, Y = data()
    engine, model, opt, loader = make(X, Y, bands=3)
    it = iter(loader)
    for _ in range(3):
        step(model, opt, *next(it))
    with pytest.raises(ValueError, match="include_secrets"):
        engine.state_dict(include_secrets=True)
    assert "secrets" not in engine.state_dict()


# ----------------------------------------------------------------------------- charged refusals
def _group_counts(engine):
    from bpclip_fast.accounting.cyclic import position_counts
    history = engine.accountant.state_dict()["history"]
    return position_counts([tuple(h) for h in history], engine.bands).sum(axis=1)


def test_a_charged_refusal_with_no_batch_drawn_is_charged_to_every_group():
    """Finding 3 (medium: a data-dependent refusal released for free). Under banded noise a charge
    takes the accountant to ``t + 1`` for the last batch delivered; a refusal raised when no batch
    was drawn since the last step (a training forward on an input larger than ``max_input_shape``:
    whether it is depends on the data) found that batch already charged and added nothing, while
    ``StepRefused.charged`` said it was charged (measured: five such refusals, accountant length 1).
    It is not tied to any row or group, so it is charged as ``b`` skipped rows: one event for every
    group, and the rows stay the batches (the next batch's step is its row)."""
    X, Y = data()
    engine, model, opt, loader = make(X, Y, mode="backprop", bands=3, max_input_shape=(12,))
    it = iter(loader)
    step(model, opt, *next(it))
    before = _group_counts(engine)
    with pytest.raises(bpclip_fast.StepRefused) as info:
        model(torch.randn(4, 13, 12))  # per-example shape (13, 12): above the Δ fixed for (12,)
    assert info.value.rule == "max-shape" and info.value.charged
    after = _group_counts(engine)
    assert (after >= before + 1).all(), (before, after)
    x, y = next(it)
    t = engine._counter.last_t
    step(model, opt, x, y)
    assert len(engine.accountant) == t + 1
    assert all(st.band.next_row == t + 1 for st in engine._steps_of)


# ----------------------------------------------------------------------------- audits
def test_the_contribution_audit_does_not_vouch_for_banded_noise_it_did_not_draw():
    """Finding 4 (low: an audit that cannot fail). ``audit.contribution.sensitivity`` measures the
    noise "drawn by the training path" on a copy armed with :func:`bpclip_fast.nn.arm_noise`: the
    independent draw. Under ``noise="banded"`` training adds the correlated rows instead, so the
    audit reported every layer's noise "ok" for a mechanism training does not use. It must say the
    noise was not measured (and why), not "ok"."""
    from bpclip_fast.audit import contribution
    X, Y = data()
    engine, model, opt, loader = make(X, Y, mode="per_layer", bands=3)
    report = contribution.sensitivity(model, (X[:8], Y[:8]), nn.functional.cross_entropy, engine=engine,
                                      adversarial_steps=0)
    assert report.noise and all(r.status == "not measured" for r in report.noise)
    assert any("banded" in note for note in report.notes)


# ----------------------------------------------------------------------------- resume
@pytest.mark.parametrize("noise, bands", [("independent", 1), ("banded", 3)])
def test_a_checkpoint_is_not_loaded_into_an_engine_that_drew_a_batch(noise, bands):
    """Finding 5 (high: releases never charged). ``load_state_dict`` refused only an engine that had
    taken a step. A loop that ran a backward on a drawn batch (a warm-up, a sanity check) before
    loading had that batch's noised gradient in ``.grad``; the load replaced the accountant with the
    checkpoint's, so it was never charged (independent noise: accepted silently). Under banded noise
    the load raised only half-way, in the sampler's partition check, after the accountant and the
    noise seed were assigned: a loop that went on then had its next steps' batches already "charged"
    by the checkpoint's accountant (charge goes to length ``t + 1``). Now refused before anything is
    assigned."""
    X, Y = data()
    engine, model, opt, loader = make(X, Y, noise=noise, bands=bands)
    it = iter(loader)
    for _ in range(3):
        step(model, opt, *next(it))
    state = opt.state_dict()
    e2, m2, o2, l2 = make(X, Y, noise=noise, bands=bands)
    x, y = next(iter(l2))
    nn.functional.cross_entropy(m2(x), y).backward()
    seed = e2._stream.seed
    with pytest.raises((ValueError, RuntimeError), match="drawn"):
        o2.load_state_dict(state)
    assert len(e2.accountant) == 0 and e2._stream.seed == seed and e2.steps == 0


def test_a_banded_checkpoint_is_not_resumed_on_a_dataset_of_another_size():
    """Finding 6 (low: one more event per example and resume). The groups are a permutation of
    ``range(N)`` from ``partition_seed``: resumed on a data set of another size, the same seed cuts
    other groups, so an example moves group at the resume and can take part in the old group's
    rows before it and the new group's after it, one event more than the accountant's worst
    position. The checkpoint now carries ``N`` and a resume with another is refused."""
    X, Y = data()
    engine, model, opt, loader = make(X, Y, bands=2)
    it = iter(loader)
    for _ in range(3):
        step(model, opt, *next(it))
    state = opt.state_dict()
    e2, m2, o2, l2 = make(X[:60], Y[:60], bands=2)
    with pytest.raises(ValueError, match="a dataset of size 64"):
        o2.load_state_dict(state)
    assert len(e2.accountant) == 0
    e3, m3, o3, l3 = make(X, Y, bands=2)
    o3.load_state_dict(state)  # the same size: accepted
    assert len(e3.accountant) == 3


# ----------------------------------------------------------------------------- a fixed σΔ
def test_the_bound_of_a_banded_layer_cannot_be_changed_after_make_private():
    """Finding 7 (high: under-noised). The recursion needs one ``σΔ`` for every row: with ``Δ_t``
    varying, ``C·w = diag(σΔ_t)·z`` and the whitened column of a participation at row ``s`` has norm
    ``(Σ_j c_j² Δ_s²/Δ_{s+j}²)^½/σ``, above ``1/σ`` once ``Δ`` shrinks after ``s``. ``max_input_shape``
    fixes ``Δ`` of a shape-dependent layer (backprop clipping, biased Linear over ``[B, T, d]``), but
    ``layer.set_max_input_shape`` stayed callable after ``make_private`` (it is not one of the
    attributes the engine fixes): the rows' std then followed the new ``Δ`` (measured: 0.391 → 0.247
    for T from 4 to 1). Independent noise is sound with a changed ``Δ`` (each step its own
    Gaussian); banded noise is not, so the call is refused there."""
    from bpclip_fast.engine import correlated
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(N, 4, 12, generator=g), torch.randint(0, 3, (N,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3, bias=False))
    engine = bpclip_fast.PrivacyEngine("rdp")
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(X, Y), batch_size=BATCH), noise_multiplier=0.7, clipping="backprop",
        input_clip=1.0, grad_clip=1.0, max_input_shape=(4, 12), noise="banded", bands=2, noise_seed=1234)
    it = iter(loader)
    step(model, opt, *next(it))
    first = engine.clipped_layers[0][1]
    before = correlated.std(engine, first._bp_step)
    with pytest.raises((ValueError, AttributeError, RuntimeError), match="set_max_input_shape"):
        first.set_max_input_shape((1, 12))
    assert correlated.std(engine, first._bp_step) == before
