"""The sensitivity audit (bpclip_fast.audit.sensitivity) and its ``bpclip-audit sensitivity`` CLI.

* Its contributions, measured by removal through the real layers, equal independent oracles:
  exact modes, per-example gradients from ``torch.func`` on a plain-torch float64 copy, clipped by
  the mode's rule (tests/exact_oracle.py); backprop, the paper's plain hooks
  (``bpclip_fast.reference.attach``) run on each example alone.
* Mean and sum loss give the same contributions in bound units.
* Tightness: inputs ×100 saturate the bound; the adversarial search reaches it from small inputs.
* Planted bugs (a bound declared too small, a clip skipped) are caught, by the API and the CLI.
* The noise the layers draw (the training path, on a copy) has std σ·Δ_l in every mode and
  reduction; noise scaled to Δ/3, a sequence Linear's Δ without its T, a layer drawing none: caught.
* Each example alone in the model's dtype: a 10% over-clip of the float32 kernels only, which the
  float64 removal cannot see, is caught.
* Training mode: mixing that happens only when ``self.training`` is caught; dropout is turned off,
  other randomness or a drifting release falls back to eval mode with a note; the caller's
  generator state is restored.
* The private model and its engine are left exactly as they were.
"""

import copy
import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import exact_oracle as eo
from bpclip_fast import PrivacyEngine, autograd, exact, reference
from bpclip_fast import nn as bnn
from bpclip_fast.audit import cli
from bpclip_fast.audit import sensitivity

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

B = 8          # audited batch
BBAR = 4       # the loader's batch size: B̄ under mean loss
SIGMA = 1.3
BACKPROP = dict(input_clip=1.0, grad_clip=0.1)


def mlp(act=nn.Tanh, depth=1):
    torch.manual_seed(0)
    hidden = [m for _ in range(depth - 1) for m in (nn.Linear(8, 8), act())]
    return nn.Sequential(nn.Linear(6, 8), act(), *hidden, nn.Linear(8, 3)), (6,), 3


def conv_net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, stride=2, bias=False),
                         nn.Tanh(), nn.Flatten(), nn.Linear(16, 3)), (2, 6, 6), 3


def token_net():
    """Embedding + LayerNorm + Linear on token ids [B, 5] (exact modes only)."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 3), eo.MeanOverTime()), None, 3


MODELS = {"mlp": mlp, "conv": conv_net}


def batch_for(shape, classes, n=B, seed=3, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    if shape is None:
        x = torch.randint(0, 11, (n, 5), generator=g)
    else:
        x = torch.randn((n, *shape), generator=g) * scale
    return x, torch.randint(0, classes, (n,), generator=g)


def private(factory, mode, reduction="sum", **bounds):
    """(private model, engine, optimizer, loader, plain float64 copy of the initial model, shape, classes)."""
    model, shape, classes = factory()
    plain = copy.deepcopy(model).double()
    x, y = batch_for(shape, classes, n=32, seed=9)
    engine = PrivacyEngine()
    bounds = bounds or (BACKPROP if mode == "backprop" else dict(max_grad_norm=1.0))
    out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              data_loader=DataLoader(TensorDataset(x, y), batch_size=BBAR), noise_multiplier=SIGMA,
                              clipping=mode, loss_reduction=reduction, **bounds)
    return (*out[:1], engine, *out[1:], plain, shape, classes)


# --------------------------------------------------------------------------- oracles

def exact_oracle(plain, x, y, mode, thresholds):
    """{layer name: [B, P] contributions} and, for flat, "flat": c_i G_i with the mode's factors."""
    per_ex = eo.per_example_grads(plain, x, y, eo.sum_cross_entropy)
    groups = eo.layer_groups(plain)
    flat = {name: torch.cat([per_ex[p].flatten(1) for p in ps], 1) for name, ps in groups}
    if mode == "flat":
        total = torch.cat(list(flat.values()), 1)
        c = eo.clip_factor(total.norm(dim=1), thresholds)
        out = {name: c[:, None] * g for name, g in flat.items()}
        out["flat"] = c[:, None] * total
        return out
    out = {name: eo.clip_factor(g.norm(dim=1), thresholds[name])[:, None] * g for name, g in flat.items()}
    out["total"] = torch.cat(list(out.values()), 1)
    return out


def backprop_oracle(plain, x, y, norm="l15"):
    """{layer name: [B, P]}: the paper's hooks on each example alone (sum loss)."""
    handles = reference.attach(plain, norm=norm, **BACKPROP)
    rows = {name: [] for name, _ in reference.clipped_modules(plain)}
    try:
        for i in range(len(x)):
            plain.zero_grad(set_to_none=True)
            eo.sum_cross_entropy(plain(x[i:i + 1].double()), y[i:i + 1]).backward()
            for name, m in reference.clipped_modules(plain):
                rows[name].append(torch.cat([p.grad.reshape(-1) for p in (m.weight, m.bias) if p is not None]))
    finally:
        for h in handles:
            h.remove()
    return {name: torch.stack(r) for name, r in rows.items()}


def assert_matches(report, oracle):
    for name, want in oracle.items():
        row = next(r for r in report.rows if r.name == name)
        got = report.contributions[name]
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-9 * row.bound), \
            (name, float((got - want).abs().max()))
        assert row.largest == pytest.approx(float(want.norm(dim=1).max()), rel=1e-9)


# --------------------------------------------------------------------------- contributions = oracle

@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("kind", ["mlp", "conv"])
@pytest.mark.parametrize("mode", ["backprop", "flat", "per_layer"])
def test_contributions_equal_the_oracle(mode, kind, reduction):
    model, engine, _, _, plain, shape, classes = private(MODELS[kind], mode, reduction)
    x, y = batch_for(shape, classes)
    report = sensitivity(model, (x, y), engine=engine, keep_contributions=True)
    assert report.ok and report.examples == B and report.loss_reduction == reduction
    assert report.mean_batch_size == (BBAR if reduction == "mean" else None)
    assert report.tol <= 1e-8 and report.rounding < report.tol
    layers = dict(bnn.clipped_layers(model))
    for row in report.rows:
        assert row.ratio <= 1 + report.tol
        assert row.ratio == pytest.approx(row.largest / row.bound)
    if mode == "backprop":
        for row in report.rows:
            assert row.checked and row.bound == layers[row.name].sensitivity and row.symbol == "Δ"
        oracle = backprop_oracle(plain, x, y)
    else:
        c = next(iter(layers.values())).noise_bound
        thresholds = 1.0 if mode == "flat" else {n: layer._bp_max_grad_norm for n, layer in layers.items()}
        assert c == pytest.approx(1.0)  # flat: C; per_layer: (Σ C_l²)^½ of the split C/√L
        checked = {r.name for r in report.rows if r.checked}
        assert checked == ({"flat"} if mode == "flat" else set(layers) | {"total"})
        oracle = exact_oracle(plain, x, y, mode, thresholds)
    assert_matches(report, oracle)


def test_layernorm_and_embedding_under_flat_equal_the_oracle():
    model, engine, _, _, plain, shape, classes = private(token_net, "flat", "mean")
    x, y = batch_for(shape, classes)
    report = sensitivity(model, (x, y), engine=engine, keep_contributions=True, adversarial_steps=3)
    assert report.ok
    assert [r.name for r in report.rows] == ["flat", "0", "1", "2"]
    assert "skipped" in report.adversarial and "integer" in report.adversarial["skipped"]
    assert "adversarial skipped" in report.line()
    assert_matches(report, exact_oracle(plain, x, y, "flat", 1.0))


@pytest.mark.parametrize("mode", ["backprop", "flat", "per_layer"])
def test_mean_and_sum_loss_give_the_same_contributions_in_bound_units(mode):
    x, y = batch_for((6,), 3)
    reports = []
    for reduction in ("sum", "mean"):
        model, engine, *_ = private(mlp, mode, reduction)
        reports.append(sensitivity(model, (x, y), engine=engine, keep_contributions=True))
    for name, got in reports[1].contributions.items():
        assert torch.allclose(got, reports[0].contributions[name], rtol=1e-9, atol=1e-12), name
    # Without the engine's B̄ scaling the mean-loss contributions would be 1/B̄ of these.
    assert max(r.ratio for r in reports[1].rows) > 0.5


# --------------------------------------------------------------------------- tightness

@pytest.mark.parametrize("mode", ["backprop", "flat", "per_layer"])
def test_inputs_far_outside_the_data_saturate_the_bound(mode):
    model, engine, *_, shape, classes = private(mlp, mode)
    report = sensitivity(model, batch_for(shape, classes, scale=100.0), engine=engine)
    assert report.ok
    top = max((r for r in report.rows if r.checked), key=lambda r: r.ratio)
    assert abs(top.ratio - 1) <= report.tol and top.saturated >= 1
    assert f"{top.ratio:.5f}" in report.line() and report.line().endswith("; OK")


@pytest.mark.parametrize("mode,bounds", [("backprop", BACKPROP), ("flat", dict(max_grad_norm=3.0))])
def test_adversarial_search_from_small_inputs_reaches_the_bound(mode, bounds):
    model, engine, *_, shape, classes = private(mlp, mode, **bounds)
    small = batch_for(shape, classes, scale=0.01)
    report = sensitivity(model, small, engine=engine, adversarial_steps=25, scales=())
    assert report.ok
    assert max(r.ratio for r in report.rows if r.checked) < 0.9  # the batch itself is far from the bound
    assert 0.99 <= report.adversarial["best"] <= 1 + report.tol
    assert report.adversarial["evaluations"] > 2
    assert "adversarial 0.99" in report.line() or "adversarial 1.0000" in report.line()


# --------------------------------------------------------------------------- planted bugs

def test_backprop_delta_without_the_bias_term_is_caught(monkeypatch):
    model, engine, *_, shape, classes = private(mlp, "backprop")
    monkeypatch.setattr(bnn.Linear, "sensitivity_for",
                        lambda self, input_shape=None: self.grad_clip * self.input_clip)
    report = sensitivity(model, batch_for(shape, classes, scale=100.0), engine=engine)
    assert not report.ok and "EXCEEDED" in report.line()
    assert max(r.ratio for r in report.rows) == pytest.approx(2 ** 0.5, rel=1e-6)  # √(C_x² + 1)/C_x


def test_backprop_input_clip_skipped_for_one_example_is_caught(monkeypatch):
    model, engine, *_, shape, classes = private(mlp, "backprop")
    real = autograd._backward

    def skip_example_0(ctx, grad_out, op, *geometry):
        def patched(g, x, factor, *rest):
            factor = factor.clone()
            factor[0] = 1.0
            return op(g, x, factor, *rest)
        return real(ctx, grad_out, patched, *geometry)

    monkeypatch.setattr(autograd, "_backward", skip_example_0)
    report = sensitivity(model, batch_for(shape, classes, scale=100.0), engine=engine)
    assert not report.ok
    bad = [r for r in report.rows if "removal" in r.failed]
    assert bad and all(r.examples == [0] for r in bad)
    # Alone, every example is row 0 of its backward: the alone check sees the skip for all of them.
    assert all("alone" in r.failed for r in report.rows)


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_clip_skipped_for_one_example_is_caught(monkeypatch, mode):
    model, engine, *_, shape, classes = private(mlp, mode)
    real = exact.factors

    def skip_example_0(*args, **kw):
        f = real(*args, **kw).clone()
        f[0] = 1.0
        return f

    monkeypatch.setattr(exact, "factors", skip_example_0)
    report = sensitivity(model, batch_for(shape, classes, scale=100.0), engine=engine)
    assert not report.ok
    assert all(r.examples == [0] and r.ratio > 2 for r in report.rows if "removal" in r.failed)


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_clipping_at_twice_the_declared_c_is_caught(monkeypatch, mode):
    model, engine, *_, shape, classes = private(mlp, mode)
    real = exact.factors
    monkeypatch.setattr(exact, "factors", lambda bound, max_norm, *a, **kw: real(bound, 2 * max_norm, *a, **kw))
    report = sensitivity(model, batch_for(shape, classes, scale=100.0), engine=engine)
    assert not report.ok
    assert max(r.ratio for r in report.rows if r.checked) == pytest.approx(2.0, rel=1e-6)


@pytest.mark.parametrize("bug", ["skip_example_0", "twice_c"])
def test_planted_factor_bugs_reach_per_layer_instantiated_layers(monkeypatch, bug):
    """Under per_layer a LayerNorm's (and any instantiated layer's) bound and factors are one kernel
    (examples_factors), still made through exact.factors: a bug planted there shows on that layer."""
    model, engine, *_, shape, classes = private(token_net, "per_layer")
    real, fused = exact.factors, []

    def planted(bound, max_norm, *a, **kw):
        fused.append(isinstance(bound, exact.PendingBound))
        if bug == "twice_c":
            return real(bound, 2 * max_norm, *a, **kw)
        f = real(bound, max_norm, *a, **kw).clone()
        f[0] = 1.0
        return f

    monkeypatch.setattr(exact, "factors", planted)
    report = sensitivity(model, batch_for(shape, classes, scale=100.0), engine=engine)
    assert not report.ok
    assert any(fused)  # the fused kernel's factors went through the planted bug
    assert "1" in {r.name for r in report.rows if r.failed}  # the LayerNorm


def test_per_layer_noise_bound_halved_is_caught(monkeypatch):
    """Four layers (C_l = C/2 each): halving the C the noise is scaled to still passes the layers'
    own C_l ≤ C check, and only the total row sees it."""
    model, engine, *_, shape, classes = private(lambda: mlp(depth=3), "per_layer", max_grad_norm=1.0)
    monkeypatch.setattr(bnn.Linear, "_bp_noise_bound", property(lambda self: self.__dict__["_bp_noise_bound"] / 2),
                        raising=False)
    report = sensitivity(model, batch_for(shape, classes, scale=100.0), engine=engine)
    assert not report.ok
    total = next(r for r in report.rows if r.name == "total")
    assert total.status == "exceeded" and total.bound == pytest.approx(0.5) and total.ratio > 1.5
    assert all(r.status == "ok" for r in report.rows if r.name != "total")


# --------------------------------------------------------------------------- nothing disturbed

def _state(model, engine):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            engine.steps, copy.deepcopy(engine.accountant.state_dict()),
            [(layer._bp_step, layer._bp_step.key, layer._bp_step.rows, layer._bp_step.noised, layer._bp_step._draws,
              layer._bp_noise_multiplier) for _, layer in engine.clipped_layers],
            [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()])


def _same(a, b):
    params_a, grads_a, *rest_a = a
    params_b, grads_b, *rest_b = b
    assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)
    assert all((grads_a[n] is None and grads_b[n] is None) or torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert rest_a == rest_b


@pytest.mark.parametrize("mode", ["backprop", "flat", "per_layer"])
def test_the_private_model_and_engine_are_untouched(mode):
    model, engine, optimizer, loader, _, shape, classes = private(mlp, mode, "mean")
    before = _state(model, engine)
    assert all(v is None for v in before[1].values())
    sensitivity(model, batch_for(shape, classes), engine=engine, adversarial_steps=2)
    _same(before, _state(model, engine))
    # mid-step (gradients held, the draw taken): still untouched, and the step goes through
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    mid = _state(model, engine)
    sensitivity(model, batch_for(shape, classes), engine=engine, adversarial_steps=2)
    _same(mid, _state(model, engine))
    optimizer.step()
    assert engine.steps == 1 and len(engine.accountant) == 1
    optimizer.zero_grad()
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    assert engine.steps == 2


# --------------------------------------------------------------------------- errors and frozen layers

def test_errors_name_the_argument():
    model, engine, _, _, _, shape, classes = private(mlp, "flat")
    x, y = batch_for(shape, classes)
    with pytest.raises(ValueError, match="model has no bpclip_fast clipped layer"):
        sensitivity(nn.Sequential(nn.Linear(6, 3)), (x, y))
    with pytest.raises(TypeError, match="batch must be a pair"):
        sensitivity(model, x, engine=engine)
    with pytest.raises(TypeError, match="batch must be a pair"):
        sensitivity(model, (x, y, y), engine=engine)
    with pytest.raises(ValueError, match="batch's inputs"):
        sensitivity(model, (x, y[:3]), engine=engine)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        sensitivity(model, (x, y), lambda out, t: out.sum(1), engine=engine)
    with pytest.raises(ValueError, match="loss_reduction='mean' without engine needs mean_batch_size"):
        sensitivity(model, (x, y), loss_reduction="mean")
    with pytest.raises(ValueError, match="engine was made private with loss_reduction='sum'"):
        sensitivity(model, (x, y), engine=engine, loss_reduction="mean")
    other, other_engine, *_ = private(mlp, "flat")
    with pytest.raises(ValueError, match="engine is not the PrivacyEngine of model"):
        sensitivity(model, (x, y), engine=other_engine)
    model.held = model(x)  # a graph tensor kept on the module: the model cannot be copied
    with pytest.raises(RuntimeError, match="model cannot be copied"):
        sensitivity(model, (x, y), engine=engine)


def test_frozen_clipped_layer_is_reported_as_frozen():
    model = bnn.convert_model(mlp()[0], clipping="per_layer", max_grad_norm=1.0)
    model[2].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    report = sensitivity(model, batch_for((6,), 3, scale=100.0), adversarial_steps=2)  # sum, no engine
    rows = {r.name: r for r in report.rows}
    assert rows["2"].status == "frozen" and not rows["2"].checked and rows["2"].adversarial is None
    assert rows["0"].status == "ok" and abs(rows["0"].ratio - 1) <= report.tol
    assert report.ok and report.loss_reduction == "sum"


# --------------------------------------------------------------------------- CLI

def test_cli_prints_one_line_writes_json_and_exits_0(tmp_path, capsys):
    path = tmp_path / "sens.json"
    rc = cli.main(["sensitivity", "--mode", "flat", "--batch-size", "8", "--adversarial-steps", "1",
                   "--json", str(path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(out) == 1 and out[0].startswith("sensitivity: flat, 8 examples") and out[0].endswith("OK")
    data = json.loads(path.read_text())
    assert data["ok"] is True and data["line"] == out[0] and data["config"]["mode"] == "flat"
    assert data["rows"][0]["name"] == "flat" and data["rows"][0]["ratio"] <= 1 + data["tol"]


def test_cli_exits_1_when_a_bound_is_exceeded(monkeypatch, capsys):
    monkeypatch.setattr(bnn.Linear, "sensitivity_for",
                        lambda self, input_shape=None: self.grad_clip * self.input_clip)
    rc = cli.main(["sensitivity", "--mode", "backprop", "--batch-size", "8", "--adversarial-steps", "0",
                   "--input-clip", "0.1", "--grad-clip", "0.01"])
    line = capsys.readouterr().out.strip()
    assert rc == 1 and "EXCEEDED" in line


def test_cli_exits_1_when_a_layer_is_under_noised(monkeypatch, capsys):
    real = bnn._Clipped._bp_noise_sensitivity
    monkeypatch.setattr(bnn._Clipped, "_bp_noise_sensitivity", lambda self, x: real(self, x) / 3)
    rc = cli.main(["sensitivity", "--mode", "flat", "--batch-size", "8", "--adversarial-steps", "0"])
    line = capsys.readouterr().out.strip()
    assert rc == 1 and "UNDER-NOISED" in line and "EXCEEDED" not in line


def test_part_of_a_flat_model_is_refused():
    """Flat clipping's factor needs every layer's norm: a slice of the model has the book-keeping of
    the whole, which the audit must not run half of."""
    model, engine, _, _, _, shape, classes = private(mlp, "flat")
    with pytest.raises(RuntimeError, match="flat clipping's book-keeping did not survive the copy"):
        sensitivity(model[0:2], batch_for(shape, classes))


def test_adversarial_search_finds_a_violation_the_batch_does_not_show(monkeypatch):
    model, engine, *_, shape, classes = private(mlp, "flat", max_grad_norm=3.0)
    real = exact.factors
    monkeypatch.setattr(exact, "factors", lambda bound, max_norm, *a, **kw: real(bound, 2 * max_norm, *a, **kw))
    small = batch_for(shape, classes, scale=0.01)
    assert sensitivity(model, small, engine=engine).ok  # the batch stays below C: the bug does not show
    report = sensitivity(model, small, engine=engine, adversarial_steps=25, scales=())
    row = report.rows[0]
    assert row.ratio < 0.9 and row.adversarial > 1.05 and row.status == "exceeded"
    assert not report.ok and "EXCEEDED (flat: adversarial)" in report.line()


# --------------------------------------------------------------------------- the noise the layers draw

def sequence_net():
    """Biased Linear layers on [B, T=5, 6]: backprop's Δ = C_g √(C_x² + T) needs the T of max_input_shape."""
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), eo.MeanOverTime()), (5, 6), 3


def noise_rows(report):
    return [r for r in report.noise if r.status != "frozen"]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("mode", ["backprop", "flat", "per_layer"])
def test_the_noise_drawn_is_sigma_times_the_bound(mode, reduction):
    """Correct code: every layer's noise, drawn by the training path and measured as the noisy minus
    the noise-free release of the batch (in bound units), has std σ·Δ_l within its interval."""
    model, engine, *_, shape, classes = private(conv_net, mode, reduction)
    report = sensitivity(model, batch_for(shape, classes), engine=engine)
    assert report.ok and "UNDER-NOISED" not in report.line()
    layers = dict(bnn.clipped_layers(model))
    assert [r.name for r in report.noise] == list(layers)
    for row in noise_rows(report):
        assert row.status == "ok" and row.sigma == SIGMA and row.claimed_sigma == SIGMA
        assert row.bound == pytest.approx(layers[row.name].sensitivity)
        assert row.low <= 1 <= row.high and abs(row.ratio - 1) < 0.1 and row.coordinates >= 1000
        assert row.high / row.low < 1.5  # thousands of coordinates: a precise estimate
    assert "noise 0.9" in report.line() or "noise 1.0" in report.line()


@pytest.mark.parametrize("mode", ["backprop", "flat"])
def test_one_draw_for_every_layer_is_caught(monkeypatch, mode):
    """Every layer drawn at layer 0's key: each std is right, but the draws are equal from their
    first element (audit.noise.NoiseCheck's correlations on the same draws)."""
    model, engine, *_, shape, classes = private(conv_net, mode)
    correct = sensitivity(model, batch_for(shape, classes), engine=engine)
    assert correct.ok and not correct.malformed_noise and correct.noise_structure["shape_p_value"] > 1e-6
    original = bnn.NoiseStream.offset
    monkeypatch.setattr(bnn.NoiseStream, "offset", lambda self, index: original(self, 0))
    report = sensitivity(model, batch_for(shape, classes), engine=engine)
    assert all(r.status == "ok" for r in noise_rows(report))  # the std alone is as claimed
    assert not report.ok and "NOISE NOT AS CLAIMED" in report.line()
    assert any("weight and" in name for name in report.malformed_noise)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("mode", ["backprop", "flat", "per_layer"])
def test_noise_scaled_to_a_third_of_the_bound_is_caught(monkeypatch, mode, reduction):
    """The layers scale their draw to a Δ three times too small: the contributions still meet the
    declared bound (the removal check passes); only the measured noise shows it."""
    model, engine, *_, shape, classes = private(conv_net, mode, reduction)
    real = bnn._Clipped._bp_noise_sensitivity
    monkeypatch.setattr(bnn._Clipped, "_bp_noise_sensitivity", lambda self, x: real(self, x) / 3)
    report = sensitivity(model, batch_for(shape, classes), engine=engine)
    assert all(r.status in ("ok", "info") for r in report.rows)
    assert not report.ok and "UNDER-NOISED" in report.line()
    for row in noise_rows(report):
        assert row.status == "under" and row.high < 1 and row.ratio == pytest.approx(1 / 3, rel=0.1)


def test_biased_sequence_linear_noise_forgetting_t_is_caught(monkeypatch):
    """A [B, T, in] biased Linear whose noise is scaled to the Δ of T = 1 (√(C_x² + 1) instead of
    √(C_x² + T)): 0.58 of the claimed std."""
    model, shape, classes = sequence_net()
    x, y = batch_for(shape, classes, n=32, seed=9)
    engine = PrivacyEngine()
    model, *_ = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                    data_loader=DataLoader(TensorDataset(x, y), batch_size=BBAR),
                                    noise_multiplier=SIGMA, max_input_shape=shape, **BACKPROP)
    assert sensitivity(model, batch_for(shape, classes), engine=engine).ok
    monkeypatch.setattr(bnn.Linear, "_bp_noise_sensitivity",
                        lambda self, x: self.sensitivity_for((1, self.in_features)))
    report = sensitivity(model, batch_for(shape, classes), engine=engine)
    assert not report.ok
    want = (1 + 1) ** 0.5 / (1 + 5) ** 0.5  # C_x = 1, T = 5
    for row in noise_rows(report):
        assert row.status == "under" and row.ratio == pytest.approx(want, rel=0.1)


def test_a_layer_drawing_no_noise_is_caught_unless_its_engine_claims_none(monkeypatch):
    model, engine, *_, shape, classes = private(mlp, "flat")
    layer = model[2]
    object.__setattr__(layer, "_bp_noise_multiplier", 0.0)  # past the engine's guard: a layer that forgot σ
    report = sensitivity(model, batch_for(shape, classes), engine=engine)
    rows = {r.name: r for r in report.noise}
    assert not report.ok and rows["2"].status == "under" and rows["2"].ratio == 0 and rows["0"].status == "ok"
    # A DDP rank other than 0: its layers add no noise (rank 0 adds the draw), as its engine claims.
    monkeypatch.setattr(engine, "rank", 1)
    object.__setattr__(model[0], "_bp_noise_multiplier", 0.0)
    report = sensitivity(model, batch_for(shape, classes), engine=engine)
    assert report.ok and all(r.status == "σ = 0" for r in report.noise)
    assert "no noise" in report.line()
    # noise_draws=0: no measurement, said so
    monkeypatch.setattr(engine, "rank", 0)
    report = sensitivity(model, batch_for(shape, classes), engine=engine, noise_draws=0)
    assert report.ok and report.noise_draws == 0 and all(r.status == "not measured" for r in report.noise)
    assert "noise not measured" in report.line()


# --------------------------------------------------------------------------- the model's own dtype

def overclip_float32(monkeypatch, factor=1.1):
    """Plants a bug of the float32 kernels only: every float32 weight gradient a clipped layer
    returns is 10% larger (backprop: autograd._outputs; exact modes: exact._release)."""
    real_outputs, real_release = autograd._outputs, exact._release

    def bigger(gw):
        return gw * factor if gw is not None and gw.dtype == torch.float32 else gw

    monkeypatch.setattr(autograd, "_outputs", lambda layer, ctx, gw, gb: real_outputs(layer, ctx, bigger(gw), gb))

    def release(*args, **kw):
        gw, gb = real_release(*args, **kw)
        return bigger(gw), gb

    monkeypatch.setattr(exact, "_release", release)


def saturating(mode):
    """A model whose examples ×100 reach the bound: backprop's bounds are loose below the top layer,
    and the conv net's top Linear stays at 0.72 of its Δ; the exact modes saturate on the conv net."""
    return mlp if mode == "backprop" else conv_net


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("mode", ["backprop", "flat", "per_layer"])
def test_each_example_alone_in_the_models_dtype_meets_the_bound(mode, reduction):
    model, engine, *_, shape, classes = private(saturating(mode), mode, reduction)
    report = sensitivity(model, batch_for(shape, classes, scale=100.0), engine=engine)
    assert report.ok and report.dtype == "torch.float64" and report.native_dtype == "torch.float32"
    assert report.native_tol < 1e-3  # (positions)·u of float32, with margin: a 10% over-clip is seen
    for row in report.rows:
        assert row.alone is not None and row.alone <= 1 + report.native_tol
        assert row.alone == pytest.approx(row.ratio, rel=1e-4)  # float32 alone = float64 removal
    assert "alone in float32 1.0000" in report.line()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("mode", ["backprop", "flat", "per_layer"])
def test_an_overclip_of_the_float32_kernels_only_is_caught(monkeypatch, mode, reduction):
    model, engine, *_, shape, classes = private(saturating(mode), mode, reduction)
    overclip_float32(monkeypatch)
    report = sensitivity(model, batch_for(shape, classes, scale=100.0), engine=engine)
    assert not report.ok and "EXCEEDED" in report.line() and "alone in float32" in report.line()
    checked = [r for r in report.rows if r.checked]
    assert all(r.ratio <= 1 + report.tol for r in checked)  # the float64 removal cannot see it
    top = max(r.alone for r in checked)
    # backprop: √(1.21 C_x² + 1)/√(C_x² + 1) at a saturated biased layer; exact modes: 1.1 of the weights
    assert top > 1.04
    assert all("alone" in r.failed for r in checked if r.status == "exceeded")


# --------------------------------------------------------------------------- training mode

class CenterInTraining(nn.Module):
    """Mixes the batch in training mode only (a hand-written batch norm): invisible in eval mode."""

    def forward(self, h):
        return h - h.mean(0) if self.training else h


def private_unprobed(model, mode="flat", reduction="sum"):
    x, y = batch_for((6,), 3, n=32, seed=9)
    engine = PrivacyEngine()
    bounds = BACKPROP if mode == "backprop" else dict(max_grad_norm=1.0)
    model, *_ = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                    data_loader=DataLoader(TensorDataset(x, y), batch_size=BBAR),
                                    noise_multiplier=SIGMA, clipping=mode, loss_reduction=reduction, probe=False,
                                    **bounds)
    return model, engine


@pytest.mark.parametrize("mode", ["backprop", "flat"])
def test_mixing_in_training_mode_only_is_caught(mode):
    torch.manual_seed(0)
    model, engine = private_unprobed(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), CenterInTraining(), nn.Linear(8, 3)),
                                     mode)
    report = sensitivity(model, batch_for((6,), 3, scale=100.0), engine=engine)
    assert report.training == "train"
    assert any(n.startswith("examples mix") for n in report.notes)
    if mode == "flat":  # flat: 1.4 of C (eval mode: 1.00000)
        assert not report.ok and max(r.ratio for r in report.rows if r.checked) > 1.2
    else:  # backprop's loose bounds absorb it on this batch: removal 0.86, alone 0.71 of Δ
        top = max((r for r in report.rows if r.checked), key=lambda r: r.ratio)
        assert top.ratio > top.alone + 0.1


def test_dropout_runs_off_in_training_mode_and_the_rng_is_restored():
    """Dropout draws random masks: removal shifts every later example's mask, so the audit turns
    dropout off and keeps the rest in training mode (the batch mixing is still seen)."""
    torch.manual_seed(0)
    model, engine = private_unprobed(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.5), CenterInTraining(),
                                                   nn.Linear(8, 3)))
    torch.manual_seed(123)
    state = torch.get_rng_state()
    report = sensitivity(model, batch_for((6,), 3, scale=100.0), engine=engine, adversarial_steps=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert report.training == "train, dropout off" and any("dropout" in n for n in report.notes)
    assert not report.ok  # CenterInTraining still seen
    torch.manual_seed(0)
    model, engine = private_unprobed(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 3)))
    report = sensitivity(model, batch_for((6,), 3, scale=100.0), engine=engine)
    assert report.ok and report.training == "train, dropout off"


class NoisyInTraining(nn.Module):
    """Functional randomness the audit cannot turn off: it falls back to eval mode and says so."""

    def forward(self, h):
        return h + 0.01 * torch.randn_like(h) if self.training else h


def test_randomness_that_cannot_be_turned_off_falls_back_to_eval_mode_with_a_note():
    torch.manual_seed(0)
    model, engine = private_unprobed(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), NoisyInTraining(), nn.Linear(8, 3)))
    report = sensitivity(model, batch_for((6,), 3), engine=engine)
    assert report.training == "eval" and report.ok
    assert any("eval mode" in n and "random" in n for n in report.notes)


class DriftingInTraining(nn.Module):
    """A training forward that changes from pass to pass without touching the generators."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, h):
        self.calls += self.training
        return h * (1 + 0.1 * (self.calls % 2)) if self.training else h


def test_a_release_that_drifts_in_training_mode_falls_back_to_eval_mode_with_a_note():
    torch.manual_seed(0)
    model, engine = private_unprobed(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), DriftingInTraining(), nn.Linear(8, 3)))
    report = sensitivity(model, batch_for((6,), 3), engine=engine)
    assert report.training == "eval" and report.ok
    assert any("eval mode" in n and "between two passes" in n for n in report.notes)


class _Gain(nn.Module):
    """A module without a fused layer: a generic unit (its parameter is no weight)."""

    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(d))

    def forward(self, x):
        return x * self.gain


def unit_net():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), _Gain(8), nn.Linear(8, 3)), (6,), 3


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_the_audit_measures_a_generic_unit(mode):
    """Review 34 P3: the audit read every clipped layer's weight and bias, so a model with a generic
    unit crashed it (AttributeError). A unit's parameters are read by their names
    (noise_free.layer_params): its contributions and its noise (one draw over all of them) are
    measured, and a unit that draws no noise is caught."""
    model, engine, *_, shape, classes = private(unit_net, mode)
    report = sensitivity(model, batch_for(shape, classes, scale=100.0), engine=engine)
    rows = {r.name: r for r in report.noise}
    assert report.ok, report.line()
    assert rows["2"].status == "ok" and "gain" in rows["2"].parts
    object.__setattr__(model[2], "_bp_noise_multiplier", 0.0)  # past the engine's guard: a unit that forgot σ
    report = sensitivity(model, batch_for(shape, classes), engine=engine)
    rows = {r.name: r for r in report.noise}
    assert not report.ok and rows["2"].status == "under" and rows["0"].status == "ok"
