"""PrivacyEngine end to end (single process): usage, noise once per step, sampling, accounting, budget,
checkpoints, validation, loss reduction. Multi-process runs: tests/test_distributed.py."""

import contextlib
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast
from bpclip_fast import _ops, data, models
from bpclip_fast import nn as bnn
from bpclip_fast.accounting import (PrivacyBudgetError, effective_noise_multiplier, get_noise_multiplier,
                                    make_accountant)
from bpclip_fast.boundary import LayerStep, StepRefused, redraw_seed
from bpclip_fast.engine import InsecureSeedWarning, PrivacyEngine

DELTA = 1e-5


def quiet_make_private(engine, **kwargs):
    """make_private with an explicit seed, its (expected) insecurity warning silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureSeedWarning)
        return engine.make_private(**kwargs)


def small_net(bias=True):
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=bias), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 10, bias=bias))


def digits_like(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


def train_steps(model, opt, loader, steps, *, microbatches=1, loss_fn=nn.functional.cross_entropy, on_step=None):
    """``steps`` steps, each on one batch of ``loader`` split into ``microbatches`` backward passes
    (empty ones skipped); ``on_step()`` after each step."""
    it = iter(loader)
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        opt.zero_grad()
        with opt.accumulate() if hasattr(opt, "accumulate") else contextlib.nullcontext():
            for xm, ym in zip(x.tensor_split(microbatches), y.tensor_split(microbatches)):
                if len(xm):
                    loss_fn(model(xm), ym).backward()
        opt.step()
        if on_step is not None:
            on_step()


def expected_draw(like, seed, step, layer, std, bias=False):
    stream = bnn.NoiseStream(seed)
    stream.step = step
    return _ops.philox_noise_(torch.zeros_like(like), seed, stream.offset(layer) + int(bias), std)


# ---------------------------------------------------------------- the three-line use


def test_opacus_style_three_lines_on_mnist_net():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.rand(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g))
    model = models.mnist_net(act=bnn.TemperedSigmoid)
    params = [id(p) for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(ds, batch_size=16)

    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default (OS-entropy) seed does not warn
        model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                       noise_multiplier=1.1, input_clip=5.0, grad_clip=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps += 1
    eps = engine.get_epsilon(DELTA)

    assert steps == len(loader) == 4
    assert [id(p) for p in model.parameters()] == params  # weights kept, converted in place
    assert sum(isinstance(m, bnn._Clipped) for m in model.modules()) == 4
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    ref = make_accountant("rdp")
    for _ in range(steps):
        ref.step(noise_multiplier=1.1 / math.sqrt(4), sample_rate=16 / 64)
    assert eps == pytest.approx(ref.get_epsilon(DELTA), rel=1e-12)
    assert 0 < eps < math.inf
    assert engine._stream.secure


def test_readme_first_example_runs():
    """The README's first Python block, shortened to 2 epochs, trains and reports its ε."""
    pytest.importorskip("sklearn")
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert "engine = PrivacyEngine()" in code and "engine.make_private(" in code and "engine.get_epsilon(" in code
    assert "for epoch in range(20):" in code and 'clipping="flat"' in code
    namespace = {}
    exec(compile(code.replace("range(20)", "range(2)"), "README.md", "exec"), namespace)
    engine, loader = namespace["engine"], namespace["loader"]
    assert engine.steps == 2 * len(loader) and len(engine.accountant) == engine.steps
    ref = make_accountant("rdp")
    for _ in range(engine.steps):
        ref.step(noise_multiplier=2.0, sample_rate=128 / len(loader.dataset))  # flat: one mechanism, σ itself
    assert engine.get_epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)


def test_learning_rate_schedulers_see_the_wrapped_optimizer():
    engine, model, opt, loader = zero_data_setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    train_steps(model, opt, loader, 2)
    sched.step()
    assert opt.original_optimizer.param_groups[0]["lr"] == 0.5 and engine.steps == 2


# ---------------------------------------------------------------- noise exactly once per step


def zero_data_setup(seed=123, sigma=2.0, n=40, batch_size=8, loss_reduction="mean"):
    """Bias-free layers on all-zero inputs: the clipped gradient is exactly 0, so a step's update is its noise."""
    ds = TensorDataset(torch.zeros(n, 6), torch.zeros(n, dtype=torch.long))
    model = nn.Sequential(nn.Linear(6, 5, bias=False), nn.Tanh(), nn.Linear(5, 3, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = PrivacyEngine()
    model, opt, loader = quiet_make_private(
        engine, module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=batch_size), noise_multiplier=sigma,
        input_clip=1.0, grad_clip=0.5, loss_reduction=loss_reduction, noise_seed=seed)
    return engine, model, opt, loader


def one_draw_update(engine, step, layer_index, weight):
    layer = engine._layers[layer_index]
    std = engine.noise_multiplier * layer.sensitivity
    if engine.loss_reduction == "mean":
        std /= engine.expected_batch_size
    return expected_draw(weight, engine._seed, step, layer_index, std)


@pytest.mark.parametrize("microbatches", [1, 3])
def test_noise_once_per_step_under_gradient_accumulation(microbatches):
    engine, model, opt, loader = zero_data_setup()
    for step in range(3):
        before = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
        train_steps(model, opt, _single_batch_iter(loader), 1, microbatches=microbatches)
        for i, (w, b) in enumerate(zip((model[0].weight, model[2].weight), before)):
            update = (b - w).detach()  # SGD, lr 1: the update is the gradient, here pure noise
            torch.testing.assert_close(update, one_draw_update(engine, step, i, w), rtol=1e-5, atol=1e-7)
    assert len(engine.accountant) == 3
    assert engine.accountant.history == [(pytest.approx(2.0 / math.sqrt(2)), 8 / 40, 3)]


def _single_batch_iter(loader):
    class One:
        def __iter__(self):
            return iter([next(iter(loader))])
    return One()


CLEARS = ("model", "model_inplace", "tensor_inplace", "optimizer", "optimizer_inplace")


def _clear(clear, model, opt):
    if clear == "model":
        model.zero_grad()
    elif clear == "optimizer":
        opt.zero_grad()
    elif clear == "optimizer_inplace":
        opt.zero_grad(set_to_none=False)
    elif clear == "model_inplace":
        model.zero_grad(set_to_none=False)
    elif clear == "tensor_inplace":
        for p in model.parameters():
            p.grad.zero_()


def _backward_then_clear(clear):
    """A zero-data engine (seed 77) after one backward over its batch and ``clear``."""
    engine, model, opt, loader = zero_data_setup(seed=77)
    x, y = next(iter(loader))
    before = model[0].weight.detach().clone()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    _clear(clear, model, opt)
    return engine, model, opt, (x, y), before


@pytest.mark.parametrize("clear", ("none", *CLEARS))
def test_a_second_backward_in_a_step_is_refused_with_or_without_a_clear(clear):
    """Without a clear the second backward over the same rows counts each example twice (``rows``); with
    one, the cleared gradient was a readable release and a fresh draw would release the batch again
    (``redraw``, review 48 G1). Both are refused at that backward, before it computes, charged."""
    engine, model, opt, (x, y), before = _backward_then_clear(clear)
    with pytest.raises(StepRefused) as err:
        nn.functional.cross_entropy(model(x), y).backward()
    assert err.value.rule == ("rows" if clear == "none" else "redraw")
    assert err.value.charged and len(engine.accountant) == 1
    assert torch.equal(before, model[0].weight) and all(p.grad is None for p in model.parameters())


def test_a_clear_then_step_adds_a_fresh_draw_once():
    """model.zero_grad() / optimizer.zero_grad() after the backward drop that draw; ``step()`` adds a fresh
    one to the zeros (never the dropped one again), and every way of clearing gives the same update."""
    results = []
    for clear in CLEARS:
        engine, model, opt, _, before = _backward_then_clear(clear)
        opt.step()
        assert len(engine.accountant) == 1
        results.append((before - model[0].weight).detach())
        std = engine.noise_multiplier * engine._layers[0].sensitivity / engine.expected_batch_size
        fresh = expected_draw(before, redraw_seed(77, 0, 1), 0, 0, std)
        torch.testing.assert_close(results[-1], fresh, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(results[-1], one_draw_update(engine, 0, 0, before))
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], rtol=1e-5, atol=1e-7)


def test_noise_distribution_over_steps_matches_one_draw_per_step():
    """Variance of the updates over many zero-data steps is (σΔ/B̄)², not k times it, with accumulation."""
    engine, model, opt, loader = zero_data_setup(seed=5, n=16, batch_size=4)
    updates = []
    for _ in range(30):
        before = model[0].weight.detach().clone()
        train_steps(model, opt, _single_batch_iter(loader), 1, microbatches=2)
        updates.append((before - model[0].weight).detach().flatten())
    u = torch.cat(updates).double()
    std = engine.noise_multiplier * engine._layers[0].sensitivity / 4
    assert u.mean().abs() < 4 * std / math.sqrt(u.numel())
    assert u.std().item() == pytest.approx(std, rel=0.12)  # 900 draws: 4.5 standard errors of the std


def test_empty_poisson_batches_still_make_a_noisy_step():
    ds = TensorDataset(torch.zeros(20, 6), torch.zeros(20, dtype=torch.long))
    outcomes = {}
    for mode in ("forward_on_empty", "skip_empty"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        engine = PrivacyEngine()
        model, opt, loader = quiet_make_private(engine, module=model, optimizer=opt,
                                                data_loader=DataLoader(ds, batch_size=1), noise_multiplier=1.0,
                                                input_clip=1.0, grad_clip=1.0, noise_seed=2024)
        assert loader.sample_rate == pytest.approx(0.05)
        steps = 0
        for x, y in loader:
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            if len(x) or mode == "forward_on_empty":
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
            if len(x) == 0:
                update = [(b - p).detach() for b, p in zip(before, model.parameters())]
                assert x.shape == (0, 6) and y.shape == (0,)
                break
        assert len(x) == 0, "no empty batch within one epoch: pick another seed"
        assert len(engine.accountant) == steps
        std = 1.0 * engine._layers[1].sensitivity / 1  # mean loss, B̄ = 1
        torch.testing.assert_close(update[2], expected_draw(update[2], 2024, steps - 1, 1, std), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(update[3], expected_draw(update[3], 2024, steps - 1, 1, std, bias=True),
                                   rtol=1e-5, atol=1e-7)
        outcomes[mode] = update
    for a, b in zip(outcomes["forward_on_empty"], outcomes["skip_empty"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- loss reduction


def test_mean_reduction_is_the_sum_reduction_over_expected_batch_size():
    """Same seed, same batches: mean-loss gradients = sum-loss gradients / B̄, for every (random) batch size."""
    ds = digits_like(n=60)
    grads = {}
    for reduction in ("mean", "sum"):
        torch.manual_seed(3)
        model = small_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        engine = PrivacyEngine()
        model, opt, loader = quiet_make_private(engine, module=model, optimizer=opt,
                                                data_loader=DataLoader(ds, batch_size=12), noise_multiplier=0.7,
                                                input_clip=2.0, grad_clip=0.3, loss_reduction=reduction,
                                                noise_seed=9)
        grads[reduction], sizes = [], []
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y, reduction=reduction).backward()
            grads[reduction].append([p.grad.clone() for p in model.parameters()])
            sizes.append(len(x))
            opt.step()
    assert len(set(sizes)) > 1  # Poisson: the batch size varies
    for gm, gs in zip(grads["mean"], grads["sum"]):
        for a, b in zip(gm, gs):
            torch.testing.assert_close(a, b / 12, rtol=1e-5, atol=1e-7)


def _one_linear(grad_clip, mean_batch):
    torch.manual_seed(0)
    layer = bnn.Linear(3, 1, bias=False, input_clip=1.0, grad_clip=grad_clip)
    layer._bp_step = LayerStep(layer, "lin", enforce=False, mean_loss_batch=mean_batch)  # unarmed: scaling only
    return layer


def _grad(layer, x, a):
    layer.zero_grad()
    (layer(x).squeeze(1) * a).mean().backward()  # a mean loss: upstream gradient a_i / B
    return layer.weight.grad.clone()


def test_fixed_mean_scaling_would_move_other_examples():
    """Why the layers use the actual batch size: with a fixed bound C/B̄ one added example moves the others."""
    x = torch.tensor([[1.0, 0, 0]] * 4)
    a = torch.ones(4)
    x_new, a_new = torch.tensor([[1.0, 0, 0]]), torch.tensor([-100.0])
    xs, as_ = torch.cat([x, x_new]), torch.cat([a, a_new])
    c, b_bar = 1.0, 4.0
    # Fixed bound c/B̄ (Opacus' scaling applied to the upstream gradient): Δ = c/B̄ · C_x.
    naive = _one_linear(c / b_bar, None)
    diff = (_grad(naive, xs, as_) - _grad(naive, x, a)).norm().item()
    assert diff > 1.5 * naive.sensitivity  # the change exceeds the bound the noise would be scaled to
    # Ours: bound c/B, result ×B/B̄: the change is exactly the new example's own (bounded) contribution.
    ours = _one_linear(c, b_bar)
    change = _grad(ours, xs, as_) - _grad(ours, x, a)
    torch.testing.assert_close(change, _grad(ours, x_new, a_new), rtol=1e-6, atol=1e-7)
    assert change.norm().item() <= ours.sensitivity / b_bar * (1 + 1e-6)


# ---------------------------------------------------------------- sampling


def test_poisson_sampler_rate_and_independence():
    n, q, batches = 1000, 0.05, 400
    s = data.PoissonBatchSampler(n, q, batches, seed=11)
    counts = torch.zeros(n)
    sizes = []
    for idx in s:
        counts[idx] += 1
        sizes.append(len(idx))
    sizes = torch.tensor(sizes, dtype=torch.float64)
    # Batch sizes ~ Binomial(n, q): mean nq = 50, variance nq(1-q) = 47.5.
    assert abs(sizes.mean().item() - n * q) < 4 * math.sqrt(n * q * (1 - q) / batches)
    assert sizes.var().item() == pytest.approx(n * q * (1 - q), rel=0.25)
    # Per-example inclusion frequency ~ Binomial(batches, q)/batches.
    assert abs(counts.mean().item() / batches - q) < 1e-3
    assert counts.var().item() == pytest.approx(batches * q * (1 - q), rel=0.2)
    # Counter-based: batch t is the same whoever draws it; two ranks' shares partition it.
    ranks = [data.PoissonBatchSampler(n, q, 3, seed=11, rank=r, world_size=2) for r in (0, 1)]
    for t in range(3):
        union = sorted(ranks[0].indices(t) + ranks[1].indices(t))
        assert union == s.indices(t)
        assert all(i % 2 == 0 for i in ranks[0].indices(t)) and all(i % 2 == 1 for i in ranks[1].indices(t))
    assert data.PoissonBatchSampler(n, q, 3, seed=12).indices(0) != s.indices(0)


def test_shuffle_sampler_gives_disjoint_fixed_size_batches():
    s = data.ShuffleBatchSampler(50, 8, seed=3)
    assert len(s) == 6
    epochs = [list(s)]
    s.counter.delivered += 6
    epochs.append(list(s))
    for batches in epochs:
        flat = [i for b in batches for i in b]
        assert all(len(b) == 8 for b in batches) and len(set(flat)) == 48
    assert epochs[0] != epochs[1]  # a fresh permutation per epoch


def test_each_step_uses_exactly_one_batch():
    engine, model, opt, loader = zero_data_setup()
    it = iter(loader)
    x, y = next(it)
    next(it)
    # Two batches drawn: the backward is refused before it adds anything (a loop that never calls the
    # private step stops here), charged once per batch drawn (the loop may have used both).
    with pytest.raises(StepRefused, match="2 batches were drawn from the private loader") as err:
        nn.functional.cross_entropy(model(x), y).backward()
    assert err.value.rule == "batches" and len(engine.accountant) == 2
    with pytest.raises(RuntimeError, match="0 batches were drawn") as err:  # nothing drawn: not charged
        opt.step()
    assert not isinstance(err.value, StepRefused)
    assert len(engine.accountant) == 2 and all(p.grad is None for p in model.parameters())
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(StepRefused, match="2 batches were drawn") as err:  # the same at step() without backward
        opt.step()
    assert len(engine.accountant) == 4


# ---------------------------------------------------------------- pairing, validation, seeds


@pytest.mark.parametrize("accountant,poisson,match", [
    ("rdp", False, "cannot be accounted for by the 'rdp' accountant"),
    ("pld", False, "cannot be accounted for by the 'pld' accountant"),
    ("zcdp", True, "'zcdp' accountant analyses shuffled disjoint batches"),
])
def test_sampling_accountant_pairing_is_an_error(accountant, poisson, match):
    model = small_net()
    with pytest.raises(ValueError, match=match):
        PrivacyEngine(accountant).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(digits_like(), batch_size=8), noise_multiplier=1.0, input_clip=1.0,
            grad_clip=1.0, poisson_sampling=poisson)
    assert type(model[0]) is nn.Conv2d  # nothing changed


def test_validator_lists_every_problem():
    class WithParam(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x * self.scale

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect")
            self.bn = nn.BatchNorm2d(2)
            self.inorm = nn.InstanceNorm2d(2, track_running_stats=True)
            self.frozen_bn = nn.BatchNorm2d(2).eval().requires_grad_(False)  # model.train() would flip it
            self.gn = nn.GroupNorm(1, 2, affine=False)  # fine: per example, nothing trainable
            self.ln = nn.LayerNorm(8)
            self.shared = nn.Linear(8, 8)
            self.custom = WithParam()
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            x = self.gn(self.frozen_bn(self.inorm(self.bn(self.conv(x))))).mean(1).flatten(2).mean(2)
            x = self.shared(self.shared(self.ln(x)))
            return self.head(self.custom(x))

    model = Net()
    x = torch.randn(1, 1, 8, 8)
    problems = PrivacyEngine.validate(model, x)
    joined = "\n".join(problems)
    for expected in ["conv (Conv2d): padding_mode='reflect'", "bn (BatchNorm2d): BatchNorm in training mode",
                     "frozen_bn (BatchNorm2d): BatchNorm (in eval mode now, but model.train() switches it back)",
                     "inorm (InstanceNorm2d): InstanceNorm with track_running_stats=True in training mode",
                     "ln (LayerNorm): clipping='backprop' has no proved bound for its parameters; use clipping='flat'",
                     # no fused layer: the generic exact path trains it in flat/per_layer only
                     "custom (WithParam): clipping='backprop' has no proved bound",
                     "shared (Linear): reached 2 times in one forward pass"]:
        assert expected in joined, (expected, problems)
    assert "gn (" not in joined and "head" not in joined
    assert len(problems) == 7
    static = PrivacyEngine.validate(model)  # without an input: everything but the double use
    assert len(static) == 6
    # make_private raises listing all of them, and changes nothing.
    ds = TensorDataset(torch.randn(16, 1, 8, 8), torch.zeros(16, dtype=torch.long))
    with pytest.raises(ValueError) as err:
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(ds, batch_size=4), noise_multiplier=1.0,
                                     input_clip=1.0, grad_clip=1.0)
    assert all(p in str(err.value) for p in problems)
    assert type(model.head) is nn.Linear and model.bn.num_batches_tracked.item() == 0  # probe restored buffers
    assert PrivacyEngine.validate(small_net(), torch.randn(1, 1, 8, 8)) == []


def test_layer_reused_where_the_probe_cannot_see_it_is_refused_in_training():
    class SometimesShared(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            h = self.lin(x)
            if len(x) > 1:  # the probe forward has one example
                h = self.lin(torch.tanh(h))
            return self.head(h)

    ds = TensorDataset(torch.randn(32, 6), torch.zeros(32, dtype=torch.long))
    kw = dict(data_loader=DataLoader(ds, batch_size=16), noise_multiplier=1.0, input_clip=1.0, grad_clip=1.0,
              noise_seed=0)
    model = SometimesShared()
    with pytest.raises(ValueError, match=r"lin \(Linear\): reached 2 times"):  # the dynamic probe's batch has B > 1
        quiet_make_private(PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1), **kw)
    engine = PrivacyEngine()
    model, opt, loader = quiet_make_private(engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1),
                                            probe=False, **kw)
    x, y = next(x for x in loader if len(x[0]) > 1)
    with pytest.raises(StepRefused, match=r"lin: this backward pass would bring the layer's example rows") as err:
        nn.functional.cross_entropy(model(x), y).backward()  # refused at its second use, before it computes
    assert err.value.rule == "rows" and err.value.layers == ["lin"] and len(engine.accountant) == 1


def test_optimizer_parameters_outside_the_model_are_refused():
    model = small_net()
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"optimizer: a parameter of shape \(3,\) is not part of the module"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(list(model.parameters()) + [stray],
                                                                             lr=0.1),
                                     data_loader=DataLoader(digits_like(), batch_size=8), noise_multiplier=1.0,
                                     input_clip=1.0, grad_clip=1.0)


def test_explicit_seed_warns_and_default_seed_is_secret():
    def setup(seed):
        torch.manual_seed(0)
        model = small_net()
        engine = PrivacyEngine()
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=DataLoader(digits_like(), batch_size=8), noise_multiplier=1.0,
                            input_clip=1.0, grad_clip=1.0, noise_seed=seed)
        return engine

    with pytest.warns(InsecureSeedWarning, match="for that only: whoever knows the seed can subtract the noise"):
        e = setup(7)
    assert e._seed == 7 and not e._stream.secure and not e.state_dict()["secure"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, b = setup(None), setup(None)
    assert a._stream.secure and a._seed != b._seed
    assert a.data_loader.batch_sampler.indices(0) != b.data_loader.batch_sampler.indices(0) or \
        a.data_loader.batch_sampler.indices(1) != b.data_loader.batch_sampler.indices(1)


# ---------------------------------------------------------------- budget and checkpoints


def test_max_epsilon_stops_at_the_last_step_within_budget():
    torch.manual_seed(0)
    model = small_net()
    engine = PrivacyEngine()
    max_eps = 4.0
    model, opt, loader = quiet_make_private(
        engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(digits_like(n=64), batch_size=16), noise_multiplier=2.5, input_clip=1.0,
        grad_clip=1.0, noise_seed=1, max_epsilon=max_eps, delta=DELTA)
    taken = 0
    with pytest.raises(PrivacyBudgetError, match="would exceed max_epsilon=4"):
        for _ in range(200):
            train_steps(model, opt, _single_batch_iter(loader), 1)
            taken += 1
    assert engine.steps == taken == len(engine.accountant) > 3
    # Independent accounting: `taken` steps fit, one more would not.
    sigma_eff = 2.5 / math.sqrt(2)
    ref = make_accountant("rdp")
    for _ in range(taken):
        ref.step(noise_multiplier=sigma_eff, sample_rate=0.25)
    assert engine.get_epsilon(DELTA) == pytest.approx(ref.get_epsilon(DELTA), rel=1e-12)
    assert engine.get_epsilon(DELTA) <= max_eps
    ref.step(noise_multiplier=sigma_eff, sample_rate=0.25)
    assert ref.get_epsilon(DELTA) > max_eps
    # The refusal changed nothing and keeps refusing: the private loader refuses the next batch, so
    # nothing is computed (the gradients are still the last release).
    params = [p.detach().clone() for p in model.parameters()]
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    with pytest.raises(PrivacyBudgetError):
        train_steps(model, opt, _single_batch_iter(loader), 1)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters())) and engine.steps == taken
    assert all((g is None and p.grad is None) or torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def _resumable_run(steps, seed=31, state=None, stop_after=None, secrets=None):
    torch.manual_seed(4)
    model = small_net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = PrivacyEngine()
    model, opt, loader = quiet_make_private(engine, module=model, optimizer=opt,
                                            data_loader=DataLoader(digits_like(n=80), batch_size=16),
                                            noise_multiplier=1.0, input_clip=2.0, grad_clip=0.5,
                                            noise_seed=None if state else seed)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])  # also restores the engine's state (fresh noise seed)
    if secrets is not None:
        with pytest.warns(InsecureSeedWarning, match="reproducible and insecure"):
            engine.load_state_dict(secrets)  # the opt-in: the seeds too
    done = engine.steps
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            done += 1
            if done == steps or done == stop_after:
                break
        if done == stop_after:
            break
    return engine, model, opt


def test_checkpoint_kill_resume_continues_the_budget_with_fresh_noise(tmp_path):
    full_engine, full_model, _ = _resumable_run(12)
    # Interrupted after 7 steps (mid-epoch: 5 steps per epoch), checkpointed, resumed with new objects.
    engine, model, opt = _resumable_run(12, stop_after=7)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    eps_at_7 = engine.get_epsilon(DELTA)
    del engine, model, opt
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed = [_resumable_run(12, state=state) for _ in range(2)]
    for resumed_engine, resumed_model, _ in resumed:
        assert resumed_engine.steps == 12 and len(resumed_engine.accountant) == 12
        assert resumed_engine.get_epsilon(DELTA) == pytest.approx(full_engine.get_epsilon(DELTA), rel=1e-12)
        assert resumed_engine.get_epsilon(DELTA) > eps_at_7
        assert not resumed_engine.secure_noise_seed  # the first 7 steps used an explicit seed
    # A fresh noise seed each time: neither continuation repeats the other's (or the original's) noise.
    assert not torch.allclose(resumed[0][1][0].weight, resumed[1][1][0].weight)
    assert not torch.allclose(resumed[0][1][0].weight, full_model[0].weight)


def test_checkpoint_with_secrets_resumes_bit_for_bit(tmp_path):
    full_engine, full_model, _ = _resumable_run(12)
    engine, model, opt = _resumable_run(12, stop_after=7)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "secrets": engine.state_dict(include_secrets=True)}, tmp_path / "ckpt.pt")
    eps_at_7 = engine.get_epsilon(DELTA)
    del engine, model, opt
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed_engine, resumed_model, _ = _resumable_run(12, state=state, secrets=state["secrets"])
    assert resumed_engine.steps == 12 and len(resumed_engine.accountant) == 12
    assert resumed_engine.get_epsilon(DELTA) == pytest.approx(full_engine.get_epsilon(DELTA), rel=1e-12)
    assert resumed_engine.get_epsilon(DELTA) > eps_at_7
    for a, b in zip(full_model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # Without the checkpoint the run would not match (different noise): the test can fail.
    other_engine, other_model, _ = _resumable_run(12, seed=32)
    assert not torch.allclose(other_model[0].weight, full_model[0].weight)


def test_engine_state_dict_round_trip_and_refusals():
    engine, model, opt = _resumable_run(3)
    sd = engine.state_dict()
    assert {"accountant_state", "steps", "batches_delivered"} <= sd.keys()
    assert not any("seed" in k for k in sd) and "secrets" not in sd  # never the noise seed
    assert sd["steps"] == 3 == sd["batches_delivered"]
    assert engine.state_dict(include_secrets=True)["secrets"]["noise_seed"] == 31
    with pytest.raises(ValueError, match="has no privacy state"):
        opt.load_state_dict(opt.original_optimizer.state_dict())
    other = PrivacyEngine("pld")
    with pytest.raises(RuntimeError, match="call make_private first"):
        other.load_state_dict(sd)
    m = small_net()
    quiet_make_private(other, module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                       data_loader=DataLoader(digits_like(), batch_size=8), noise_multiplier=1.0, input_clip=1.0,
                       grad_clip=1.0, noise_seed=1)
    with pytest.raises(ValueError, match="accounted with 'rdp', this engine uses 'pld'"):
        other.load_state_dict(sd)


def test_make_private_with_epsilon_meets_the_target():
    torch.manual_seed(0)
    model = small_net()
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(digits_like(n=64), batch_size=16), target_epsilon=3.0, target_delta=DELTA, epochs=2,
        input_clip=1.0, grad_clip=1.0)
    sigma_eff = get_noise_multiplier(target_epsilon=3.0, target_delta=DELTA, sample_rate=0.25, steps=8,
                                     accountant="rdp")
    assert engine.noise_multiplier == pytest.approx(sigma_eff * math.sqrt(2), rel=1e-12)
    assert engine.effective_noise_multiplier == pytest.approx(effective_noise_multiplier([engine.noise_multiplier] * 2))
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert engine.steps == 8
    assert 3.0 - 0.05 < engine.get_epsilon(DELTA) <= 3.0


@pytest.mark.parametrize("accountant", ["rdp", "zcdp"])
def test_make_private_with_epsilon_counts_the_layers_the_engine_clips(accountant):
    """σ is split over the layers as make_private will clip them (registry.clipped_by_conversion): a
    frozen nn.Linear is not clipped, an already clipped layer is, frozen or not. A count that
    differed from the engine's would make the effective σ of a step smaller than calibrated."""
    torch.manual_seed(0)
    frozen_clipped = bnn.Linear(8, 8, bias=False, input_clip=1.0, grad_clip=1.0).requires_grad_(False)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Tanh(), frozen_clipped, nn.Tanh(),
                          nn.Linear(8, 8).requires_grad_(False), nn.Tanh(), nn.Linear(8, 10))
    engine = PrivacyEngine(accountant)
    poisson = accountant == "rdp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureSeedWarning)
        _, _, loader = engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
            data_loader=DataLoader(digits_like(n=50), batch_size=8), target_epsilon=3.0, target_delta=DELTA,
            epochs=2, input_clip=1.0, grad_clip=1.0, poisson_sampling=poisson, noise_seed=3)
    assert len(engine.clipped_layers) == 3
    steps_per_epoch = round(50 / 8) if poisson else 50 // 8
    assert len(loader) == engine.steps_per_epoch == steps_per_epoch
    rate = 8 / 50 if poisson else 1 / steps_per_epoch
    assert engine.accounting_sample_rate == pytest.approx(rate, rel=1e-15)
    sigma_eff = get_noise_multiplier(target_epsilon=3.0, target_delta=DELTA, sample_rate=rate,
                                     steps=2 * steps_per_epoch, accountant=accountant)
    assert engine.effective_noise_multiplier == pytest.approx(sigma_eff, rel=1e-12)


def test_sampling_plan_is_the_samplers():
    """The plan's steps per epoch and rates are those of the sampler it builds, for W processes."""
    for n, b, w in [(50, 8, 1), (50, 8, 2), (7, 7, 1), (100, 3, 4)]:
        for poisson in (True, False):
            plan = data.SamplingPlan(n, b, w, poisson)
            sampler = plan.sampler(seed=1, rank=0, counter=data.BatchCounter())
            assert len(sampler) == plan.steps_per_epoch >= 1
            if poisson:
                assert sampler.sample_rate == plan.sample_rate == plan.accounting_rate == b * w / n
            else:
                assert sampler.batch_size == b * w and plan.accounting_rate == 1 / (n // (b * w))
    with pytest.raises(ValueError, match=r"make_private: batch_size·world_size = 16 exceeds the dataset size 10"):
        data.SamplingPlan.of_loader(DataLoader(digits_like(n=10), batch_size=8), 2, True, "make_private")


def test_zcdp_with_shuffled_batches():
    torch.manual_seed(0)
    model = small_net()
    engine = PrivacyEngine("zcdp")
    model, opt, loader = quiet_make_private(
        engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(digits_like(n=50), batch_size=8), noise_multiplier=3.0, input_clip=1.0,
        grad_clip=1.0, poisson_sampling=False, noise_seed=2)
    assert len(loader) == 6
    seen = []
    while len(seen) < 8:  # one epoch and a third
        for x, y in loader:
            seen.append(len(x))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if len(seen) == 8:
                break
    assert seen == [8] * 8
    acc = make_accountant("zcdp")
    for _ in range(8):
        acc.step(noise_multiplier=3.0 / math.sqrt(2), sample_rate=1 / 6)
    assert engine.get_epsilon(DELTA) == pytest.approx(acc.get_epsilon(DELTA), rel=1e-12)
    assert acc.epochs == 2  # a partial epoch costs a full one


def test_nonfinite_example_is_dropped_and_the_step_goes_on():
    engine, model, opt, loader = zero_data_setup()
    x, y = next(iter(loader))
    x = x.clone()
    x[0, 0] = float("nan")
    before = model[0].weight.detach().clone()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert len(engine.accountant) == 1 and bool(torch.isfinite(model[0].weight).all())
    torch.testing.assert_close(before - model[0].weight, one_draw_update(engine, 0, 0, before), rtol=1e-5, atol=1e-7)
    assert engine.nonfinite_counts() == {"0": (1, 0), "2": (0, 0)}
    assert engine.nonfinite_counts() == {"0": (0, 0), "2": (0, 0)}  # read and reset


def test_nonfinite_strict_mode_refuses_and_charges_the_step():
    ds = TensorDataset(torch.zeros(8, 6), torch.zeros(8, dtype=torch.long))
    model = nn.Sequential(nn.Linear(6, 5, bias=False), nn.Tanh(), nn.Linear(5, 3, bias=False))
    engine = PrivacyEngine()
    model, opt, loader = quiet_make_private(
        engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(ds, batch_size=8), noise_multiplier=1.0, input_clip=1.0, grad_clip=1.0,
        noise_seed=3, nonfinite="raise")
    x, y = next(iter(loader))
    x = x.clone()
    x[0, 0] = float("nan")
    before = model[0].weight.detach().clone()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(StepRefused, match=r"nonfinite.*0 \(1, 0\)") as err:
        opt.step()
    assert err.value.rule == "nonfinite" and err.value.charged and len(engine.accountant) == 1
    assert torch.equal(before, model[0].weight) and all(p.grad is None for p in model.parameters())


def test_make_private_twice_is_refused():
    engine, model, opt, loader = zero_data_setup()
    with pytest.raises(RuntimeError, match="already called on this engine"):
        engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, input_clip=1.0,
                            grad_clip=1.0)
    with pytest.raises(RuntimeError, match="already private"):
        PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                                     input_clip=1.0, grad_clip=1.0)


def test_package_exports():
    assert bpclip_fast.PrivacyEngine is PrivacyEngine
    assert callable(bpclip_fast.build_info)


# ---------------------------------------------------------------- the registry at make_private


def _private(model, **kwargs):
    engine = PrivacyEngine()
    out = quiet_make_private(engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             data_loader=DataLoader(digits_like(n=32), batch_size=8), noise_multiplier=1.0,
                             input_clip=1.0, grad_clip=1.0, noise_seed=0, **kwargs)
    return engine, out


def test_a_subclass_of_a_clipped_layer_is_not_trained():
    """A subclass may override forward (mixing the batch here) or the sensitivity; only the exact
    clipped types are trusted, by validate, convert_model and make_private alike."""
    from bpclip_fast import validate

    class Centred(bnn.Linear):
        def forward(self, x):
            return super().forward(x - x.mean(0))

    def model(first):
        return nn.Sequential(nn.Flatten(), first, nn.Tanh(), nn.Linear(8, 10))

    bad = model(Centred(64, 8, input_clip=1.0, grad_clip=1.0))
    problems = validate.static_problems(bad)
    assert len(problems) == 1 and problems[0].startswith("1 (Centred): trainable parameters outside"), problems
    with pytest.raises(ValueError, match=r"1 \(Centred\): trainable parameters outside"):
        bnn.convert_model(model(Centred(64, 8, input_clip=1.0, grad_clip=1.0)), input_clip=1.0, grad_clip=1.0)
    with pytest.raises(ValueError, match=r"1 \(Centred\): trainable parameters outside"):
        _private(bad)
    engine, _ = _private(model(bnn.Linear(64, 8, input_clip=0.5, grad_clip=2.0)))  # the exact type: its own bounds
    assert [name for name, _ in engine.clipped_layers] == ["1", "3"]
    assert engine.clipped_layers[0][1].sensitivity == pytest.approx(2.0 * math.sqrt(0.5 ** 2 + 1))


def test_a_registered_layer_is_clipped_through_weight_and_bias_only():
    layer = nn.Linear(64, 10)
    layer.register_parameter("scale", nn.Parameter(torch.ones(10)))  # as weight_norm's weight_g would be
    model = nn.Sequential(nn.Flatten(), layer)
    with pytest.raises(ValueError, match=r"1 \(Linear\): trainable parameters outside .*\(1\.scale\)"):
        bnn.convert_model(model, input_clip=1.0, grad_clip=1.0)
    assert type(model[1]) is nn.Linear


def test_a_layer_under_two_parents_is_converted_once():
    shared = nn.Linear(4, 4)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    bnn.convert_model(model, input_clip=1.0, grad_clip=1.0)
    assert isinstance(model["a"][0], bnn.Linear) and model["a"][0] is model["b"][0]
    assert len(bnn.clipped_layers(model)) == 1


def test_make_private_checks_the_seed_before_changing_the_model():
    model = small_net()
    with pytest.raises(ValueError, match=r"noise_seed must be in \[0, 2\*\*63\)"):
        PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(digits_like(n=32), batch_size=8), noise_multiplier=1.0, input_clip=1.0,
            grad_clip=1.0, noise_seed=-1)
    assert type(model[0]) is nn.Conv2d and type(model[4]) is nn.Linear
    _private(model)  # a fresh engine can still make it private


def test_a_frozen_parameter_with_a_stale_gradient_is_reported_at_make_private():
    model = small_net()
    model[4].bias.requires_grad_(False)
    model[4].bias.grad = torch.ones_like(model[4].bias)
    with pytest.raises(ValueError, match=r"4\.bias: frozen, but holds a gradient"):
        _private(model)


def test_make_private_with_epsilon_splits_sigma_over_the_layers_it_clips():
    """σ_eff·√L with L counted after the conversion: here the model builds its head in its first
    forward (the probe forward of make_private), which a count taken before would miss."""
    class LazyHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Tanh())
            self.head = None

        def forward(self, x):
            h = self.body(x)
            if self.head is None:
                self.head = nn.Linear(8, 10, bias=False)  # shape-free Δ: no probe saw its input
            return self.head(h)

    model = LazyHead()
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(digits_like(n=64), batch_size=16), target_epsilon=1.0, target_delta=DELTA,
            epochs=1, input_clip=1.0, grad_clip=1.0, probe=False)
        sigma_eff = get_noise_multiplier(target_epsilon=1.0, target_delta=DELTA, sample_rate=0.25, steps=4,
                                         accountant="rdp")
    assert len(engine.clipped_layers) == 2
    assert engine.effective_noise_multiplier == pytest.approx(sigma_eff, rel=1e-12)


# ---------------------------------------------------------------- nn.DataParallel
def test_data_parallel_is_refused_at_make_private_and_in_a_replica():
    """nn.DataParallel runs shallow replicas of the model in threads, sharing each layer's step records:
    untested, so refused by name, before any work: around the model at make_private, and a replica
    of the private model (DataParallel wrapped after make_private) at its forward."""
    wrapped = nn.DataParallel(small_net())
    with pytest.raises(ValueError, match="nn.DataParallel.*DistributedDataParallel"):
        quiet_make_private(PrivacyEngine(), module=wrapped, optimizer=torch.optim.SGD(wrapped.parameters(), lr=0.1),
                           data_loader=DataLoader(digits_like(), batch_size=8), noise_multiplier=1.0,
                           max_grad_norm=1.0, clipping="flat", noise_seed=0)
    model = small_net()
    model, opt, loader = quiet_make_private(
        PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(digits_like(), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        clipping="flat", noise_seed=0)
    replica = model._replicate_for_data_parallel()  # what nn.parallel.replicate makes of the root
    x, y = next(iter(loader))
    with pytest.raises(RuntimeError, match="replica of nn.DataParallel"):
        replica(x)
    nn.functional.cross_entropy(model(x), y).backward()  # the model itself still trains
    opt.step()
