"""Backpropagation clipping's layers save past the loop's ``saved_tensors_hooks`` (review 17): their
backward rebuilds the clipped input from the saved ``x`` and the forward's factor, and the bound holds
only for the ``x`` the factor came from (``autograd._apply_without_hooks``). The loop's hooks are set
aside for those layers alone and restored, level by level, whatever happens; every other op of the
model still goes through them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bpclip_fast.autograd as bautograd
import bpclip_fast.nn as bnn


def _model():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return bnn.convert_model(plain, input_clip=1.0, grad_clip=1.0)


def _stack():
    """The hook stack as (pack, unpack) pairs, top first, left as found."""
    out = bautograd._pop_saved_tensor_hooks()
    bautograd._push_saved_tensor_hooks(out)
    return out


def test_the_loops_hooks_pack_the_other_ops_not_the_clipped_layers_and_are_restored_in_order():
    model = _model()
    x = torch.randn(4, 6, requires_grad=True)
    packed = []

    def outer_pack(t):
        packed.append(("outer", t))
        return t

    def inner_pack(t):
        packed.append(("inner", t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(outer_pack, lambda t: t):
        with torch.autograd.graph.saved_tensors_hooks(inner_pack, lambda t: t):
            before = _stack()
            out = model(x)
            assert _stack() == before and len(before) == 2 and before[0][0] is inner_pack
    assert _stack() == []
    # One pack: tanh's output, by the innermost hook. The two layers' four saved tensors each
    # (x, factor, norm, weight) met no hook; tanh's output is also the second layer's saved x, which
    # that layer holds unpacked.
    assert [level for level, _ in packed] == ["inner"]
    out.sum().backward()
    assert all(m.weight.grad is not None for m in model.modules() if isinstance(m, bnn.Linear))


def test_the_hooks_are_restored_when_the_layer_raises(monkeypatch):
    model = _model()

    def fail(*args):
        raise RuntimeError("planted")

    monkeypatch.setattr(bautograd._ClippedLinear, "apply", fail)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        before = _stack()
        with pytest.raises(RuntimeError, match="planted"):
            model(torch.randn(2, 6))
        assert _stack() == before and len(before) == 1


def test_an_unpack_hook_cannot_change_what_the_backward_clips():
    """Every unpack scaled by 1000: the clipped layers' gradients are those without the hooks,
    bit for bit (their saved tensors never met the hooks; the upstream gradients through tanh did,
    and are clipped)."""
    x = torch.randn(4, 6)

    def grads(hooked):
        model = _model()
        ctx = (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t * 1000.0) if hooked
               else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        with ctx:
            out = model(x)
        out[:, 0].sum().backward()  # the last layer's upstream gradient needs no saved tensor
        return model[2].weight.grad.clone()

    assert torch.equal(grads(True), grads(False))


def test_a_compiled_backprop_model_inside_saved_tensor_hooks_is_refused_before_anything_is_saved():
    """Compiled, the graph's own Function saves the layer's input through the hooks, out of the
    layers' reach: an unpack scaling it moved the release 200× (review 17). The forward refuses."""
    import warnings

    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from bpclip_fast import PrivacyEngine

    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, 8),
                noise_multiplier=1.0, clipping="backprop", noise_seed=1, probe=False, input_clip=1.0, grad_clip=1.0)
        compiled = torch.compile(model)
        x, y = next(iter(loader))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t * 1000.0):
            with pytest.raises(RuntimeError, match="cannot run inside torch.autograd.graph.saved_tensors_hooks"):
                compiled(x)
        opt.zero_grad()
        F.cross_entropy(compiled(x), y).backward()  # outside the hooks: the same compiled model trains
        opt.step()
    finally:
        torch._dynamo.reset()
