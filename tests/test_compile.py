"""``torch.compile`` of a private model, exact and backprop clipping (issue 25; bpclip_fast/compiled.py).

The compiled model must trace without graph breaks, compile at most twice over Poisson batch sizes
(the first size static, then the batch dimension dynamic), release the same gradients as eager for
the same seed and batch, and refuse what eager refuses.

Equality is bit-for-bit, and that is derived, not observed: the loss runs eagerly, the private
layers run the very kernels of the eager path inside opaque ops (the same inputs in the same order),
and everything else the compiled digits net computes — ReLU, max-pool, flatten, and their backward
maps — selects or routes values without rounding. (A max-pool tie can only be among values ReLU
set to 0, whose upstream gradient ReLU's backward sets to 0 wherever it is routed.)

Compilation is slow on small CPU machines: every test uses ``aot_eager`` (AOTAutograd's graphs run
op by op) except one with inductor, the backend whose memory planning the flat book must survive.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine, StepRefused
from bpclip_fast.models import digits_net

dynamo = pytest.importorskip("torch._dynamo")
if not hasattr(torch, "compile"):
    pytest.skip("torch.compile is unavailable", allow_module_level=True)

MODES = ["flat", "per_layer", "backprop"]
STEPS = 4


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _base():
    torch.manual_seed(0)
    return digits_net()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 10, (40,), generator=g)


def _private(base, mode, seed=7):
    model = copy.deepcopy(base)
    X, Y = _data()
    bounds = dict(input_clip=1.0, grad_clip=1.0) if mode == "backprop" else dict(max_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                            data_loader=DataLoader(TensorDataset(X, Y), batch_size=6),
                                            noise_multiplier=1.0, clipping=mode, noise_seed=seed, **bounds)


@pytest.mark.parametrize("mode", MODES)
def test_private_forward_has_no_graph_break(mode):
    model, _, loader = _private(_base(), mode)
    x, _ = next(iter(loader))
    ex = torch._dynamo.explain(model)(x)
    assert ex.graph_break_count == 0, [str(r.reason)[:200] for r in ex.break_reasons]
    assert ex.graph_count == 1


def _run_pair(mode, backend, steps=STEPS):
    """Eager and compiled copies of one private model, same seeds: per step the batch size and
    whether every released gradient is bitwise equal."""
    base = _base()
    me, oe, le = _private(base, mode)
    mc, oc, lc = _private(base, mode)
    cm = torch.compile(mc, backend=backend)
    out = []
    for (xe, ye), (xc, yc) in zip(le, lc):
        if len(out) == steps:
            break
        assert torch.equal(xe, xc)  # same sampler seed: the same batch
        oe.zero_grad()
        F.cross_entropy(me(xe), ye).backward()
        oc.zero_grad()
        F.cross_entropy(cm(xc), yc).backward()
        grads = [(pe.grad, pc.grad) for pe, pc in zip(me.parameters(), mc.parameters())]
        assert all(ge is not None and gc is not None for ge, gc in grads)
        out.append((len(xe), all(torch.equal(ge, gc) for ge, gc in grads)))
        oe.step()
        oc.step()
    return out


@pytest.mark.parametrize("mode", MODES)
def test_compiled_release_equals_eager_and_compiles_at_most_twice(mode):
    runs = _run_pair(mode, "aot_eager")
    sizes = [b for b, _ in runs]
    assert all(eq for _, eq in runs), runs
    # the test means something only if the batch size changed and avoided dynamo's 0/1 specialisation
    assert len(set(sizes)) >= 3 and min(sizes) >= 2, sizes
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_inductor_flat_release_equals_eager():
    """Inductor reuses a buffer once its last reader in the graph has run; the flat book holds each
    layer's input and upstream gradient until the release, so it must hold copies."""
    runs = _run_pair("flat", "inductor", steps=2)
    assert all(eq for _, eq in runs), runs


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_second_batch_before_step_is_refused_compiled(mode, compiled):
    model, opt, loader = _private(_base(), mode)
    cm = torch.compile(model, backend="aot_eager") if compiled else model
    it = iter(loader)
    x, y = next(it)
    opt.zero_grad()
    F.cross_entropy(cm(x), y).backward()
    x, y = next(it)  # a second batch of the same step
    with pytest.raises(StepRefused) as exc:
        F.cross_entropy(cm(x), y).backward()
    assert exc.value.rule == "batches"


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_vit_layers_compile_without_break_and_release_as_eager(mode):
    """LayerNorm, ClassToken, PositionalEmbedding (their per-example gradients instantiated: the tap
    op) next to Linear/Conv2d. aot_eager runs the traced ATen ops one by one with no decomposition,
    the very kernels of the eager backward, so equality is again bitwise. A module with its own
    forward is traced by dynamo as separate frames (the model's pre-hooks, then forward): the engine's
    check is its pre-hook's graph (an op run on every call, ``guards.outside_at_run_time``), under flat
    the collector's op another, so three graphs (two under per_layer) and no break reason."""
    from bpclip_fast.models import vit

    torch.manual_seed(0)
    base = vit(image_size=8, patch=4, dim=16, depth=1, heads=2, mlp_ratio=2)
    model, _, loader = _private(base, mode)
    ex = torch._dynamo.explain(model)(next(iter(loader))[0])
    assert not ex.break_reasons, [str(r.reason)[:200] for r in ex.break_reasons]
    assert ex.graph_count <= (3 if mode == "flat" else 2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    me, oe, le = _private(base, mode)
    mc, oc, lc = _private(base, mode)
    cm = torch.compile(mc, backend="aot_eager")
    sizes = []
    for (xe, ye), (xc, yc) in zip(le, lc):
        if len(sizes) == 3:
            break
        oe.zero_grad()
        F.cross_entropy(me(xe), ye).backward()
        oc.zero_grad()
        F.cross_entropy(cm(xc), yc).backward()
        for pe, pc in zip(me.parameters(), mc.parameters()):
            assert torch.equal(pe.grad, pc.grad)
        sizes.append(len(xe))
        oe.step()
        oc.step()
    assert len(set(sizes)) >= 2
    # at most one recompile per traced frame (the pre-hooks' graphs have no batch dimension)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= (4 if mode == "flat" else 3)


@pytest.mark.parametrize("setting", [dict(aggressive_recomputation=True), dict(activation_memory_budget=0.5)])
def test_recomputing_partitioner_settings_are_refused(setting):
    """Under these settings AOTAutograd's partitioner recomputes ops outside its allowlist in the
    backward (measured: flat's collector and a layer's forward op ran again there), which would
    make a new book and re-read the bounds' version at backward time."""
    from torch._functorch import config as functorch_config

    model, opt, loader = _private(_base(), "flat")
    x, _ = next(iter(loader))
    with functorch_config.patch(**setting):
        cm = torch.compile(model, backend="aot_eager_decomp_partition")
        with pytest.raises(RuntimeError, match=next(iter(setting))):
            cm(x)


def test_flat_layer_missing_the_loss_is_refused_compiled():
    """Eager flat returns no gradient for a layer whose output never reached the loss; a compiled
    backward returns a tensor for every parameter, and zeros would land without a draw: refused."""
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x):
            self.b(x)  # output dropped
            return self.a(x)

    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(20, 4, generator=g), torch.randint(0, 3, (20,), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, 5),
            noise_multiplier=1.0, clipping="flat", max_grad_norm=1.0, noise_seed=1, probe=False)
    cm = torch.compile(model, backend="aot_eager")
    x, y = next(iter(loader))
    with pytest.raises(StepRefused, match="must reach the loss") as exc:
        F.cross_entropy(cm(x), y).backward()
    assert exc.value.rule == "rows"


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_counts_compiled_equal_eager(mode):
    """An example whose input is NaN reaches every layer: the per-layer non-finite counts (which
    ``nonfinite='raise'`` refuses on) must be the same compiled as eager, and its NaN must reach no
    released gradient in either."""
    base = _base()
    runs = []
    for compiled in (False, True):
        model, opt, loader = _private(base, mode)
        cm = torch.compile(model, backend="aot_eager") if compiled else model
        x, y = next(iter(loader))
        x = x.clone()
        x[1] = float("nan")
        opt.zero_grad()
        F.cross_entropy(cm(x), y, reduction="none").nan_to_num(0.0).mean().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        runs.append({n: [int(v) for v in layer._bp_nonfinite] for n, layer in model.named_modules()
                     if hasattr(layer, "_bp_nonfinite")})
    assert runs[0] == runs[1]
    assert any(any(v) for v in runs[0].values())  # the NaN example was counted somewhere


@pytest.mark.parametrize("compiled", [False, True])
def test_flat_second_backward_over_a_retained_graph_is_refused_as_rows(compiled):
    model, opt, loader = _private(_base(), "flat")
    cm = torch.compile(model, backend="aot_eager") if compiled else model
    x, y = next(iter(loader))
    opt.zero_grad()
    loss = F.cross_entropy(cm(x), y)
    loss.backward(retain_graph=True)
    with pytest.raises(StepRefused) as exc:
        loss.backward()
        opt.step()
    assert exc.value.rule == "rows"


@pytest.mark.parametrize("mode", MODES)
def test_a_copied_model_compiles_against_its_own_layers(mode):
    """The compiled ops name layers and flat groups by integer handles copied with their attributes
    (``bpclip_fast.handles``): a deep copy must get its own, or its compiled backward would count the
    copy's non-finite inputs in (and clip with the state of) the original's layers."""
    from bpclip_fast import handles
    from bpclip_fast.nn import convert_model

    bounds = dict(input_clip=1.0, grad_clip=1.0) if mode == "backprop" else dict(max_grad_norm=1.0)
    original = convert_model(_base(), clipping=mode, **bounds)
    clone = copy.deepcopy(original)
    pairs = [(a, b) for a, b in zip(original.modules(), clone.modules()) if hasattr(a, "_bp_nonfinite")]
    assert pairs
    for a, b in pairs:
        assert a._bp_handle != b._bp_handle
        assert handles.lookup(b._bp_handle, torch.nn.Module, "layer") is b
    if mode == "flat":
        assert pairs[0][1]._bp_flat is not pairs[0][0]._bp_flat
        assert handles.lookup(pairs[0][1]._bp_flat.handle, object, "flat clipping") is pairs[0][1]._bp_flat
    x, y = _data()
    x = x[:6].clone()
    x[1] = float("nan")
    F.cross_entropy(torch.compile(clone, backend="aot_eager")(x), y[:6], reduction="none").nan_to_num(0.0).mean().backward()
    assert all(int(a._bp_nonfinite.sum()) == 0 for a, _ in pairs)
    assert any(int(b._bp_nonfinite.sum()) > 0 for _, b in pairs)


def test_handles_differ_between_processes():
    """A handle is a constant of the traced graph, and inductor's on-disk cache keys on the graph, not
    on what the ops' fake kernels read through the handle: two processes must not name different
    models by the same handles. A counter from 1 did, and a cached kernel traced for one flat group
    then ran on another's tokens and corrupted the heap."""
    import subprocess
    import sys

    code = "import bpclip_fast.handles as h\nclass O: pass\no = O()\nprint(h.register(o))"
    first = [int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
             for _ in range(2)]
    assert first[0] != first[1]
    assert all(0 < h < 2 ** 52 for h in first)  # exact as float64, where an origin handle travels


@pytest.mark.parametrize("earlier_pass", [False, True, "cleared", "last_step"])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_autograd_is_refused_when_its_pass_starts(mode, earlier_pass):
    """Compiled autograd runs the layers' backward where the step's records cannot follow: an honest
    step was refused at step() as an edited gradient and charged (review 21, F4). The pass is refused
    when it starts, naming the setting: uncharged when nothing of the step was computed before it,
    charged when an earlier pass left gradients that could have been read, even if they were cleared
    since (else that pass's release would be free: the refusal resets the batch count); nothing
    stays in .grad. Gradients zeroed in place after the last step, which was charged, are not an
    earlier pass of this one (review 24, F1)."""
    model = copy.deepcopy(_base())
    X, Y = _data()
    bounds = dict(input_clip=1.0, grad_clip=1.0) if mode == "backprop" else dict(max_grad_norm=1.0)
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(X, Y), batch_size=6), noise_multiplier=1.0, clipping=mode,
            noise_seed=7, **bounds)
    batches = iter(loader)
    x, y = next(batches)
    charged = earlier_pass in (True, "cleared")
    if earlier_pass == "last_step":  # a whole step, charged; its gradients zeroed in place
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        x, y = next(batches)
    elif earlier_pass:  # a micro-batch first, eagerly
        F.cross_entropy(model(x[:2]), y[:2]).backward()
        x, y = x[2:], y[2:]
        if earlier_pass == "cleared":
            opt.zero_grad(set_to_none=True)
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
        loss = F.cross_entropy(model(x), y)
        with pytest.raises(StepRefused) as exc:
            loss.backward()
    assert "compiled autograd" in str(exc.value)
    assert exc.value.charged == charged
    assert len(engine.accountant) == int(charged) + (earlier_pass == "last_step")
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compiled", [False, True])
def test_a_layer_unfrozen_after_compiling_is_refused_at_the_forward(mode, compiled):
    """A layer frozen at make_private is not clipped; unfrozen after the model was compiled and trained,
    its forward is refused before any raw gradient exists, as eager's (the engine's pre-hook is traced:
    the parameters' ``requires_grad`` it reads are guarded, so the unfreezing recompiles and checks
    again; traced, it compares the parameters by identity, without ``id()``, which dynamo 2.11
    breaks the graph on)."""
    base = _base()
    base[4].requires_grad_(False)
    model, opt, loader = _private(base, mode)
    run = torch.compile(model, backend="aot_eager", dynamic=False) if compiled else model
    batches = iter(loader)
    x, y = next(batches)
    F.cross_entropy(run(x), y).backward()
    opt.step()
    model[4].requires_grad_(True)
    x, y = next(batches)
    with pytest.raises(StepRefused) as exc:
        run(x)  # at the forward: no raw gradient is ever computed
    assert exc.value.rule == "unclipped-param" and "4.weight, 4.bias is trainable but not a clipped" in str(exc.value)
    assert model[4].weight.grad is None and model[4].bias.grad is None


class _Headed(torch.nn.Module):
    """A plain module (not ``nn.Sequential``): a loop's graph break before a head frozen at make_private."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        torch._dynamo.graph_break()  # a print or .item() in the loop's forward
        return self.head(h)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recursive_tags", [False, True])
def test_an_unfrozen_head_is_refused_at_the_compiled_forward_whatever_dynamo_guards(mode, recursive_tags):
    """Review 25, F1: dynamo's recursive dict-tag guards (torch 2.11's default) skip the parameters'
    ``requires_grad`` guards, so a check traced into guards never ran again after ``head`` was unfrozen:
    the head's raw gradient was accumulated, and seen by the loop's post-accumulate hook (an optimizer in
    backward), before the clipped layers' backward refused. The engine's check runs at run time, inside
    the compiled forward, on every call."""
    with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=recursive_tags):
        _unfrozen_head_refused(mode)


def _unfrozen_head_refused(mode):
    torch.manual_seed(0)
    base = _Headed()
    base.head.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(24, 8, generator=g), torch.randint(0, 4, (24,), generator=g)
    bounds = dict(input_clip=1.0, grad_clip=1.0) if mode == "backprop" else dict(max_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = PrivacyEngine().make_private(
            module=base, optimizer=torch.optim.SGD(base.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(X, Y), batch_size=6), noise_multiplier=1.0, clipping=mode,
            noise_seed=7, **bounds)
    run = torch.compile(model, backend="aot_eager", dynamic=False)
    batches = iter(loader)
    x, y = next(batches)
    F.cross_entropy(run(x), y).backward()
    opt.step()
    model.head.requires_grad_(True)
    seen = []
    model.head.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    x, y = next(batches)
    with pytest.raises(StepRefused) as exc:
        run(x)  # at the forward: no raw gradient is ever computed
    assert exc.value.rule == "unclipped-param" and "head.weight, head.bias is trainable" in str(exc.value)
    assert seen == [] and model.head.weight.grad is None


def _fixed_private(mode, base):
    """``base`` private on fixed batches of 6 (no Poisson size changes, so no re-trace for them)."""
    X, Y = _data()
    bounds = dict(input_clip=1.0, grad_clip=1.0) if mode == "backprop" else dict(max_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="zcdp")
        return (engine, *engine.make_private(
            module=base, optimizer=torch.optim.SGD(base.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(X, Y), batch_size=6), noise_multiplier=1.0, clipping=mode,
            noise_seed=7, poisson_sampling=False, **bounds))


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))


def _freeze_then_unfreeze(mode, run=None, steps=6):
    """Steps of a loop that freezes the body before step 2 and unfreezes it before step 4; returns the
    model's parameters after each step (``run``: the compiled model, or the model itself)."""
    engine, model, opt, loader = _fixed_private(mode, _mlp())
    run = model if run is None else run(model)
    inner = model._module if hasattr(model, "_module") else model
    out = []
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        if i in (2, 4):
            inner[1].requires_grad_(i == 4)
        opt.zero_grad()
        F.cross_entropy(run(x), y).backward()
        opt.step()
        out.append([p.detach().clone() for p in inner.parameters()])
    return out


@pytest.mark.parametrize("mode", MODES)
def test_freezing_and_unfreezing_a_clipped_layer_between_compiled_steps_trains_as_eager(mode):
    """Review 28, F1 and F2: with no batch-size change to force a re-trace, torch 2.11 kept the graph
    traced before a layer was frozen (flat: every later step refused, charged) or unfrozen (that layer
    never trained, moved by the fallback noise alone): its dynamo skips the parameters'
    ``requires_grad`` guards (``compiled.require_parameter_guards`` turns that off)."""
    eager = _freeze_then_unfreeze(mode)
    compiled = _freeze_then_unfreeze(mode, lambda m: torch.compile(m, backend="aot_eager"))
    for step, (a, b) in enumerate(zip(eager, compiled)):
        for pa, pb in zip(a, b):
            assert torch.equal(pa, pb), step


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_a_graph_kept_past_a_freeze_or_unfreeze_is_refused_at_the_forward(mode, change):
    """Whatever dynamo guards, a compiled forward runs only with the clipped parameters' ``requires_grad``
    it was traced for (``guards._check_traced_for``, inside the engine's check op): here every guard is
    dropped (``guard_filter_fn``), so the graph traced before the change runs after it. Refused before
    anything is computed, uncharged."""
    engine, model, opt, loader = _fixed_private(mode, _mlp())
    inner = model._module if hasattr(model, "_module") else model
    if change == "unfreeze":
        inner[1].requires_grad_(False)
    run = torch.compile(model, backend="aot_eager", options={"guard_filter_fn": lambda entries: [False] * len(entries)})
    batches = iter(loader)
    x, y = next(batches)
    F.cross_entropy(run(x), y).backward()
    opt.step()
    inner[1].requires_grad_(change == "unfreeze")
    before = [p.detach().clone() for p in inner.parameters()]
    charged = len(engine.accountant)
    opt.zero_grad()
    x, y = next(batches)
    with pytest.raises(RuntimeError, match="frozen or unfrozen after this compiled graph was traced"):
        run(x)
    assert len(engine.accountant) == charged
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(inner.parameters(), before))


def test_require_parameter_guards_turns_the_skip_off_before_torch_2_14(monkeypatch):
    from bpclip_fast import compiled

    with torch._dynamo.config.patch(skip_tensor_guards_with_matching_dict_tags=True):
        monkeypatch.setattr(torch, "__version__", "2.14.1")
        compiled.require_parameter_guards()
        assert torch._dynamo.config.skip_tensor_guards_with_matching_dict_tags
        monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
        with pytest.warns(UserWarning, match="skip_tensor_guards_with_matching_dict_tags = False"):
            compiled.require_parameter_guards()
        assert not torch._dynamo.config.skip_tensor_guards_with_matching_dict_tags


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("effectful", [True, False])
def test_the_outside_check_runs_at_every_grad_enabled_compiled_forward(mode, backend, effectful, monkeypatch):
    """The engine's check is an op of the compiled forward that runs on every grad-enabled call, not a
    guard evaluated once (review 25, F1): kept by AOTAutograd and inductor (an ordered effect, though it
    returns nothing), and absent from a ``no_grad`` graph, as eager checks nothing there. A torch
    without effectful ops breaks the graph there and checks eagerly."""
    from bpclip_fast.engine import guards

    calls = []
    real = guards._check_outside
    monkeypatch.setattr(guards, "_EFFECTFUL", effectful)
    monkeypatch.setattr(guards, "_check_outside_eagerly",
                        torch._dynamo.disable(lambda engine, traced_for: counted(engine)))

    def counted(engine):  # the forward's checks (each backward pass checks too, check_new_pass)
        if torch._C._current_graph_task_id() == -1:
            calls.append(engine)
        return real(engine)

    monkeypatch.setattr(guards, "_check_outside", counted)
    model, opt, loader = _private(_base(), mode)
    run = torch.compile(model, backend=backend)
    for i, (x, y) in enumerate(loader):
        if i == 4:
            break
        F.cross_entropy(run(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert len(calls) == 4
    with torch.no_grad():
        run(x)
    assert len(calls) == 4


@pytest.mark.parametrize("mode", MODES)
def test_a_compiled_training_step_trains_as_eager(mode):
    """``torch.compile`` of the whole step (``zero_grad``, forward, loss, ``backward()``, ``step()`` in one
    function, review 26): dynamo breaks the graph at ``backward()`` and traced every Python frame the
    engine then ran, the step boundary's gradient hooks among them, where a weak reference's target
    compared as another tensor: every honest step was refused as ``weight-reuse`` and charged. The
    hooks, the layers' backward and the private optimizer's ``step``/``zero_grad`` run untraced."""
    base = _base()
    me, oe, le = _private(base, mode)
    mc, oc, lc = _private(base, mode)

    def train_step(model, opt, x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    compiled_step = torch.compile(train_step, backend="aot_eager")
    for i, ((xe, ye), (xc, yc)) in enumerate(zip(le, lc)):
        if i == 3:
            break
        train_step(me, oe, xe, ye)
        compiled_step(mc, oc, xc, yc)
    for pe, pc in zip(me.parameters(), mc.parameters()):
        assert torch.equal(pe, pc)


class _Plain(torch.nn.Module):
    """The digits shape through a module with its own forward (its attributes traced, not a Sequential's)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 16), torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_true_releases_as_eager(mode):
    """``dynamic=True`` makes the integer handles the compiled ops name layers and flat groups by
    symbolic: flat's collector failed to compile ("unhashable type: non-nested SymInt", review 26).
    A handle is read as an int (a guard on its value) wherever it is looked up."""
    torch.manual_seed(0)
    base = _Plain()
    me, oe, le = _private(base, mode)
    mc, oc, lc = _private(base, mode)
    cm = torch.compile(mc, backend="aot_eager", dynamic=True)
    for i, ((xe, ye), (xc, yc)) in enumerate(zip(le, lc)):
        if i == 3:
            break
        for model, opt, x, y in ((me, oe, xe, ye), (cm, oc, xc, yc)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
        for pe, pc in zip(me.parameters(), mc.parameters()):
            assert torch.equal(pe.grad, pc.grad)
        oe.step()
        oc.step()
