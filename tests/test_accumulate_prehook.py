"""A pre-hook on a clipped parameter's ``AccumulateGrad`` node (``p.view_as(p).grad_fn.next_functions[0][0]
.register_prehook(fn)``, public autograd API) runs after the engine's own pre-hook and before the
accumulation: it can replace or edit in place what is accumulated, and the engine's post-accumulate
record then took the result as the layer's own. Found in the ninth session: a hook adding 1000 to a
layer's weight gradient was released by every mode. Such a hook is refused (``grad-edit``) like a
tensor or post-accumulate hook, also when it is removed before ``step()``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine, StepRefused

MODES = ["flat", "per_layer", "backprop"]


_CAUGHT: list = []  # a refusal raised inside a pass (_may_refuse), for _refused


def _may_refuse(run):
    """Runs a backward pass. Since review 50 F1 a foreign hook, or a gradient that is not the layer's own
    output, is refused at the accumulation, before it reaches ``.grad``; the refusal is kept for
    :func:`_refused` (which otherwise expects it from ``step()``)."""
    try:
        run()
    except StepRefused as exc:
        _CAUGHT.append(exc)


def _private(mode, model=None, fixed=False):
    """``fixed``: batches of exactly 8 (shuffled, no Poisson sampling; the zCDP accountant's case)."""
    _CAUGHT.clear()
    torch.manual_seed(0)
    model = model if model is not None else nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))
    bounds = dict(input_clip=1.0, grad_clip=1.0) if mode == "backprop" else dict(max_grad_norm=1.0)
    engine = PrivacyEngine(accountant="zcdp") if fixed else PrivacyEngine()
    sampling = dict(poisson_sampling=False) if fixed else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, 8),
            noise_multiplier=1.0, clipping=mode, noise_seed=1, probe=False, **bounds, **sampling)
    return engine, model, opt, loader


def _inner(model):
    return model._module if hasattr(model, "_module") else model


def _accumulate_node(p):
    return p.view_as(p).grad_fn.next_functions[0][0]


def _add_1000(grads):
    return (grads[0] + 1000.0,)


def _backward(model, loader):
    x, y = next(iter(loader))
    _may_refuse(lambda: F.cross_entropy(model(x), y).backward())


def _refused(model, opt, rules=("grad-edit",)):
    """The step is refused by one of ``rules`` (in a pass, or by ``step()``) and leaves no gradient;
    returns the refusal."""
    if _CAUGHT:
        exc = _CAUGHT.pop()
    else:
        with pytest.raises(StepRefused) as info:
            opt.step()
        exc = info.value
    assert exc.rule in rules, exc
    assert all(p.grad is None for p in model.parameters())
    return exc


def _refused_and_charged(engine, model, opt):
    assert _refused(model, opt).charged and len(engine.accountant) == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_prehook_on_the_accumulate_node_that_rewrites_the_gradient_is_refused(mode):
    engine, model, opt, loader = _private(mode)
    _accumulate_node(_inner(model)[2].weight).register_prehook(_add_1000)
    _backward(model, loader)
    _refused_and_charged(engine, model, opt)


@pytest.mark.parametrize("mode", MODES)
def test_a_prehook_editing_the_gradient_in_place_is_refused(mode):
    """Returning None after an in-place edit of the layer's own output tensor: the engine's pre-hook
    had already seen that tensor unmodified."""
    engine, model, opt, loader = _private(mode)

    def scale(grads):
        grads[0].mul_(10)

    _accumulate_node(_inner(model)[0].bias).register_prehook(scale)
    _backward(model, loader)
    _refused_and_charged(engine, model, opt)


@pytest.mark.parametrize("mode", MODES)
def test_a_prehook_removed_before_step_is_still_refused(mode):
    engine, model, opt, loader = _private(mode)
    handle = _accumulate_node(_inner(model)[2].weight).register_prehook(_add_1000)
    _backward(model, loader)
    handle.remove()
    _refused_and_charged(engine, model, opt)


@pytest.mark.parametrize("mode", MODES)
def test_a_prehook_registered_before_make_private_is_refused(mode):
    """Registered first on a node the loop keeps alive (autograd frees an unreferenced AccumulateGrad
    node, hooks and all, and makes a new one), it runs before the engine's pre-hook, which sees a
    tensor that is not the layer's output: refused either way (grad-edit or weight-reuse)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    node = _accumulate_node(model[2].weight)
    node.register_prehook(_add_1000)
    engine, model, opt, loader = _private(mode, model)
    _backward(model, loader)
    _refused(model, opt, ("grad-edit", "weight-reuse"))
    assert node is _accumulate_node(_inner(model)[2].weight)  # the hooked node is the one that accumulated


@pytest.mark.parametrize("mode", MODES)
def test_without_a_foreign_prehook_the_step_goes_through(mode):
    """The engine's own pre-hooks are not foreign: the same loop without the hook releases."""
    engine, model, opt, loader = _private(mode)
    _backward(model, loader)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert len(engine.accountant) == 1
