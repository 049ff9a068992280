"""The generic exact path (bpclip_fast/generic.py): modules with no fused clipped layer, trained
under flat and per_layer from their per-example gradients, against float64 truth from batches of
one (Opacus' per-sample clipping: each example's whole gradient clipped to C, then summed)."""

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import bpclip_fast.nn as bnn
from bpclip_fast import PrivacyEngine, generic, registry
from torch.utils.data import DataLoader, TensorDataset

EPS64 = torch.finfo(torch.float64).eps


class Custom(nn.Module):
    """A layer of the user's own: parameters of its own and a child Linear it calls."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.shift = nn.Parameter(torch.randn(d))
        self.inner = nn.Linear(d, d)

    def forward(self, x):
        return self.inner(torch.tanh(x * self.scale + self.shift))


class UserRMSNorm(nn.RMSNorm):
    """Subclasses of registered types are not converted to the fused layers (bpclip_fast/layers/
    norms.py registers the exact torch types): torch's RMSNorm/InstanceNorm computations, trained
    by the generic path."""


class UserInstanceNorm1d(nn.InstanceNorm1d):
    __doc__ = UserRMSNorm.__doc__


class UserLSTM(nn.LSTM):
    """As UserRMSNorm: bpclip_fast/layers/recurrent.py fuses the exact torch recurrent types."""


class UserGRU(nn.GRU):
    __doc__ = UserLSTM.__doc__


class UserRNN(nn.RNN):
    __doc__ = UserLSTM.__doc__


class UserMHA(nn.MultiheadAttention):
    """A user subclass: left to the generic path (a plain nn.MultiheadAttention is fused, layers/attention.py)."""


def _generic_encoder(d):
    """An encoder layer whose attention is a UserMHA, so the generic path trains it (with torch's
    attention the layer is fused: tests/test_fused_attention.py)."""
    layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=8, dropout=0.0, batch_first=True)
    layer.self_attn = UserMHA(d, 2, batch_first=True)
    return layer


class UserConv1d(nn.Conv1d):
    """nn.Conv1d has a fused layer (bpclip_fast/layers/conv1d.py); a subclass stays generic."""


class UserConv3d(nn.Conv3d):
    """nn.Conv3d has a fused layer (bpclip_fast/layers/conv3d.py); a subclass stays generic."""


class Net(nn.Module):
    """``[B, T, 4]`` -> 3 classes through one module of ``kind``."""

    def __init__(self, kind, dropout=0.0):
        super().__init__()
        self.kind = kind
        d = 4
        self.m = {
            "lstm": lambda: UserLSTM(d, 6, num_layers=2, bidirectional=True, batch_first=True),
            "lstm_seq_first": lambda: UserLSTM(d, 6),
            "gru": lambda: UserGRU(d, 6, batch_first=True),
            "rnn": lambda: UserRNN(d, 6, batch_first=True),
            "mha": lambda: UserMHA(d, 2, batch_first=True, dropout=dropout),
            "mha_seq_first": lambda: UserMHA(d, 2),
            "encoder": lambda: _generic_encoder(d),
            "conv1d": lambda: UserConv1d(d, 5, 3, padding=1),
            "conv3d": lambda: UserConv3d(1, 2, 2),
            "rmsnorm": lambda: UserRMSNorm(d),
            "instancenorm": lambda: UserInstanceNorm1d(d, affine=True),
            "custom": lambda: Custom(d),
        }[kind]()
        width = {"lstm": 12, "lstm_seq_first": 6, "gru": 6, "rnn": 6, "conv1d": 5, "conv3d": 2}.get(kind, d)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        k, m = self.kind, self.m
        if k in ("lstm", "gru", "rnn"):
            h = m(x)[0].mean(1)
        elif k == "lstm_seq_first":
            h = m(x.transpose(0, 1))[0].mean(0)
        elif k == "mha":
            h = m(x, x, x)[0].mean(1)
        elif k == "mha_seq_first":
            s = x.transpose(0, 1)
            h = m(s, s, s)[0].mean(0)
        elif k in ("conv1d", "instancenorm"):
            h = m(x.transpose(1, 2)).mean(2)
        elif k == "conv3d":
            h = m(x.reshape(x.shape[0], 1, 5, 2, 2)).mean((2, 3, 4))
        else:
            h = m(x).mean(1)
        return self.head(torch.tanh(h))


KINDS = ["lstm", "lstm_seq_first", "gru", "rnn", "mha", "mha_seq_first", "encoder", "conv1d", "conv3d", "rmsnorm",
         "instancenorm", "custom"]


def per_example_grads(ref, x, y):
    """{name: [B, *shape]}: each example's gradient from a batch of one (float64)."""
    rows = {n: [] for n, p in ref.named_parameters() if p.requires_grad}
    for i in range(x.shape[0]):
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        for n, p in ref.named_parameters():
            if p.requires_grad:
                rows[n].append(p.grad.clone())
    return {n: torch.stack(v) for n, v in rows.items()}


def clipped_truth(grads, groups):
    """Σ_i min(1, C_g/‖G_i restricted to g‖) G_i for each group g = (names, C_g) (flat: one group of
    every name), and Σ_i |that term| (the scale of the float64 rounding)."""
    total, scale = {}, {}
    for names, C in groups:
        norm = torch.sqrt(sum((grads[n] ** 2).flatten(1).sum(1) for n in names))
        c = torch.clamp(C / norm, max=1.0)
        for n in names:
            term = c.view(-1, *[1] * (grads[n].dim() - 1)) * grads[n]
            total[n], scale[n] = term.sum(0), term.abs().sum(0)
    return total, scale


def groups_of(model, C=None):
    """The converted model's clipping groups: every clipped layer's parameter names with its C_l
    (``C``: one group of all, flat clipping's)."""
    names = {id(p): n for n, p in model.named_parameters()}
    if C is not None:
        return [([n for n, p in model.named_parameters() if p.requires_grad], C)]
    out = []
    for _, layer in bnn.clipped_layers(model):
        params = layer._bp_params() if "_bp_slots" in layer.__dict__ else [layer.weight, layer.bias]
        out.append(([names[id(p)] for p in params if p is not None and p.requires_grad], layer._bp_max_grad_norm))
    return out


def _inputs(seed, B=7, T=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("kind", KINDS)
def test_release_equals_per_example_clipping(kind, mode):
    torch.manual_seed(3)
    model = Net(kind).double()
    x, y = _inputs(5)
    grads = per_example_grads(copy.deepcopy(model), x, y)
    C = 0.5  # below most examples' norms: the clipping acts
    bnn.convert_model(model, clipping=mode, max_grad_norm=C)
    assert any(generic.GenericLayer in type(m).__mro__ for m in model.modules())
    truth, scale = clipped_truth(grads, groups_of(model, C if mode == "flat" else None))
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    for n, p in model.named_parameters():
        # float64 on both sides, in other orders (a batched backward vs batches of one): each entry
        # is a backward through at most ~10³ roundings (time steps x layers x gates), each within an
        # ulp of the intermediate magnitudes, which the parameter's largest summed term bounds
        tol = 1000 * EPS64 * float(scale[n].max())
        assert p.grad is not None, n
        assert torch.all((p.grad - truth[n]).abs() <= tol), (n, float((p.grad - truth[n]).abs().max()))


@pytest.mark.parametrize("kind", ["lstm", "mha", "custom"])
def test_each_example_moves_the_release_by_at_most_C(kind):
    """Removal in float64: the release with and without example j differs by ≤ C (noise off)."""
    torch.manual_seed(4)
    base = Net(kind).double()
    x, y = _inputs(6, B=6)
    C = 0.3

    def release(rows):
        model = copy.deepcopy(base)
        bnn.convert_model(model, clipping="flat", max_grad_norm=C)
        nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="sum").backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    full = release(list(range(6)))
    for j in range(6):
        diff = float((full - release([i for i in range(6) if i != j])).norm())
        assert diff <= C * (1 + 1e-9), (j, diff)


def test_dropout_inside_a_unit_uses_the_forwards_own_masks():
    """The per-example gradients come from the forward's saved graph, not a recomputation: with C
    large enough that nothing is clipped, their sum is the plain gradient of the same forward
    (same dropout masks, from the same generator state)."""
    torch.manual_seed(5)
    base = Net("mha", dropout=0.5).double()
    ref = copy.deepcopy(base)
    x, y = _inputs(7)
    model = copy.deepcopy(base)
    bnn.convert_model(model, clipping="per_layer", max_grad_norm=[1e6, 1e6])
    torch.manual_seed(11)
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    torch.manual_seed(11)
    nn.functional.cross_entropy(ref(x), y, reduction="sum").backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1000 * EPS64 * float(q.grad.abs().max())), n


def test_a_unit_keeps_its_state_dict_and_pickles():
    torch.manual_seed(6)
    model = Net("lstm").double()
    keys = list(model.state_dict())
    bnn.convert_model(model, clipping="flat", max_grad_norm=1.0)
    assert list(model.state_dict()) == keys
    assert isinstance(model.m, nn.LSTM)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert type(back.m) is type(model.m)
    x, _ = _inputs(1)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
    assert type(copy.deepcopy(model).m) is type(model.m)


def test_backprop_mode_refuses_a_module_without_a_fused_layer():
    with pytest.raises(ValueError, match=r"m \(UserLSTM\): clipping='backprop' has no proved bound.*'flat' or 'per_layer'"):
        bnn.convert_model(Net("lstm"), input_clip=1.0, grad_clip=1.0)


def test_mixed_parameter_dtypes_in_one_unit_are_refused():
    model = Net("custom")
    model.m.scale.data = model.m.scale.data.double()
    with pytest.raises(ValueError, match=r"one vector of one dtype"):
        bnn.convert_model(model, clipping="flat", max_grad_norm=1.0)


class BatchLast(nn.Module):
    """Returns its output with the examples in the last dimension: masking dimension 0 would mix them."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return (x * self.w).mean(1).t()


def test_an_output_without_the_examples_in_its_batch_dimension_is_refused():
    model = nn.Sequential(BatchLast()).double()
    bnn.convert_model(model, clipping="per_layer", max_grad_norm=[1.0])
    x, _ = _inputs(2, B=7)
    out = model(x)  # [4, 7]
    with pytest.raises(RuntimeError, match=r"no dimension 0 of 7 rows"):
        out.sum().backward()


def test_a_frozen_parameter_of_a_unit_gets_no_gradient_and_the_rest_stay_exact():
    torch.manual_seed(7)
    model = Net("custom").double()
    model.m.shift.requires_grad_(False)
    x, y = _inputs(8)
    grads = per_example_grads(copy.deepcopy(model), x, y)
    bnn.convert_model(model, clipping="flat", max_grad_norm=0.5)
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    truth, scale = clipped_truth(grads, groups_of(model, 0.5))
    assert model.m.shift.grad is None
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.all((p.grad - truth[n]).abs() <= 1000 * EPS64 * float(scale[n].max())), n


class _Affine(nn.Module):
    """A unit that owns parameters and calls no fused layer."""

    def __init__(self, d):
        super().__init__()
        self.s, self.t = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, h):
        return h * self.s + self.t


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_a_unit_frozen_whole_after_make_private_leaves_the_step_to_the_rest(mode):
    """Review 28, S1: a generic unit with every parameter frozen got the step's fallback draw of no
    parameter (``IndexError`` in ``step()``), and its batch, left counted, had the next step
    refused and charged. It is skipped as a fused layer frozen whole is."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(6, 8), _Affine(8), nn.Tanh(), nn.Linear(8, 3))
    data = TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=DataLoader(data, batch_size=8), noise_multiplier=1.0,
                                             max_grad_norm=1.0, clipping=mode, noise_seed=1)
    inner = model._module if hasattr(model, "_module") else model
    inner[1].requires_grad_(False)
    before = [p.detach().clone() for p in inner.parameters()]
    steps = 0
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        steps += 1
    assert steps == 4 and len(engine.accountant) == steps
    for (name, p), b in zip(inner.named_parameters(), before):
        if name.startswith("1."):
            assert p.grad is None and torch.equal(p, b), name
        else:
            assert not torch.equal(p, b), name


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_make_private_trains_recurrent_and_attention_models(mode):
    """The whole engine path (probes, arming, records, noise) with generic units, in float32."""
    torch.manual_seed(8)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.rnn = UserLSTM(8, 8, batch_first=True)
            self.attn = UserMHA(8, 2, batch_first=True)
            self.norm = UserRMSNorm(8)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = self.rnn(torch.tanh(self.inp(x)))[0]
            h = h + self.attn(h, h, h, need_weights=False)[0]
            return self.head(self.norm(h).mean(1))

    model = Model()
    before = [p.detach().clone() for p in model.parameters()]
    data = TensorDataset(torch.randn(48, 5, 4), torch.randint(0, 3, (48,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt,
                                                      data_loader=DataLoader(data, batch_size=16),
                                                      noise_multiplier=1.0, max_grad_norm=1.0, clipping=mode)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


class Aliased(nn.Module):
    """A Linear held under a second name (``self.b = self.a``, e.g. an alias kept for an older
    attribute name); the forward calls it once."""

    def __init__(self, alias: bool):
        super().__init__()
        self.a = nn.Linear(6, 6)
        if alias:
            self.b = self.a
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.a(x)))


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_a_module_held_under_two_names_is_one_clipped_layer(mode):
    """Review 31: both names registered the module's parameters, which read as one parameter shared
    by two modules, so the whole model became one generic unit and every step was refused (rows or
    unclipped-param) and charged. One module under two names is one layer: converted once, both
    names holding the clipped layer, trained bit for bit as the model without the alias."""
    released = {}
    for alias in (False, True):
        torch.manual_seed(0)
        model = Aliased(alias)
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        engine = PrivacyEngine()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = engine.make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
                clipping=mode, noise_seed=3)
        assert [st.name for st in engine._steps_of] == ["a", "out"]
        if alias:
            assert model.b is model.a
        for _ in range(3):
            xb, yb = next(iter(loader))
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        assert engine.steps == 3
        released[alias] = [p.detach().clone() for p in (model.a.weight, model.a.bias, model.out.weight, model.out.bias)]
    assert all(torch.equal(a, b) for a, b in zip(released[False], released[True], strict=True))


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("how", ["none", "del"])
def test_a_parameter_removed_from_a_unit_after_make_private_is_named(mode, how):
    """Review 31: a generic unit's parameter set to None (or deleted) after make_private crashed
    zero_grad with an AttributeError deep in the engine. The unit's release is laid out over the
    parameters it had: the error names the unit and the parameter, and nothing moves."""
    torch.manual_seed(0)
    model = nn.Sequential(Custom(4), nn.Linear(4, 3))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
            clipping=mode)
    unit = model[0]
    if how == "none":
        unit._parameters["shift"] = None
    else:
        del unit._parameters["shift"]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"0: shift was removed from this generic unit after make_private"):
        opt.zero_grad()
        xb, yb = next(iter(loader))
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class _Scaled(nn.Module):
    """A unit: a parameter of its own and a child Linear (called or not)."""

    def __init__(self, call_inner=True):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.inner = nn.Linear(4, 4)
        self.call_inner = call_inner

    def forward(self, x):
        h = torch.tanh(x * self.scale)
        return self.inner(h) if self.call_inner else h


class _Holder(nn.Module):
    """A unit holding another module that is also held outside it."""

    def __init__(self, child):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4))
        self.child = child

    def forward(self, x):
        return self.child(x) + self.bias


class Shared(nn.Module):
    """Modules held under several names across generic units' boundaries (review 32)."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        if case == "alias_inside_unit":  # the unit's child under two names: its reparametrisation swapped one slot twice
            self.u = _Scaled()
            self.u.inner2 = self.u.inner
        elif case == "unit_child_called_outside":  # a Linear inside a unit (not called there) called at top level
            self.u = _Scaled(call_inner=False)
            self.top = self.u.inner
        elif case == "two_units_one_child":
            self.c1, self.c2 = _Scaled(), _Scaled()
            self.c2.inner = self.c1.inner
        elif case == "container_of_a_unit_and_its_child":  # their common ancestor has no forward (review 33)
            u = _Scaled()
            self.blocks = nn.ModuleList([u, u.inner])
        elif case == "weights_tied_across_a_list":  # ALBERT-style sharing between blocks of a ModuleList
            self.blocks = nn.ModuleList([_Scaled(), _Scaled()])
            self.blocks[1].inner.weight = self.blocks[0].inner.weight
        else:  # "unit_inside_another_and_outside": a unit held by another unit and at top level
            c = _Scaled()
            self.c_alias = c
            self.u = _Holder(c)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        case = self.case
        if case == "alias_inside_unit":
            h = self.u(x)
        elif case == "unit_child_called_outside":
            h = self.top(self.u(x))
        elif case == "two_units_one_child":
            h = self.c2(self.c1(x))
        elif case == "container_of_a_unit_and_its_child":
            h = self.blocks[0](x)
        elif case == "weights_tied_across_a_list":
            h = self.blocks[1](self.blocks[0](x))
        else:
            h = self.u(x)
        return self.head(torch.tanh(h.mean(1)))


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("case", ["alias_inside_unit", "unit_child_called_outside", "two_units_one_child",
                                  "unit_inside_another_and_outside", "container_of_a_unit_and_its_child",
                                  "weights_tied_across_a_list"])
def test_a_module_held_across_a_units_boundary_trains_exactly(case, mode):
    """Review 32: a unit whose child is held under two names swapped the child's slot twice in its
    reparametrisation and left a detached tensor in place of the optimizer's parameter; a module
    held inside a unit and outside it (or by two units) gave nested or overlapping units. Every step
    was refused and charged. Now the unit swaps each slot once, and such a module's names make their
    common ancestor one unit, or the closest ancestor with a forward of its own where that is a
    container (review 33: a ModuleList made the unit never ran): the release is per-example
    clipping's, against float64 truth from batches of one, and the parameters stay the optimizer's."""
    assert all(type(m).forward is not nn.Module.forward for _, m in registry.generic_units(Shared(case)))
    torch.manual_seed(3)
    model = Shared(case).double()
    x, y = _inputs(5)
    grads = per_example_grads(copy.deepcopy(model), x, y)
    params = list(model.parameters())
    C = 0.5
    bnn.convert_model(model, clipping=mode, max_grad_norm=C)
    truth, scale = clipped_truth(grads, groups_of(model, C if mode == "flat" else None))
    for _ in range(2):  # a second pass runs on what the first forward left in place
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    for n, p in model.named_parameters():
        tol = 1000 * EPS64 * float(scale[n].max())  # as test_release_equals_per_example_clipping
        assert p.grad is not None, n
        assert torch.all((p.grad - truth[n]).abs() <= tol), (n, float((p.grad - truth[n]).abs().max()))


class LayerScale(nn.Module):
    """timm's layer scale (CaiT, DeiT-3, ConvNeXt): a parameter named ``gamma``."""

    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(0.5 + 0.1 * torch.randn(d))

    def forward(self, x):
        return x * self.gamma


class Configured(nn.Module):
    """A module whose own attributes carry the names of a clipped layer's configuration and state."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.clipping, self.max_grad_norm, self.noise_multiplier, self.clip_fn = 2.0, 3.0, 0.5, "tanh"
        self.input_clip = self.grad_clip = self.noise_bound = 1.5
        self.norm_method, self._flat, self._handle, self._nonfinite, self._max_shape = "mine", None, "h", 7, (1,)
        self._step = self._bounds_version = 0
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        self._step += 1  # the module's own counter, assigned in its forward
        act = torch.tanh if self.clip_fn == "tanh" else torch.relu
        return self.norm(act(x * self.weight * self.clipping) * self.max_grad_norm + self.noise_multiplier)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.ls = LayerScale(4)
        self.cfg = Configured()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.cfg(x + self.ls(self.proj(x)))
        return self.head(h.mean(1))


USER_STATE = {"clipping": 2.0, "max_grad_norm": 3.0, "noise_multiplier": 0.5, "clip_fn": "tanh", "input_clip": 1.5,
              "grad_clip": 1.5, "noise_bound": 1.5, "norm_method": "mine", "_flat": None, "_handle": "h",
              "_nonfinite": 7, "_max_shape": (1,), "_bounds_version": 0}


def _make_private(model, mode):
    x, y = torch.randn(16, 5, 4), torch.randint(0, 3, (16,))
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        clipping=mode, noise_seed=3)
    return engine, model, opt, loader


def _train(engine, model, opt, loader):
    """Two steps of the loader's batches; both must land."""
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    assert engine.steps == 2


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_a_unit_keeps_its_own_attributes_under_the_configurations_names(mode):
    """Review 33: a generic unit is the user's module, and the clipping configuration was set on it
    under its public names: a layer scale's parameter ``gamma`` crashed make_private (TypeError), and
    a plain attribute ``clipping``, ``max_grad_norm``, ``_step``, ... was overwritten, so the module's
    forward read ours. The configuration now lives under ``_bp_`` names: the modules keep their own
    attributes, the forward reads them (and assigns its own ``_step``), and the release is per-example
    clipping's against float64 truth from batches of one."""
    torch.manual_seed(3)
    model = Scaled().double()
    x, y = _inputs(5)
    grads = per_example_grads(copy.deepcopy(model), x, y)
    gamma = model.ls.gamma
    C = 0.5
    bnn.convert_model(model, clipping=mode, max_grad_norm=C)
    assert registry.is_generic(model.ls) and registry.is_generic(model.cfg)
    assert model.ls.gamma is gamma and isinstance(model.ls._parameters["gamma"], nn.Parameter)
    assert isinstance(model.cfg.norm, nn.LayerNorm)
    truth, scale = clipped_truth(grads, groups_of(model, C if mode == "flat" else None))
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    assert model.cfg._step == 1  # its own counter: one forward here
    assert {n: getattr(model.cfg, n) for n in USER_STATE} == USER_STATE
    for n, p in model.named_parameters():
        tol = 1000 * EPS64 * float(scale[n].max())  # as test_release_equals_per_example_clipping
        assert p.grad is not None, n
        assert torch.all((p.grad - truth[n]).abs() <= tol), (n, float((p.grad - truth[n]).abs().max()))


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_make_private_trains_a_model_with_layer_scale(mode):
    """The engine's path over the same model: make_private accepts it, two steps land, the modules'
    own attributes are still theirs, and the fixed-after-make_private rule guards our names, not the
    user's (the module may assign its own ``clipping`` after make_private)."""
    torch.manual_seed(0)
    engine, model, opt, loader = _make_private(Scaled(), mode)
    _train(engine, model, opt, loader)
    assert {n: getattr(model.cfg, n) for n in USER_STATE} == USER_STATE
    model.cfg.clipping = 2.0  # the user's attribute: not ours to fix
    with pytest.raises(AttributeError, match="max_grad_norm is fixed by make_private"):
        model.proj.max_grad_norm = 5.0  # a fused layer's public configuration stays fixed
    with pytest.raises(AttributeError, match="max_grad_norm is fixed by make_private"):
        model.cfg._bp_max_grad_norm = 5.0  # and a unit's, under its own name


class HasSensitivity(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.sensitivity = 2.0

    def forward(self, x):
        return x * self.w * self.sensitivity


class DefinesExact(nn.Module):
    exact = True

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.w


@pytest.mark.parametrize("module", [HasSensitivity, DefinesExact])
def test_a_module_that_defines_a_units_public_name_is_refused_by_name(module):
    """The few names a unit adds outside ``_bp_`` (generic.UNIT_NAMES) would shadow the module's own:
    such a module is refused before its class is swapped, naming the attribute."""
    model = nn.Sequential(module(), nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"(sensitivity|exact).*already defines"):
        bnn.convert_model(model, clipping="flat", max_grad_norm=1.0)
    assert type(model[0]) is module


def test_a_unit_adds_only_bp_names_besides_its_public_api():
    """What a unit's class and its configuration add to a user's module: ``_bp_`` names, nn.Module's
    own overrides and generic.UNIT_NAMES only (anything else could shadow a user's attribute)."""
    model = nn.Sequential(Configured(), nn.Linear(4, 3))
    before = set(vars(model[0]))
    bnn.convert_model(model, clipping="flat", max_grad_norm=1.0)
    unit = model[0]
    added = set(vars(unit)) - before
    assert added and all(n.startswith("_bp_") for n in added), sorted(added)
    cls_added = set(dir(type(unit))) - set(dir(Configured))
    assert cls_added and all(n.startswith("_bp_") or n in generic.UNIT_NAMES for n in cls_added), sorted(cls_added)


class CallsChildTwice(nn.Module):
    """A unit whose forward calls its child twice: one unit, one per-example gradient over both uses."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(torch.tanh(self.inner(x) * self.scale))


class Body(nn.Module):
    def __init__(self, body, child_outside=False):
        super().__init__()
        self.body, self.child_outside = body, child_outside
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.body(x)
        if self.child_outside:  # the unit's child called by the parent as well, by its own name
            h = self.body.inner(h)
        return self.head(torch.tanh(h.mean(1)))


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("case", ["unit_calls_its_child_twice", "two_units_one_child"])
def test_a_child_called_twice_inside_its_unit_is_not_reuse(case, mode):
    """Review 33 F2: make_private's reuse rule counted the calls of modules inside a generic unit, so
    a unit calling its child twice (or the whole-model unit of two units sharing a child) was refused
    with "use a separate layer per use", although the unit clips each example's gradient over its
    whole forward. The calls a unit's own forward makes count once now: make_private accepts, two
    steps land, and the release is per-example clipping's against float64 truth from batches of one."""
    make = (lambda: Body(CallsChildTwice())) if case == "unit_calls_its_child_twice" else (lambda: Shared(case))
    torch.manual_seed(3)
    model = make().double()
    x, y = _inputs(5)
    grads = per_example_grads(copy.deepcopy(model), x, y)
    C = 0.5
    bnn.convert_model(model, clipping=mode, max_grad_norm=C)
    truth, scale = clipped_truth(grads, groups_of(model, C if mode == "flat" else None))
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    for n, p in model.named_parameters():
        tol = 1000 * EPS64 * float(scale[n].max())  # as test_release_equals_per_example_clipping
        assert p.grad is not None, n
        assert torch.all((p.grad - truth[n]).abs() <= tol), (n, float((p.grad - truth[n]).abs().max()))
    torch.manual_seed(0)
    _train(*_make_private(make(), mode))


@pytest.mark.parametrize("probe", [True, False])
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_a_units_child_called_from_outside_the_unit_is_still_reuse(mode, probe):
    """What the unit's forward does not cover still counts: its child called by the parent as well
    would get a gradient from outside the unit. make_private refuses it by the reuse rule, before any
    step (the dynamic probes and the one-example probe alike); a step would refuse it, charged."""
    model = Body(CallsChildTwice(), child_outside=True)
    x, y = torch.randn(16, 5, 4), torch.randint(0, 3, (16,))
    engine = PrivacyEngine()
    with pytest.raises(ValueError, match=r"body\.inner.*reached 2 times.*rule: reuse"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0,
                            max_grad_norm=1.0, clipping=mode, probe=probe)
    assert type(model.body) is CallsChildTwice  # refused before anything was changed


class LazyScale(nn.Module):
    """A layer scale made on first use, behind ``hasattr``; its forward also writes names of ours."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        if not hasattr(self, "gamma"):
            self.gamma = 2.0
        self.noise_multiplier = 0.0  # the module's own: not the unit's noise
        self.max_grad_norm = 100.0
        return x * self.w * self.gamma


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_a_unit_reads_and_writes_only_the_modules_own_names(mode):
    """Review 35 F2, F3: routing our public names to the configuration on a unit (where the module
    had none of that name) let the module's own writes set our noise multiplier or bound, and its
    own reads (a lazy ``hasattr`` layer scale) find ours. A unit shows none of our settings under
    public names: the module's forward reads and writes its own, and the release is still the
    per-example clipped sum at the converted bound, noised with the unit's own multiplier."""
    torch.manual_seed(0)
    model = nn.Sequential(LazyScale(), nn.Linear(4, 3)).double()
    ref = copy.deepcopy(model)
    bnn.convert_model(model, clipping=mode, max_grad_norm=0.5)
    unit = model[0]
    for name in ("max_grad_norm", "noise_multiplier", "clipping", "clip_fn", "gamma"):
        assert not hasattr(unit, name), name
    x = torch.randn(6, 4, dtype=torch.float64)
    assert torch.equal(model(x), ref(x))  # the module's own gamma (2.0), made by its own forward
    assert unit.gamma == 2.0 and unit._bp_gamma == 0.01 and unit._bp_noise_multiplier == 0.0
    assert unit.max_grad_norm == 100.0 and unit._bp_max_grad_norm < 100.0
    bnn.set_noise_multiplier(model, 3.0)
    model(x)  # the forward writes its own noise_multiplier = 0 again
    assert unit._bp_noise_multiplier == 3.0
    _, private, _, _ = _make_private(nn.Sequential(LayerScale(4), nn.Linear(4, 3)), mode)
    with pytest.raises(AttributeError, match="noise_multiplier is fixed by make_private"):
        private[0]._bp_noise_multiplier = 0.0
    with pytest.raises(AttributeError, match="noise_multiplier is fixed by make_private"):
        bnn.set_noise_multiplier(private, 0.0)


class OwnSigma(nn.Module):
    """A unit whose module has a noise_multiplier of its own (a plain attribute)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.noise_multiplier = 0.25

    def forward(self, x):
        return x * self.scale


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("unit", [LayerScale, OwnSigma])
def test_training_without_the_engine_noises_a_generic_unit(unit, mode):
    """Review 34 F1: the README's protocol without the engine set each clipped layer's noise
    multiplier by its public name; on a unit that makes a plain attribute of the user's module, and
    the unit released its clipped sum unnoised. bnn.set_noise_multiplier reaches every layer, and
    arm_noise refuses a unit given a noise_multiplier attribute after conversion. The unit's own
    gradient is zero here (zero input), so what it releases is its noise: std σ·C per entry."""
    sigma, C = 100.0, 1.0
    torch.manual_seed(0)
    model = nn.Sequential(unit(4), nn.Linear(4, 3))
    bnn.convert_model(model, clipping=mode, max_grad_norm=C)
    bnn.set_noise_multiplier(model, sigma)
    if unit is OwnSigma:
        assert model[0].noise_multiplier == 0.25  # the module's own attribute is left alone
    bnn.arm_noise(model, bnn.NoiseStream(seed=1))
    x = torch.zeros(8, 4)
    nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long), reduction="sum").backward()
    released = next(p.grad for n, p in model[0].named_parameters())
    # 4 normals of std σ·C_unit (C_unit ≥ C/√2 per layer): all below 10⁻³·σ has probability < 10⁻¹⁰
    assert float(released.abs().max()) > 1e-3 * sigma, released
    with pytest.raises(ValueError, match="noise_multiplier must be finite"):
        bnn.set_noise_multiplier(model, float("nan"))
    if unit is LayerScale:  # the loop over public names made an attribute of the module: refused
        for _, layer in bnn.clipped_layers(model):
            layer.noise_multiplier = sigma
        with pytest.raises(ValueError, match=r"0 is a generic unit.*bnn.set_noise_multiplier"):
            bnn.arm_noise(model)


class TiedPair(nn.Module):
    """No parameter of its own: the common ancestor of a tied pair, one unit."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class TiedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = TiedPair()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.t(self.t(x)).mean(1))


class HookCallsChild(nn.Module):
    """A forward hook of the unit calls its child again: outside the unit's own forward."""

    def __init__(self):
        super().__init__()
        self.u = _Scaled()
        self.head = nn.Linear(4, 3)
        self.u.register_forward_hook(lambda m, args, out: m.inner(out))

    def forward(self, x):
        return self.head(torch.tanh(self.u(x).mean(1)))


@pytest.mark.parametrize("probe", [True, False])
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("make", [TiedTwice, HookCallsChild])
def test_what_a_units_forward_does_not_cover_is_reuse_at_make_private(make, mode, probe):
    """Review 34 F2, F3: a unit holding no parameter itself (the common ancestor of tied weights)
    applied twice, and a unit's child called by the unit's forward hook, were accepted at
    make_private once calls inside a unit counted once, and every step was then refused and
    charged. The unit's own calls are counted whatever it holds, and the counting leaves the unit
    before the loop's forward hooks run: both are refused as reuse before anything changes."""
    model = make()
    x, y = torch.randn(16, 5, 4), torch.randint(0, 3, (16,))
    with pytest.raises(ValueError, match=r"reached 2 times.*rule: reuse"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
                                     noise_multiplier=1.0, max_grad_norm=1.0, clipping=mode, probe=probe)
    assert all(not isinstance(m, bnn._Clipped) for m in model.modules())


@pytest.mark.parametrize("bad", ["name", "dtypes"])
def test_a_module_that_cannot_be_a_unit_is_refused_before_anything_is_converted(bad):
    """Review 34 F4: the refusal came from inside the conversion, after the modules before the unit
    had been swapped in place, so make_private raised on a half-converted model that plain training
    then refused too. Both unit problems (a name the unit would shadow, parameters of several
    dtypes) are reported with the model's other problems, before any change."""
    unit = HasSensitivity() if bad == "name" else _Scaled()
    if bad == "dtypes":
        unit.scale.data = unit.scale.data.double()
    model = nn.Sequential(nn.Linear(4, 4), unit, nn.Linear(4, 3))
    with pytest.raises(ValueError, match="already defines" if bad == "name" else "one vector of one dtype"):
        bnn.convert_model(model, clipping="flat", max_grad_norm=1.0)
    assert all(not isinstance(m, bnn._Clipped) for m in model.modules())
    if bad == "name":
        nn.functional.cross_entropy(model(torch.randn(4, 4)), torch.zeros(4, dtype=torch.long)).backward()


@pytest.mark.parametrize("probe", [True, False])
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_a_global_forward_hook_calling_a_units_child_is_reuse(mode, probe):
    """Review 35 F1: torch's global module forward hooks run before a module's own, so a hook that
    calls a unit's child after the unit's forward was counted as the unit's own call (the count left
    the unit in a forward hook), and make_private accepted a model whose steps were all refused and
    charged. "Inside the unit" is now while the unit's own forward method runs."""
    model = Body(_Scaled())
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: m.inner(out) if isinstance(m, _Scaled) else None)
    try:
        x, y = torch.randn(16, 5, 4), torch.randint(0, 3, (16,))
        with pytest.raises(ValueError, match=r"body\.inner.*reached 2 times.*rule: reuse"):
            PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
                                         noise_multiplier=1.0, max_grad_norm=1.0, clipping=mode, probe=probe)
    finally:
        handle.remove()
    assert "forward" not in vars(model.body)  # the probe's wrapper is gone


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind", ["custom", "lstm"])
def test_a_compiled_model_with_units_trains_exactly_across_batch_sizes(kind, backend):
    """Review 34 P1: a unit's forward traced by dynamo became compiled graphs inside the unit's
    private graph, whose backward the per-example vectorised backward could not run again
    (aot_eager: donated buffers, once a new batch size recompiled; inductor: a BatchedTensor's
    storage at the first step). The unit's forward is never traced now: per_layer under
    torch.compile releases per-example clipping's sum for each Poisson-like batch size, against
    float64 truth from batches of one."""
    torch.manual_seed(3)
    base = Net(kind).double()
    model = copy.deepcopy(base)
    C = 0.5
    bnn.convert_model(model, clipping="per_layer", max_grad_norm=C)
    run = torch.compile(model, backend=backend)
    for seed, B in ((5, 7), (6, 4)):
        x, y = _inputs(seed, B=B)
        grads = per_example_grads(copy.deepcopy(base), x, y)
        truth, scale = clipped_truth(grads, groups_of(model))
        model.zero_grad()
        nn.functional.cross_entropy(run(x), y, reduction="sum").backward()
        for n, p in model.named_parameters():
            tol = 1000 * EPS64 * float(scale[n].max())  # as test_release_equals_per_example_clipping
            assert p.grad is not None, n
            assert torch.all((p.grad - truth[n]).abs() <= tol), (B, n, float((p.grad - truth[n]).abs().max()))


class UsedOutside(nn.Module):
    """A unit whose parameter the parent uses too: by plain code, or by calling the unit's child."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.u = _Scaled()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.u(x)
        if self.how == "functional":  # a tied projection in plain code
            h = nn.functional.linear(h, self.u.inner.weight)
        elif self.how == "child_forward":  # the child's forward called directly: no module call to count
            h = self.u.inner.forward(h)
        elif self.how == "penalty":  # a term of the loss computed in the forward
            h = h + self.u.scale.square().sum()
        return self.head(torch.tanh(h.mean(1)))


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("how", ["functional", "child_forward", "penalty"])
def test_a_units_parameter_used_outside_the_unit_is_refused_at_make_private(how, mode):
    """Review 35 F4: the gradient-ownership probe skipped the units, so a unit's parameter used
    outside the unit's forward passed make_private and every step was then refused (weight-reuse)
    and charged. The dynamic probes now watch every differentiable use of a unit's parameters
    (validate.unit_uses): outside the unit's own forward, it is refused before anything changes."""
    model = UsedOutside(how)
    x, y = torch.randn(16, 5, 4), torch.randint(0, 3, (16,))
    name = {"penalty": r"u\.scale is", "functional": r"u\.inner\.weight is", "child_forward": r"u\.inner\.bias, u\.inner\.weight are"}[how]
    with pytest.raises(ValueError, match=rf"{name} used outside this generic unit's forward"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
                                     noise_multiplier=1.0, max_grad_norm=1.0, clipping=mode)
    assert all(not isinstance(m, bnn._Clipped) for m in model.modules())


class ReadsChildWeight(nn.Module):
    """A parent that reads a unit's weight without a gradient reaching it through that read."""

    def __init__(self, how):
        super().__init__()
        self.how, self.u, self.head = how, _Scaled(), nn.Linear(4, 3)

    def forward(self, x):
        h = self.u(x)
        w = self.u.inner.weight
        if self.how == "type_as":
            h = h.type_as(w)  # its dtype only
        elif self.how == "to":
            h = h.to(w)  # dtype and device only
        elif self.how == "logged_norm":
            self.last_norm = w.norm().item()  # a statistic, not in the loss
        elif self.how == "shape_of_a_view":
            h = h[..., :w.T.shape[0]]
        return self.head(torch.tanh(h.mean(1)))


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("how", ["type_as", "to", "logged_norm", "shape_of_a_view"])
def test_a_read_of_a_units_parameter_that_reaches_no_gradient_is_not_a_use(how, mode):
    """Review 36 F5: the probe took any call with a unit's parameter among its arguments and an
    output requiring a gradient for a use. A use is a call whose own autograd nodes reach the
    parameter and whose output then gets a gradient: these reads are accepted and train."""
    torch.manual_seed(0)
    _train(*_make_private(ReadsChildWeight(how), mode))


class _TwoUnits(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.u, self.head = nn.Linear(4, 4), _Scaled(), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.u(torch.tanh(self.a(x)))).mean(1))


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_make_private_of_a_compiled_model_with_a_unit_trains(mode):
    """Review 36 F3: dynamo traced the probes' torch function mode inside a compiled model, and the
    probe pass died, so make_private(torch.compile(model)) refused a model with a unit. The mode
    steps aside in a traced region; two steps land."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    _train(*_make_private(torch.compile(_TwoUnits(), backend="aot_eager"), mode))


class CheckpointedUnit(nn.Module):
    def __init__(self):
        super().__init__()
        self.u, self.head = _Scaled(), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.u(t)), x, use_reentrant=False)
        return self.head(h.mean(1))


def test_flat_refuses_activation_checkpointing_at_make_private():
    """Review 36 F1: flat clipping cannot train a layer recomputed by activation checkpointing (it
    refuses the recomputation in every backward). Not counting calls inside a backward pass, to
    accept checkpointing, let such a model pass make_private into charged refusals; the reuse count
    keeps counting them, so it is refused before any step."""
    model = CheckpointedUnit()
    x, y = torch.randn(16, 5, 4), torch.randint(0, 3, (16,))
    with pytest.raises(ValueError, match=r"reached 2 times.*rule: reuse"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
                                     noise_multiplier=1.0, max_grad_norm=1.0, clipping="flat")
