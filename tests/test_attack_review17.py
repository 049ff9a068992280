"""Review 17: attacks on the AccumulateGrad pre-hook refusal (0454af5) and on every other place where
code can run between a clipped layer's backward output and its accumulation into ``.grad`` (or right
after it). Each test states what it probes; the honest loops at the end must go through."""

from __future__ import annotations

import collections
import copy
import pickle
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bpclip_fast import StepRefused
from test_accumulate_prehook import (MODES, _accumulate_node, _backward, _inner, _may_refuse, _private, _refused,
                                     _refused_and_charged)


def _feeding_node(out, acc):
    """The node of ``out``'s graph whose backward hands ``acc`` (an AccumulateGrad node) its input,
    and the index of that input: our layer's Function, or the flat collector."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is acc:
                return node, k
            todo.append(nxt)
    raise AssertionError("no node feeds the accumulate node")


def _step_released(engine, opt):
    opt.step()
    assert len(engine.accountant) == 1


# ------------------------------------------------------------------ hooks that rewrite the gradient
def _add_1000_in_place(k):
    def add(grad_inputs, grad_outputs):
        grad_inputs[k].add_(1000.0)
    return add


def _add_1000_replacing(k):
    def add(grad_inputs, grad_outputs):
        return tuple(g + 1000.0 if j == k else g for j, g in enumerate(grad_inputs))
    return add


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hook", [_add_1000_replacing, _add_1000_in_place], ids=["replacing", "in_place"])
def test_a_post_hook_on_the_feeding_node_rewriting_the_weight_gradient_is_refused(mode, hook):
    """``grad_fn.register_hook`` on our Function (or the flat collector): its return value replaces
    what the node hands the AccumulateGrad node, or it edits that tensor in place."""
    engine, model, opt, loader = _private(mode)
    w = _inner(model)[2].weight
    x, y = next(iter(loader))
    out = model(x)
    node, k = _feeding_node(out, _accumulate_node(w))
    node.register_hook(hook(k))
    opt.zero_grad()
    _may_refuse(lambda: F.cross_entropy(out, y).backward())
    _refused(model, opt, ("weight-reuse", "grad-edit"))


@pytest.mark.parametrize("mode", MODES)
def test_a_post_hook_on_the_accumulate_node_editing_grad_is_refused(mode):
    """``AccumulateGrad.register_hook``: runs after the accumulation and after the engine's record."""
    engine, model, opt, loader = _private(mode)
    w = _inner(model)[2].weight

    def edit(gi, go):
        w.grad.add_(1000.0)

    _accumulate_node(w).register_hook(edit)
    _backward(model, loader)
    _refused_and_charged(engine, model, opt)


@pytest.mark.parametrize("mode", MODES)
def test_a_post_hook_on_the_accumulate_node_replacing_grad_is_refused(mode):
    engine, model, opt, loader = _private(mode)
    w = _inner(model)[2].weight

    def swap(gi, go):
        w.grad = w.grad + 1000.0

    _accumulate_node(w).register_hook(swap)
    _backward(model, loader)
    _refused_and_charged(engine, model, opt)


@pytest.mark.parametrize("mode", MODES)
def test_a_prehook_reached_through_the_output_graph_is_the_same_node_and_refused(mode):
    """The AccumulateGrad node found through the layer output's ``next_functions`` chain is the node
    the engine holds (one dict), not a second one."""
    engine, model, opt, loader = _private(mode)
    w = _inner(model)[2].weight
    x, y = next(iter(loader))
    out = model(x)
    node, k = _feeding_node(out, _accumulate_node(w))
    node.next_functions[k][0].register_prehook(lambda grads: (grads[0] + 1000.0,))
    _may_refuse(lambda: F.cross_entropy(out, y).backward())
    _refused_and_charged(engine, model, opt)


@pytest.mark.parametrize("mode", MODES)
def test_a_multi_grad_hook_on_clipped_parameters_is_refused(mode):
    engine, model, opt, loader = _private(mode)
    layer = _inner(model)[2]
    torch.autograd.graph.register_multi_grad_hook((layer.weight, layer.bias), lambda grads: None)
    _backward(model, loader)
    _refused_and_charged(engine, model, opt)


@pytest.mark.parametrize("mode", MODES)
def test_a_prehook_registered_mid_backward_by_another_hook_is_refused(mode):
    """An activation hook (it runs before the layer's backward) adds the pre-hook during the backward,
    and the loop removes it before step()."""
    engine, model, opt, loader = _private(mode)
    w = _inner(model)[2].weight
    handles = []
    x, y = next(iter(loader))
    out = model(x)

    def plant(g):
        with torch.enable_grad():  # grad mode is off inside a backward: view_as has no grad_fn there
            handles.append(_accumulate_node(w).register_prehook(lambda gr: (gr[0] + 1000.0,)))

    out.register_hook(plant)
    _may_refuse(lambda: F.cross_entropy(out, y).backward())
    assert handles
    for h in handles:
        h.remove()
    _refused_and_charged(engine, model, opt)


@pytest.mark.parametrize("mode", MODES)
def test_a_prehook_in_the_second_micro_batch_is_refused(mode):
    engine, model, opt, loader = _private(mode)
    w = _inner(model)[2].weight
    x, y = next(iter(loader))
    with opt.accumulate():
        F.cross_entropy(model(x[:4]), y[:4]).backward()
        h = _accumulate_node(w).register_prehook(lambda gr: (gr[0] + 1000.0,))
        _may_refuse(lambda: F.cross_entropy(model(x[4:]), y[4:]).backward())
    h.remove()
    _refused_and_charged(engine, model, opt)


@pytest.mark.parametrize("mode", MODES)
def test_a_prehook_survives_freezing_and_unfreezing_between_steps(mode):
    """install_hooks runs again (unfrozen since the last step): the node is the same while the loop
    holds it, its pre-hook dict is read afresh, and the foreign pre-hook on it is seen. (Frozen and
    unfrozen within one step, the layer's row count refuses the step anyway.)"""
    engine, model, opt, loader = _private(mode)
    layer = _inner(model)[2]
    node = _accumulate_node(layer.weight)
    layer.requires_grad_(False)
    _backward(model, loader)
    opt.step()
    layer.requires_grad_(True)
    node.register_prehook(lambda gr: (gr[0] + 1000.0,))
    opt.zero_grad()
    _backward(model, loader)
    assert node is _accumulate_node(layer.weight)
    # re-installed after it, ours runs second and sees another tensor (weight-reuse) unless the dict is seen first
    _refused(model, opt, ("grad-edit", "weight-reuse"))


@pytest.mark.parametrize("mode", MODES)
def test_a_prehook_on_a_converted_models_new_node_is_refused(mode):
    """model.double() after make_private: a new node, which the engine never hooked ('converted')."""
    engine, model, opt, loader = _private(mode)
    model.double()
    w = _inner(model)[2].weight
    _accumulate_node(w).register_prehook(lambda gr: (gr[0] + 1000.0,))
    x, y = next(iter(loader))
    with pytest.raises(StepRefused) as exc:
        F.cross_entropy(model(x.double()), y).backward()
        opt.step()
    assert exc.value.rule in ("converted", "grad-edit", "weight-reuse"), exc.value


def test_a_prehook_under_torch_compile_is_refused():
    """The inductor-compiled private model accumulates into the same (engine-held) node."""
    engine, model, opt, loader = _private("per_layer")
    compiled = torch.compile(model)
    w = _inner(model)[2].weight
    _backward(compiled, loader)
    opt.step()
    _accumulate_node(w).register_prehook(lambda gr: (gr[0] + 1000.0,))
    opt.zero_grad()
    _backward(compiled, loader)
    assert _refused(model, opt).rule == "grad-edit"
    assert len(engine.accountant) == 2


# ------------------------------------------------------------------ the private _register_hook_dict
def test_register_hook_dict_on_the_accumulate_node_never_runs():
    """``node._register_hook_dict(t)`` (private) adds ``t._backward_hooks`` as a *tensor* pre-hook of
    the node; an AccumulateGrad node reads its tensor pre-hooks from its variable, so the added hook
    is never called: no second dict the engine would have to watch."""
    p = nn.Parameter(torch.randn(3))
    node = _accumulate_node(p)
    calls = []
    carrier = torch.zeros(1, requires_grad=True)
    carrier._backward_hooks = collections.OrderedDict({10 ** 9: lambda g: calls.append(1) or g + 1000.0})
    node._register_hook_dict(carrier)
    (p * 2).sum().backward()
    assert calls == [] and torch.equal(p.grad, torch.full((3,), 2.0))
    y = p * 2  # the control: on another node the same carrier runs (it rewrites that node's input)
    y.grad_fn._register_hook_dict(carrier)
    p.grad = None
    y.sum().backward()
    assert calls == [1] and torch.equal(p.grad, torch.full((3,), 2002.0))


# ------------------------------------------------------------------ saved tensor hooks
def test_saved_tensor_hooks_cannot_scale_a_backprop_layers_clipped_input():
    """``saved_tensors_hooks`` whose unpack returns another tensor than the pack got (a lossy
    activation-compression hook, or a malicious one): backprop mode rebuilds the clipped input from
    the saved ``x`` and factor (csrc/layers.cpp, clipped_pair), so one example's weight gradient is
    bounded only if the backward's x is the forward's. Either the step is refused, or two releases of
    the batch (the same draw: same seed, same step) differ by at most 2Δ per example."""
    engine, model, opt, loader = _private("backprop")
    layer = _inner(model)[0]
    x, y = next(iter(loader))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t * 1000.0 if t.dim() == 2 else t):
        out = model(x)
    F.cross_entropy(out, y, reduction="sum").backward()
    g = torch.cat([layer.weight.grad.reshape(-1), layer.bias.grad.reshape(-1)]).double()
    try:
        opt.step()
    except StepRefused:
        return
    engine2, model2, opt2, loader2 = _private("backprop")
    next(iter(loader2))
    F.cross_entropy(model2(x), y, reduction="sum").backward()
    layer2 = _inner(model2)[0]
    g2 = torch.cat([layer2.weight.grad.reshape(-1), layer2.bias.grad.reshape(-1)]).double()
    delta = float(layer.sensitivity)  # the noise is the same draw: the difference is the two records'
    assert (g - g2).norm() <= 2 * len(x) * delta * (1 + 1e-4), ((g - g2).norm(), delta)  # fp32: ~1e-6 relative


# ------------------------------------------------------------------ honest loops still go through
@pytest.mark.parametrize("mode", MODES)
def test_module_full_backward_hooks_that_change_nothing_go_through(mode):
    engine, model, opt, loader = _private(mode)
    layer = _inner(model)[2]
    layer.register_full_backward_pre_hook(lambda m, go: None)
    layer.register_full_backward_hook(lambda m, gi, go: None)
    _backward(model, loader)
    _step_released(engine, opt)


@pytest.mark.parametrize("mode", MODES)
def test_two_engines_deepcopies_and_ema_copies_go_through(mode):
    engine, model, opt, loader = _private(mode)
    engine2, model2, opt2, loader2 = _private(mode)
    ema = copy.deepcopy(_inner(model))
    buf = io.BytesIO()
    torch.save(_inner(model).state_dict(), buf)
    for m, o, l in ((model, opt, loader), (model2, opt2, loader2)):
        o.zero_grad(set_to_none=False)
        _backward(m, l)
    for e, o in ((engine, opt), (engine2, opt2)):
        _step_released(e, o)
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), _inner(model).parameters()):
            pe.mul_(0.9).add_(p, alpha=0.1)
    buf.seek(0)
    _inner(model2).load_state_dict(torch.load(buf))
    for m, o, l, e in ((model, opt, loader, engine), (model2, opt2, loader2, engine2)):
        o.zero_grad(set_to_none=False)
        _backward(m, l)
        o.step()
        assert len(e.accountant) == 2
