"""Review 18: attacks on review 17's fix, backprop layers saving past the loop's ``saved_tensors_hooks``
(``autograd._apply_without_hooks``) and the compiled refusal (``compiled_backprop.backprop_forward``).

Probed: the stack is restored by identity and order at every nesting; hooks pushed from module hooks;
hooks pushed *inside* the layer's Function by a tensor subclass's ``__torch_function__``; activation
checkpointing (both flavours) and ``save_on_cpu`` give the release without them; the exact modes
(LayerNorm's tap and the generic path included) stay within ``2BC`` of the honest release under a
scaling or a stateful unpack; a compiled backprop forward inside hooks raises before anything is
charged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from bpclip_fast import StepRefused
from test_accumulate_prehook import _inner, _private
from test_saved_tensor_hooks import _model, _stack


def _release(model):
    return torch.cat([p.grad.reshape(-1) for p in _inner(model).parameters() if p.grad is not None]).double()


# ------------------------------------------------------------------ the stack, restored exactly
def test_three_levels_are_restored_by_identity_and_hooks_pushed_by_module_hooks_are_left_to_them():
    model = _model()
    levels = [(lambda t: t, lambda t: t) for _ in range(3)]
    extra = (lambda t: t, lambda t: t)
    seen = {}

    def pre(mod, args):  # runs before the layer's Function, outside _apply_without_hooks
        seen["pre"] = _stack()
        torch._C._autograd._push_saved_tensors_default_hooks(*extra)

    def post(mod, args, out):
        seen["post"] = _stack()
        torch._C._autograd._pop_saved_tensors_default_hooks()

    model[0].register_forward_pre_hook(pre)
    model[0].register_forward_hook(post)
    with torch.autograd.graph.saved_tensors_hooks(*levels[0]):
        with torch.autograd.graph.saved_tensors_hooks(*levels[1]):
            with torch.autograd.graph.saved_tensors_hooks(*levels[2]):
                out = model(torch.randn(3, 6, requires_grad=True))
                after = _stack()
    want = list(reversed(levels))
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(seen["pre"], want)) and len(seen["pre"]) == 3
    assert seen["post"][0][0] is extra[0] and seen["post"][0][1] is extra[1] and len(seen["post"]) == 4
    assert len(after) == 3 and all(a[0] is b[0] and a[1] is b[1] for a, b in zip(after, want))
    assert _stack() == []
    out.sum().backward()


class _Pushing(torch.Tensor):
    """An input whose ``__torch_function__`` pushes a scaling hook when the layer's own op runs and
    leaves it on the stack: inside ``_ClippedLinear.forward``, after ``_apply_without_hooks`` emptied
    the stack and before ``save_for_backward``."""

    pushed = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if "bpclip_fast" in str(func) and "forward" in str(func) and not cls.pushed:
            hooks = (lambda t: t, lambda t: t * 1000.0 if t.dim() == 2 else t)
            cls.pushed.append(hooks)
            torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_hook_pushed_inside_the_layers_function_never_packs_its_saves():
    """A hook left on the stack by code running inside the Function (a subclass's
    ``__torch_function__`` on the extension op) packs the saved ``x``: its unpack then scaled the
    clipped input (review 17's attack from inside). Refused, and the stack left as found."""
    model = _model()
    x = torch.randn(4, 6).as_subclass(_Pushing)
    _Pushing.pushed.clear()
    try:
        with pytest.raises(RuntimeError,
                           match="saved_tensors_hooks were entered inside a backpropagation-clipping layer"):
            out = model(x)
            out.as_subclass(torch.Tensor)[:, 0].sum().backward()
        assert _Pushing.pushed, "the probe never ran inside the Function"
    finally:
        while _stack():
            torch._C._autograd._pop_saved_tensors_default_hooks()
    assert _stack() == []


# ------------------------------------------------------------------ checkpointing and save_on_cpu
class _Ckpt(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.how = how

    def forward(self, x):
        if self.how is None or not torch.is_grad_enabled():
            return self.head(self.body(x))
        if self.how == "cpu":
            with torch.autograd.graph.save_on_cpu():
                return self.head(self.body(x))
        return self.head(checkpoint(self.body, x, use_reentrant=self.how == "reentrant"))


def _one_step_release(mode, how):
    torch.manual_seed(0)
    model = _Ckpt(how)
    engine, model, opt, loader = _private(mode, model)
    x, y = next(iter(loader))
    if how == "reentrant":
        x = x.requires_grad_()  # reentrant checkpointing needs an input that requires grad
    F.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()  # released, charged
    assert len(engine.accountant) == 1
    return _release(model)


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "cpu"])
@pytest.mark.parametrize("mode", ["backprop", "flat", "per_layer"])
def test_checkpointing_and_save_on_cpu_release_what_the_plain_forward_releases(mode, how):
    """The same draw, the same batch: the forward recomputed (checkpointing) or offloaded
    (``save_on_cpu``) gives the same values, so the release is the plain one up to the fp32 rounding
    of a recomputation in another order (none here: the same ops on the same values)."""
    if mode == "flat" and how != "cpu":  # flat needs every layer's norm in the model's own call
        with pytest.raises(RuntimeError, match="recomputed by activation checkpointing"):
            _one_step_release(mode, how)
        return
    got = _one_step_release(mode, how)
    want = _one_step_release(mode, None)
    assert torch.equal(got, want), (got - want).abs().max()


# ------------------------------------------------------------------ exact modes under altering unpacks
class _Mixed(nn.Module):
    """A fused Linear, a LayerNorm (the _Tap's saved statistics) and a generic unit (a module of ours
    with a parameter and no registered layer: its inner graph saves through the hooks)."""

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))

        def forward(self, x):
            return torch.tanh(x * self.w) * self.w

    def __init__(self):
        super().__init__()
        self.a, self.ln, self.s, self.b = nn.Linear(6, 8), nn.LayerNorm(8), self.Scale(), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(self.s(self.ln(self.a(x))))


def _scaling(t):
    return t * 1000.0 if t.is_floating_point() else t


class _Stateful:
    """Returns what it packed on the first unpack of each tensor and 1000× after: a norm taken from
    one unpack and a gradient from another would disagree."""

    def __init__(self):
        self.seen = set()

    def __call__(self, t):
        key = id(t)
        if key in self.seen and t.is_floating_point():
            return t * 1000.0
        self.seen.add(key)
        return t


@pytest.mark.parametrize("unpack", ["scaling", "stateful"])
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_exact_modes_stay_within_2BC_of_the_honest_release_under_an_altering_unpack(mode, unpack):
    """Each example's clipped contribution is ≤ C whatever the backward unpacked, so two releases of one
    batch with the same draw differ by at most 2·B·C (flat: the whole model's; per_layer: each layer's
    C, the sum over layers bounded by 2·B·√L·C in the union — checked per parameter group here)."""
    def run(hook):
        torch.manual_seed(0)
        engine, model, opt, loader = _private(mode, _Mixed())
        x, y = next(iter(loader))
        if hook is None:
            out = model(x)
        else:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, hook):
                out = model(x)
        F.cross_entropy(out, y, reduction="sum").backward()
        try:
            opt.step()
        except StepRefused:
            return None, len(x), engine
        return [p.grad.detach().double().clone() for p in _inner(model).parameters()], len(x), engine

    got, B, engine = run(_scaling if unpack == "scaling" else _Stateful())
    if got is None:
        return
    want, _, _ = run(None)
    C = 1.0
    diff = torch.cat([(a - b).reshape(-1) for a, b in zip(got, want)])
    if mode == "flat":
        assert diff.norm() <= 2 * B * C * (1 + 1e-4), diff.norm()
    else:
        L = 4  # a, ln, s, b: each its own C
        assert diff.norm() <= 2 * B * C * L ** 0.5 * (1 + 1e-4), diff.norm()


# ------------------------------------------------------------------ compiled
def test_a_compiled_backprop_forward_inside_hooks_raises_before_anything_is_charged():
    torch._dynamo.reset()
    try:
        engine, model, opt, loader = _private("backprop")
        compiled = torch.compile(model)
        x, y = next(iter(loader))
        opt.zero_grad()
        with torch.autograd.graph.save_on_cpu():
            with pytest.raises(RuntimeError,
                               match=r"cannot run inside torch\.autograd\.graph\.saved_tensors_hooks") as e:
                F.cross_entropy(compiled(x), y).backward()
        assert "0" in str(e.value).split(":")[0] or "Linear" in str(e.value) or "layer" in str(e.value)
        assert len(engine.accountant) == 0
        assert all(p.grad is None for p in model.parameters())
        F.cross_entropy(compiled(x), y).backward()
        opt.step()
        assert len(engine.accountant) == 1
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_compiled_exact_modes_inside_a_scaling_unpack_stay_within_2BC(mode):
    torch._dynamo.reset()
    try:
        def run(hooked):
            torch.manual_seed(0)
            engine, model, opt, loader = _private(mode)
            compiled = torch.compile(model)
            x, y = next(iter(loader))
            if hooked:
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, _scaling):
                    out = compiled(x)
            else:
                out = compiled(x)
            try:  # flat: a scaled token names no book, and the backward raises (nothing released)
                F.cross_entropy(out, y, reduction="sum").backward()
                opt.step()
            except (StepRefused, RuntimeError):
                assert hooked
                return None, len(x)
            return _release(model), len(x)

        got, B = run(True)
        if got is None:
            return
        torch._dynamo.reset()
        want, _ = run(False)
        L = 1 if mode == "flat" else 2
        assert (got - want).norm() <= 2 * B * 1.0 * L ** 0.5 * (1 + 1e-4), (got - want).norm()
    finally:
        torch._dynamo.reset()


def test_compiled_flat_under_save_on_cpu_trains_or_refuses_clearly():
    """``save_on_cpu`` unpacks copies: the compiled flat release found no parameter by identity and
    raised an IndexError from an empty refusal list (review 18)."""
    torch._dynamo.reset()
    try:
        engine, model, opt, loader = _private("flat")
        compiled = torch.compile(model)
        x, y = next(iter(loader))
        with torch.autograd.graph.save_on_cpu():
            out = compiled(x)
        F.cross_entropy(out, y, reduction="sum").backward()
        opt.step()
        assert len(engine.accountant) == 1
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------ compiled flat: tokens are data
def _retoken(change):
    """An unpack that passes ``change`` every saved float64 CPU tensor (the compiled flat tokens are
    the only ones in these models) and everything else unchanged."""
    def unpack(t):
        return change(t) if t.dtype == torch.float64 and t.device.type == "cpu" else t
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack)


def _compiled_flat_refused(run):
    torch._dynamo.reset()
    try:
        engine, model, opt, loader = _private("flat")
        compiled = torch.compile(model)
        x, y = next(iter(loader))
        with pytest.raises((StepRefused, RuntimeError)) as exc:
            run(engine, compiled, x, y)
            opt.step()
        assert all(p.grad is None for p in model.parameters())
        return str(exc.value)
    finally:
        torch._dynamo.reset()


def test_compiled_flat_release_refuses_tokens_of_several_forwards():
    """The release reads its book from the tokens it saved; an unpack that makes them disagree (one
    forward's layers pointing at another forward's book) is refused by name, not released."""
    def spread(t):
        return t + torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) if t.dim() == 1 else t

    def run(engine, compiled, x, y):
        with _retoken(spread):
            out = compiled(x)
        later = compiled(x)  # the next serial: the second layer's token names this open book, of the same model
        F.cross_entropy(out, y, reduction="sum").backward()
        del later
    assert "tokens of several forwards" in _compiled_flat_refused(run)


def test_compiled_flat_layer_refuses_a_token_naming_another_models_book():
    """The saved tokens rewritten to the serial of another private model's open book: the layers'
    entries would join that model's release. Refused by the layers' own backward op."""
    from bpclip_fast import compiled as compiled_mod

    def run(engine, compiled, x, y):
        _, other, _, other_loader = _private("flat")
        other_out = torch.compile(other)(next(iter(other_loader))[0])  # its book stays open
        theirs = next(reversed(compiled_mod._BOOKS))
        with _retoken(lambda t: torch.full_like(t, float(theirs))):
            out = compiled(x)
        F.cross_entropy(out, y, reduction="sum").backward()
        del other_out
    assert "another model's flat clipping" in _compiled_flat_refused(run)
