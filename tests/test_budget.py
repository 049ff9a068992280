"""The budget is never exceeded, charged refusals included (issue 24, finding 6).

``max_epsilon`` promises ε ≤ max_epsilon. A refused step is charged (``bpclip_fast.boundary``), so a
charged refusal is only allowed where the budget covers its charge: otherwise the refusal must come
earlier, as a ``PrivacyBudgetError`` that depends only on public counters (the accountant, the
number of batches drawn), and is not charged. Each test leaves the run exactly one step of budget
(``max_epsilon`` = ε after ``TOTAL`` steps from an independent accountant, ``TOTAL − 1`` taken), runs
a loop that would be charged more, and checks ε ≤ max_epsilon after every refusal.

The old code charged the 2-batch loop twice and the 5-batch loop five times (ε beyond the budget),
charged a forward refusal again on every retry on the same batch, and charged shuffled batches
skipped by prefetching workers beyond the budget.
"""

from __future__ import annotations

import math

import pytest
import torch.nn.functional as F

import bpclip_fast
from bpclip_fast import accounting
from test_guarantee import (DELTA, SIGMA, SHAPES, StepRefused, data, legit_step, mlp, private, shaped_data,
                            squares_loss)

PrivacyBudgetError = accounting.PrivacyBudgetError
TOTAL = 3  # steps the budget allows


def epsilon_after(steps, sigma_eff, rate, accountant="rdp"):
    """ε at DELTA of ``steps`` steps, from a fresh accountant (not the engine's)."""
    acc = accounting.make_accountant(accountant)
    for _ in range(steps):
        acc.step(noise_multiplier=sigma_eff, sample_rate=rate)
    return acc.get_epsilon(DELTA)


def one_step_left(model, X, Y, *, layers, loss_fn=None, **kw):
    """A Poisson run (rate 1) with budget for TOTAL steps and TOTAL − 1 taken; returns the run and max_epsilon.
    ``layers``: the number of clipped layers (backprop: σ_eff = σ/√L)."""
    sigma_eff = SIGMA / math.sqrt(layers)
    max_eps = epsilon_after(TOTAL, sigma_eff, 1.0)
    assert epsilon_after(TOTAL + 1, sigma_eff, 1.0) > max_eps
    engine, model, opt, loader = private(model, X, Y, max_epsilon=max_eps, delta=DELTA, **kw)
    for _ in range(TOTAL - 1):
        legit_step(model, opt, loader, loss_fn)
    return engine, model, opt, loader, max_eps


def attempt(engine, max_eps, fn, what):
    """Runs ``fn``; a refusal (StepRefused or PrivacyBudgetError) is returned, and ε must stay within the
    budget whatever happened."""
    exc = None
    try:
        fn()
    except (StepRefused, PrivacyBudgetError) as e:
        exc = e
    eps = engine.get_epsilon(DELTA)
    assert eps <= max_eps, (f"{what}: ε = {eps:.6g} exceeds max_epsilon = {max_eps:.6g} "
                            f"({type(exc).__name__ if exc else 'no refusal'}: {exc})")
    return exc


@pytest.mark.parametrize("adaptive", [None, True])
@pytest.mark.parametrize("where", ["backward", "step"])
@pytest.mark.parametrize("batches", [2, 5])
def test_drawing_more_batches_than_steps_left_never_exceeds_the_budget(batches, where, adaptive):
    """One step left; the loop draws ``batches`` batches before its backward (or its step). Charging each
    batch drawn would overrun the budget: the loader refuses the batch the budget cannot cover, uncharged,
    and the step left is still taken on the batch already drawn."""
    X, Y = data()
    engine, model, opt, loader, max_eps = one_step_left(mlp(), X, Y, layers=2, adaptive=adaptive)
    before = len(engine.accountant)
    drawn = []

    def loop():
        for _ in range(batches):  # one batch per pass of this loader (rate 1): a new pass for each
            drawn.append(next(iter(loader)))
        x, y = drawn[-1]
        if where == "backward":
            F.cross_entropy(model(x), y).backward()
        opt.step()
    exc = attempt(engine, max_eps, loop, f"{batches} batches drawn before {where}")
    assert isinstance(exc, PrivacyBudgetError), f"expected the loader to refuse the batch, got {exc!r}"
    assert len(engine.accountant) == before, "the loader's refusal depends on public counters: not charged"
    assert len(drawn) == 1
    x, y = drawn[0]  # the last step the budget allows is not lost
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert engine.steps == TOTAL and engine.get_epsilon(DELTA) <= max_eps
    attempt(engine, max_eps, lambda: next(iter(loader)), "a draw after the budget is spent")


def _unfrozen_after_make_private():
    X, Y = data()
    model = mlp()
    model.fc1.requires_grad_(False)
    engine, model, opt, loader, max_eps = one_step_left(model, X, Y, layers=1)
    model.fc1.requires_grad_(True)
    return engine, model, opt, loader, max_eps


def _max_shape():
    factory, short, long, norm, _ = SHAPES["linear_tokens"]
    X, Y = shaped_data(long)
    engine, model, opt, loader, max_eps = one_step_left(factory(), X, Y, layers=1, loss_fn=squares_loss,
                                                        conv_norm=norm, max_input_shape=long)
    return engine, model, opt, loader, max_eps


def _retry_forward(setup, pad, call, rule):
    engine, model, opt, loader, max_eps = setup()
    x, y = next(iter(loader))
    x = pad(x)
    first = attempt(engine, max_eps, lambda: call(model, x, y), "the first refusal")
    assert isinstance(first, StepRefused) and first.rule == rule and first.charged, repr(first)
    for k in range(3):  # the loop retries on the same batch
        exc = attempt(engine, max_eps, lambda: call(model, x, y), f"retry {k + 1} on the refused batch")
        assert isinstance(exc, PrivacyBudgetError), f"retry {k + 1}: expected PrivacyBudgetError, got {exc!r}"


def test_forward_refusals_repeated_on_one_batch_never_exceed_the_budget_max_shape():
    """``max-shape`` is charged at the forward; with one step left the first refusal takes it, and every
    retry on that batch is refused uncharged before the shape is looked at."""
    _retry_forward(_max_shape, lambda x: F.pad(x, (0, 0, 0, 1)), lambda m, x, y: m(x), "max-shape")


@pytest.mark.parametrize("call", ["model", "layers"])
def test_forward_refusals_repeated_on_one_batch_never_exceed_the_budget_unclipped_param(call):
    """``unclipped-param``: refused at the model's forward (or, when the loop calls the layers directly, at
    the backward)."""
    def through_model(m, x, y):
        F.cross_entropy(m(x), y).backward()

    def through_layers(m, x, y):
        F.cross_entropy(m.fc2(m.act(m.fc1(x))), y).backward()
    _retry_forward(_unfrozen_after_make_private, lambda x: x,
                   through_model if call == "model" else through_layers, "unclipped-param")


def test_a_backward_after_the_last_step_with_a_stale_forward_is_not_charged():
    """Adaptive thresholds: a forward run before the last step, backpropagated after it, is refused
    (``bounds``, charged). After the last step the budget is spent: refused uncharged instead."""
    X, Y = data()
    engine, model, opt, loader, max_eps = one_step_left(mlp(), X, Y, layers=2, adaptive=True)
    x, y = next(iter(loader))
    stale = F.cross_entropy(model(x), y)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert engine.steps == TOTAL
    exc = attempt(engine, max_eps, stale.backward, "the stale forward's backward")
    assert isinstance(exc, PrivacyBudgetError), repr(exc)


def test_shuffled_batches_skipped_by_prefetching_are_charged_within_the_budget():
    """zCDP, shuffled batches: the accountant is kept at length t + 1 for batch t, so a batch delivered after
    claimed-but-undelivered ones (prefetched by workers of a loop that stopped) charges them too. With one
    step left and batch t two epochs' worth ahead, that charge would overrun the budget: the loader refuses
    it, uncharged."""
    X, Y = data(n=8)
    sigma_eff = SIGMA / math.sqrt(2)
    rate = 1 / 4  # 4 disjoint batches of 2 per epoch
    max_eps = epsilon_after(4, sigma_eff, rate, "zcdp")  # one epoch
    assert epsilon_after(5, sigma_eff, rate, "zcdp") > max_eps
    engine, model, opt, loader = private(mlp(), X, Y, engine=bpclip_fast.PrivacyEngine("zcdp"), batch_size=2,
                                         poisson_sampling=False, max_epsilon=max_eps, delta=DELTA)
    for _ in range(3):
        legit_step(model, opt, loader)
    for _ in range(2):  # claimed, never delivered: what prefetching workers leave when a loop stops
        next(iter(loader.batch_sampler))

    def loop():
        x, y = next(iter(loader))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    exc = attempt(engine, max_eps, loop, "a step on batch 5 with one step of budget left")
    assert isinstance(exc, PrivacyBudgetError), repr(exc)
    assert len(engine.accountant) == 3


def test_budget_and_delta_cannot_be_reassigned():
    """Lowering ``max_epsilon`` (or moving ``delta``) after batches were drawn would leave batches the
    budget no longer covers: both are fixed at make_private, as σ is."""
    X, Y = data()
    engine, model, opt, loader, max_eps = one_step_left(mlp(), X, Y, layers=2)
    with pytest.raises(AttributeError, match="max_epsilon is fixed"):
        engine.max_epsilon = max_eps / 2
    with pytest.raises(AttributeError, match="delta is fixed"):
        engine.delta = DELTA / 10
    assert (engine.max_epsilon, engine.delta) == (max_eps, DELTA)


def test_a_checkpoint_beyond_the_budget_is_refused_on_load():
    """A checkpoint that has spent more than the engine's max_epsilon cannot be continued within it: the
    load is refused before anything is assigned (ε would exceed the budget at once)."""
    X, Y = data()
    engine, model, opt, loader, max_eps = one_step_left(mlp(), X, Y, layers=2)
    legit_step(model, opt, loader, None)  # the last step the budget allows
    state = opt.state_dict()
    spent = engine.get_epsilon(DELTA)
    assert spent <= max_eps
    fresh, model2, opt2, loader2 = private(mlp(), X, Y, max_epsilon=spent / 2, delta=DELTA)[0:4]
    with pytest.raises(ValueError, match="already spent"):
        opt2.load_state_dict(state)
    assert fresh.get_epsilon(DELTA) == 0.0 and fresh.steps == 0
    same, model3, opt3, loader3 = private(mlp(), X, Y, max_epsilon=max_eps, delta=DELTA)[0:4]
    opt3.load_state_dict(state)  # within the budget: accepted
    assert same.get_epsilon(DELTA) == pytest.approx(spent, rel=0, abs=0)
