"""Fused exact paths for ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (bpclip_fast/layers/recurrent.py, issue 26).

Before, these were trained by the generic exact path; now each layer and direction is two clipped
Linears over the time steps (``ih`` on the inputs, ``hh`` on the previous hidden states).

* Exactness: a zero-noise release (never armed: no noise, no scaling) equals ``Σ_i clip(G_i)`` with
  ``G_i`` example ``i``'s gradient from running it alone through a float64 copy of torch's own
  module, flat and per_layer (every clipped Linear one unit), LSTM/GRU/RNN tanh/relu, 1 and 2
  layers, bidirectional, ``batch_first`` both ways, ``h_0`` (``c_0``) given or not, a batch of one.
* The forward (output, ``h_n``, ``c_n``) and the gradients of the input, ``h_0``/``c_0`` and (unclipped)
  every parameter equal torch's in float64, dropout between layers included (same masks).
* ``state_dict`` keys are torch's, in torch's order; a converted model's checkpoint loads into the
  plain module and back; the same Parameter objects.
* ``PrivacyEngine.make_private`` end to end; refusals (backprop, PackedSequence, unbatched); the
  configurations left to the generic path (``proj_size``).

Tolerances. Every compared value is a composition of T recurrence steps, each a dot product of at
most ``n = in + G·H`` terms (G gates, H hidden) followed by gate functions whose derivatives are at
most 1 (sigmoid, tanh, relu); the backward is the transposed chain, and a weight gradient entry sums
T products. First-order error analysis gives a relative error of at most ``T·(n + G·H + T)·u`` per
stage on the scale of the values involved; forward and backward and the two sides (ours, the
float64 reference) make 4 stages. The models here are contracting (weights ``≤ 1/√H`` as torch
initialises them, inputs ``~N(0, 1)``), so the propagated error stays of the order of the per-step
one. The clipped release adds the exact path's own error, ``(2K·u)`` of ``‖G_i‖`` per example (K the
terms of the norm and factor, tests/test_registry_harness.py).
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast.nn as bnn
from bpclip_fast import PrivacyEngine, registry
from bpclip_fast.layers import recurrent

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

F64 = torch.float64
EPS64 = torch.finfo(F64).eps
D_IN, HID, T = 4, 3, 4
KINDS = {
    "lstm": lambda **kw: nn.LSTM(D_IN, HID, **kw),
    "gru": lambda **kw: nn.GRU(D_IN, HID, **kw),
    "rnn_tanh": lambda **kw: nn.RNN(D_IN, HID, **kw),
    "rnn_relu": lambda **kw: nn.RNN(D_IN, HID, nonlinearity="relu", **kw),
}
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
# (num_layers, bidirectional, batch_first, h_0 given)
CONFIGS = [(1, False, True, False), (1, True, False, True), (2, True, True, True), (2, False, False, False)]


def _id(v):
    return "L{}-{}-{}-{}".format(v[0], "bi" if v[1] else "uni", "bf" if v[2] else "sf", "h0" if v[3] else "no-h0")


def make(kind, config, dtype=F64, seed=0, **kw):
    layers, bi, bf, _ = config
    torch.manual_seed(seed)
    return KINDS[kind](num_layers=layers, bidirectional=bi, batch_first=bf, dtype=dtype, **kw)


def data(module, n, dtype, given_h0, seed=1):
    """``(x, hx, g_out, g_state)``: input, initial state (or None), upstream gradients of the output and
    of the final state(s), all rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=F64).to(dtype)  # noqa: E731
    bf, d = module.batch_first, (2 if module.bidirectional else 1)
    x = rnd(n, T, D_IN) if bf else rnd(T, n, D_IN)
    states = 2 if isinstance(module, nn.LSTM) else 1
    hx = [rnd(module.num_layers * d, n, HID) for _ in range(states)] if given_h0 else None
    g_out = rnd(n, T, d * HID) if bf else rnd(T, n, d * HID)
    g_state = [rnd(module.num_layers * d, n, HID) for _ in range(states)]
    return x, hx, g_out, g_state


def _call(module, x, hx):
    """``[output, h_n(, c_n)]``."""
    state = None if hx is None else (tuple(hx) if len(hx) == 2 else hx[0])
    out, last = module(x, state)
    return [out, *(last if isinstance(last, tuple) else (last,))]


def _loss(outs, g_out, g_state):
    return sum((o * g).sum() for o, g in zip(outs, [g_out, *g_state]))


def _rows(t, i, seq_first):
    return t[:, i:i + 1] if seq_first else t[i:i + 1]


def per_example(module, x, hx, g_out, g_state):
    """``{torch name: [B, *shape]}``: each example alone through a float64 copy of the torch module."""
    ref = copy.deepcopy(module).double()
    params = dict(ref.named_parameters())
    sf = not module.batch_first
    rows = {k: [] for k in params}
    for i in range(x.shape[1 if sf else 0]):
        hi = None if hx is None else [h[:, i:i + 1].double() for h in hx]
        outs = _call(ref, _rows(x, i, sf).double(), hi)
        loss = _loss(outs, _rows(g_out, i, sf).double(), [g[:, i:i + 1].double() for g in g_state])
        for k, g in zip(params, torch.autograd.grad(loss, list(params.values()))):
            rows[k].append(g)
    return {k: torch.stack(v) for k, v in rows.items()}


def units(module):
    """The per_layer clipping units: each clipped Linear's (weight, bias) by torch name, in order."""
    out = []
    for k in range(module.num_layers):
        for sfx in ["", "_reverse"][:2 if module.bidirectional else 1]:
            for side in ("ih", "hh"):
                out.append([f"{kind}_{side}_l{k}{sfx}" for kind in ("weight", "bias")[:2 if module.bias else 1]])
    return out


def tolerance_stages(kind, module, dtype):
    u = torch.finfo(dtype).eps / 2
    n = D_IN + module.hidden_size * (2 if module.bidirectional else 1) + GATES[kind] * HID
    return 4 * T * (n + GATES[kind] * HID + T) * u


@pytest.mark.parametrize("n", [3, 1])
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=str)
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("config", CONFIGS, ids=_id)
@pytest.mark.parametrize("kind", list(KINDS))
def test_release_equals_the_clipped_sum_of_float64_example_gradients(kind, config, mode, dtype, n):
    module = make(kind, config, dtype)
    x, hx, g_out, g_state = data(module, n, dtype, config[3])
    per_ex = per_example(module, x, hx, g_out, g_state)
    groups = [list(per_ex)] if mode == "flat" else units(module)
    norms = [sum(per_ex[k].flatten(1).pow(2).sum(1) for k in ks).sqrt() for ks in groups]
    # Some examples clipped and some not (the median of 3); a lone example clipped.
    cuts = [float(v.median()) if n > 1 else 0.5 * float(v[0]) for v in norms]
    want = {}
    for ks, v, c in zip(groups, norms, cuts):
        f = torch.clamp(c / v, max=1.0)
        assert (f < 1).any()
        for k in ks:
            want[k] = (f.view(-1, *[1] * (per_ex[k].dim() - 1)) * per_ex[k]).sum(0)

    model = bnn.convert_model(copy.deepcopy(module), clipping=mode, max_grad_norm=cuts[0] if mode == "flat" else cuts)
    assert isinstance(model, recurrent._Recurrent) and isinstance(model, type(module))
    assert all(getattr(m, "noise_multiplier", 0.0) == 0 for m in model.modules())
    _loss(_call(model, x, hx), g_out, g_state).backward()
    got = {k: p.grad.double() for k, p in model.state_dict(keep_vars=True).items()}
    assert list(got) == list(dict(module.named_parameters())) and set(want) == set(got)
    err = math.sqrt(sum(float((got[k] - want[k]).pow(2).sum()) for k in want))
    total = math.sqrt(sum(float(w.pow(2).sum()) for w in want.values()))
    scale = sum(float(sum(per_ex[k][i].pow(2).sum() for k in per_ex).sqrt()) for i in range(n))
    tol = tolerance_stages(kind, module, dtype) * (scale + total)
    assert err <= tol, f"‖release − truth‖ = {err:.3g} > {tol:.3g} (‖truth‖ = {total:.3g})"


def _forward_backward(module, x, hx, g_out, g_state):
    x = x.clone().requires_grad_()
    hx = None if hx is None else [h.clone().requires_grad_() for h in hx]
    outs = _call(module, x, hx)
    _loss(outs, g_out, g_state).backward()
    grads = {k: p.grad for k, p in module.state_dict(keep_vars=True).items()}
    return [o.detach() for o in outs], [x.grad] + ([] if hx is None else [h.grad for h in hx]), grads


def _close(a, b, tol, what):
    scale = float(b.abs().max()) if b.numel() else 0.0
    assert float((a - b).abs().max()) <= tol * max(scale, 1.0), what


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("config", CONFIGS, ids=_id)
@pytest.mark.parametrize("kind", list(KINDS))
def test_forward_and_every_gradient_equal_torch_in_float64(kind, config, bias):
    """Unclipped (C far above every norm): the detached recurrences must not drop a path."""
    module = make(kind, config, bias=bias)
    x, hx, g_out, g_state = data(module, 3, F64, config[3])
    model = bnn.convert_model(copy.deepcopy(module), clipping="per_layer", max_grad_norm=1e30)
    want = _forward_backward(module, x, hx, g_out, g_state)
    got = _forward_backward(model, x, hx, g_out, g_state)
    tol = tolerance_stages(kind, module, F64)
    for a, b in zip(got[0], want[0]):
        _close(a, b, tol, "forward")
    for a, b in zip(got[1], want[1]):
        _close(a, b, tol, "input gradient")
    assert list(got[2]) == list(want[2])
    for k in want[2]:
        _close(got[2][k], want[2][k], tol, k)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_dropout_between_layers_uses_one_mask_for_values_and_gradients(kind):
    """torch's own masks cannot be reproduced, so the reference is torch's layers stacked one by one
    with the same F.dropout calls (same generator state): the outputs and gradients must match, and
    differ from the model without dropout."""
    config = (3, True, True, False)
    module = make(kind, config, dropout=0.5)
    x, hx, g_out, g_state = data(module, 3, F64, False)
    model = bnn.convert_model(copy.deepcopy(module), clipping="per_layer", max_grad_norm=1e30).train()
    layers = []
    for k in range(3):
        one = KINDS[kind](num_layers=1, bidirectional=True, batch_first=True, dtype=F64)
        if k:
            one = type(one)(2 * HID, HID, bidirectional=True, batch_first=True, dtype=F64)
        with torch.no_grad():
            for name, p in one.named_parameters():
                p.copy_(getattr(module, name.replace("_l0", f"_l{k}")))
        layers.append(one)

    class Stacked(nn.Module):
        def forward(self, x, state):
            h, states = x, []
            for k, one in enumerate(layers):
                if k:  # on a contiguous tensor, as ours (the mask is drawn in memory order)
                    h = nn.functional.dropout(h.contiguous(), 0.5, True)
                h, last = one(h)
                states.append(last)
            if kind == "lstm":
                return h, (torch.cat([s[0] for s in states]), torch.cat([s[1] for s in states]))
            return h, torch.cat(states)

    torch.manual_seed(5)
    got = _forward_backward(model, x, hx, g_out, g_state)
    torch.manual_seed(5)
    ref_x = x.clone().requires_grad_()
    outs = _call(Stacked(), ref_x, None)
    _loss(outs, g_out, g_state).backward()
    tol = tolerance_stages(kind, module, F64)
    for a, b in zip(got[0], outs):
        _close(a, b.detach(), tol, "forward")
    _close(got[1][0], ref_x.grad, tol, "input gradient")
    for k in range(3):
        for name, p in layers[k].named_parameters():
            _close(got[2][name.replace("_l0", f"_l{k}")], p.grad, tol, name)
    model.eval()
    with torch.no_grad():
        assert not torch.allclose(_call(model, x, None)[0], got[0][0])


def test_state_dict_is_torchs_and_loads_both_ways():
    module = make("lstm", (2, True, False, False))
    params = [p for p in module.parameters()]
    keys = list(module.state_dict())
    model = bnn.convert_model(nn.Sequential(copy.deepcopy(module)), clipping="flat", max_grad_norm=1.0)
    assert isinstance(model[0], recurrent.LSTM)
    assert list(model.state_dict()) == ["0." + k for k in keys]
    plain = nn.Sequential(make("lstm", (2, True, False, False), seed=9))
    plain.load_state_dict(model.state_dict())
    x = torch.randn(T, 2, D_IN, dtype=F64)
    with torch.no_grad():
        assert torch.equal(plain(x)[0], module(x)[0])
        model.load_state_dict(nn.Sequential(make("lstm", (2, True, False, False), seed=9)).state_dict())
        torch.testing.assert_close(model(x)[0], make("lstm", (2, True, False, False), seed=9)(x)[0])
    # The same Parameter objects (an optimizer built before the conversion keeps working), one owner each.
    same = bnn.convert_model(nn.Sequential(module), clipping="flat", max_grad_norm=1.0)
    assert {id(p) for p in same.parameters()} == {id(p) for p in params}
    assert same[0].weight_hh_l1_reverse is params[keys.index("weight_hh_l1_reverse")]
    assert not registry.generic_units(same)
    buf = io.BytesIO()
    torch.save(same, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(back(x)[0], same(x)[0])


def test_per_layer_thresholds_count_each_clipped_linear():
    model = nn.Sequential(nn.Linear(D_IN, D_IN), make("gru", (2, True, True, False), dtype=torch.float32))
    model[1].weight_hh_l1.requires_grad_(False)
    model[1].bias_hh_l1.requires_grad_(False)  # a frozen pair: a plain Linear, no threshold
    bnn.convert_model(model, clipping="per_layer", max_grad_norm=2.0)
    clipped = bnn.clipped_layers(model)
    assert [name for name, _ in clipped] == ["0", "1.ih_l0", "1.hh_l0", "1.ih_l0_reverse", "1.hh_l0_reverse",
                                             "1.ih_l1", "1.ih_l1_reverse", "1.hh_l1_reverse"]
    assert type(model[1].hh_l1) is nn.Linear
    assert all(layer._bp_max_grad_norm == pytest.approx(2.0 / math.sqrt(8)) for _, layer in clipped)
    assert all(layer._bp_noise_bound == pytest.approx(2.0) and layer._bp_noise_bound >= 2.0 for _, layer in clipped)
    with pytest.raises(ValueError, match="max_grad_norm has 2 thresholds but the model has 5 layers"):
        bnn.convert_model(nn.Sequential(nn.Linear(2, 2), nn.RNN(2, 2, bidirectional=True)), clipping="per_layer",
                          max_grad_norm=[1.0, 1.0])


def test_refusals_and_the_configurations_left_generic():
    with pytest.raises(ValueError, match=r"LSTM\): clipping='backprop' has no proved bound.*'flat' or 'per_layer'"):
        bnn.convert_model(nn.Sequential(nn.LSTM(2, 2)), input_clip=1.0, grad_clip=1.0)
    model = bnn.convert_model(nn.Sequential(nn.LSTM(2, 3, batch_first=True)), clipping="flat", max_grad_norm=1.0)
    x = torch.randn(2, 4, 2)
    packed = pack_padded_sequence(x, [4, 2], batch_first=True)
    with pytest.raises(ValueError, match=r"PackedSequence input is not supported.*pad the batch"):
        model(packed)
    with pytest.raises(ValueError, match=r"must be batched.*add a batch dimension"):
        model(x[0])
    with pytest.raises(TypeError, match=r"LSTM: the input is torch.float64.*parameters are torch.float32"):
        model(x.double())
    # proj_size: not fused, the generic path trains it as before
    proj = nn.LSTM(2, 3, proj_size=2)
    assert registry.layer_type(proj) is None and registry.generic_candidate(proj)
    wrapped = bnn.convert_model(nn.Sequential(proj), clipping="flat", max_grad_norm=1.0)
    assert registry.is_generic(wrapped[0])
    # a subclass: generic (its forward may differ from the type the fused path reproduces)
    class UserGRU(nn.GRU):
        pass
    assert registry.generic_candidate(UserGRU(2, 3))


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_make_private_trains_fused_recurrent_layers(mode):
    torch.manual_seed(8)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.rnn = nn.LSTM(8, 8, num_layers=2, bidirectional=True, batch_first=True)
            self.gru = nn.GRU(16, 4)  # sequence-first
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            h = self.rnn(torch.tanh(self.inp(x)))[0]
            return self.head(self.gru(h.transpose(0, 1))[0].mean(0))

    model = Model()
    keys = list(model.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    data = TensorDataset(torch.randn(48, 5, 4), torch.randint(0, 3, (48,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt,
                                                      data_loader=DataLoader(data, batch_size=16),
                                                      noise_multiplier=1.0, max_grad_norm=1.0, clipping=mode)
    assert isinstance(model.rnn, recurrent.LSTM) and isinstance(model.gru, recurrent.GRU)
    assert [n for n, _ in bnn.clipped_layers(model)][1:5] == ["rnn.ih_l0", "rnn.hh_l0", "rnn.ih_l0_reverse",
                                                            "rnn.hh_l0_reverse"]
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert list(model.state_dict()) == keys


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=str)
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("config", CONFIGS[1:3], ids=_id)
@pytest.mark.parametrize("kind", list(KINDS))
def test_removing_an_example_far_above_c_changes_the_release_by_c(kind, config, mode, dtype):
    """Every example clipped (C_u a thousandth of the smallest nonzero norm): removing one changes each
    unit's release by its C_u (0 where the example's gradient of the unit is exactly 0). Example j's released contribution c_j·Ĝ_j is off C_u·G_j/‖G_j‖ by at most
    C_u times Ĝ_j's relative error (the stages above), and each of the two releases rounds the
    others' contributions (each of norm C_u) as much, so the allowance is (2B + 2)·stages·C_u."""
    n = 3
    module = make(kind, config, dtype, seed=3)
    x, hx, g_out, g_state = data(module, n, dtype, config[3], seed=4)
    per_ex = per_example(module, x, hx, g_out, g_state)
    groups = [list(per_ex)] if mode == "flat" else units(module)
    norms = [sum(per_ex[k].flatten(1).pow(2).sum(1) for k in ks).sqrt() for ks in groups]
    smallest = min(float(v[v > 0].min()) for v in norms if (v > 0).any())
    c_unit = 1e-3 * smallest
    c = c_unit if mode == "flat" else c_unit * math.sqrt(len(groups))
    model = bnn.convert_model(copy.deepcopy(module), clipping=mode, max_grad_norm=c)
    assert all(layer._bp_max_grad_norm == pytest.approx(c_unit) for _, layer in bnn.clipped_layers(model))

    def release(keep):
        model.zero_grad(set_to_none=True)
        sf = not module.batch_first
        pick = (lambda t: t[:, keep]) if sf else (lambda t: t[keep])  # noqa: E731
        h = None if hx is None else [t[:, keep] for t in hx]
        _loss(_call(model, pick(x), h), pick(g_out), [t[:, keep] for t in g_state]).backward()
        return {k: p.grad.double() for k, p in model.state_dict(keep_vars=True).items()}

    full = release(list(range(n)))
    tol = (2 * n + 2) * tolerance_stages(kind, module, dtype)
    for i in range(n):
        part = release([j for j in range(n) if j != i])
        for ks, v in zip(groups, norms):
            change = math.sqrt(sum(float((full[k] - part[k]).pow(2).sum()) for k in ks))
            want = c_unit if v[i] > 0 else 0.0  # a relu RNN's unit may get no gradient from an example
            assert abs(change - want) <= c_unit * tol, f"example {i}, {ks}: {change:.9g} vs {want:.9g}"


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_an_overflowing_cell_state_drops_only_its_own_example(mode):
    """An LSTM started from a per-example cell state that overflows (exp of a large feature): that
    example's rows in the clipped Linears are non-finite and get factor 0; the others are released as
    without it (float64, the same per-row computations: equal to rounding of a few dozen terms)."""
    torch.manual_seed(0)

    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(3, 4, batch_first=True, dtype=F64)
            self.head = nn.Linear(4, 2, dtype=F64)

        def forward(self, x, z):
            c0 = torch.exp(z).unsqueeze(0)
            out, _ = self.rnn(x, (torch.zeros_like(c0), c0))
            return self.head(out[:, -1])

    base = Stateful()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 3, generator=g, dtype=F64)
    z = torch.randn(4, 4, generator=g, dtype=F64)
    z[0] = 1000.0
    y = torch.randint(0, 2, (4,), generator=g)
    C = 0.05

    def run(keep):
        m = copy.deepcopy(base)
        bnn.convert_model(m, clipping=mode, max_grad_norm=C)
        assert isinstance(m.rnn, recurrent.LSTM)
        nn.functional.cross_entropy(m(x[keep], z[keep]), y[keep], reduction="sum").backward()
        counts = sum(int(layer._bp_nonfinite.sum()) for _, layer in bnn.clipped_layers(m))
        return torch.cat([p.grad.flatten() for p in m.rnn.parameters()]), counts

    (a, dropped), (b, none) = run([0, 1, 2, 3]), run([1, 2, 3])
    assert dropped > 0 and none == 0
    assert bool(torch.isfinite(a).all()) and float(b.norm()) > 0
    assert torch.all((a - b).abs() <= 64 * T * EPS64 * C * 4)



def test_unpack_and_pack_are_inverse_and_the_probes_see_the_linears():
    module = make("gru", (2, True, False, True))
    params = list(module.parameters())
    keys = list(module.state_dict())
    x = torch.randn(T, 2, D_IN, dtype=F64)
    with torch.no_grad():
        want = module(x)[0]
    recurrent.unpack(module)
    assert isinstance(module, nn.GRU) and [n for n, _ in module.named_children()][:2] == ["ih_l0", "hh_l0"]
    assert list(module.state_dict()) == keys and module.weight_ih_l1_reverse is params[keys.index("weight_ih_l1_reverse")]
    with torch.no_grad():
        torch.testing.assert_close(module(x)[0], want, rtol=0, atol=tolerance_stages("gru", module, F64))
    recurrent.pack(module)
    assert type(module) is nn.GRU and list(dict(module.named_parameters())) == keys
    assert [id(p) for p in module.parameters()] == [id(p) for p in params]
    with torch.no_grad():
        assert torch.equal(module(x)[0], want)
    # not unpacked: the generic path keeps them
    assert "proj_size" in recurrent.not_fused(nn.LSTM(2, 3, proj_size=2))
    assert "subclass" in recurrent.not_fused(type("UserRNN", (nn.RNN,), {})(2, 3))


def test_the_ownership_probe_reports_a_recurrent_weight_used_elsewhere():
    """A weight of the recurrent layer also used in plain code would be released unclipped; the probes
    unpack the layer as convert_model does, so probe 4 recomputes each Linear's gradient and sees it."""
    from bpclip_fast import validate

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(3, 3, batch_first=True)

        def forward(self, x):
            h = self.rnn(x)[0]
            return h + nn.functional.linear(x, self.rnn.weight_ih_l0[:3])

    x = torch.randn(4, 5, 3)
    assert not validate.dynamic_problems(nn.Sequential(nn.GRU(3, 3, batch_first=True)), x, clipping="flat")
    problems = validate.dynamic_problems(Tied(), x, clipping="flat")
    assert any("rnn.ih_l0" in p and "gradient ownership" in p for p in problems), problems
