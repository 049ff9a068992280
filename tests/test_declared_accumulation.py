"""Declared accumulation (review 49 H1): ``.grad`` between micro-batches showed their clipped sums.

Only a step's first landing backward adds the noise, so before ``optimizer.accumulate()`` the
difference of ``.grad`` read before and after a later micro-batch was that micro-batch's clipped
sum without noise: with micro-batches of ``B − 1`` and 1, one example's clipped gradient. Now the
micro-batches of a step run inside ``with optimizer.accumulate():``, where the engine keeps what
each pass computes for the parameters and everything downstream of the layers' backward sees zeros
(``.grad``, a tensor the loop kept from before the block, autograd node hooks, ``AccumulateGrad``'s
hooks: review 51 R1, R2) until the block ends; outside it a second landing pass is refused before
it runs, charged (``accumulate``). The step itself is unchanged: the block's gradient is the one a
single backward over the batch leaves, in float64.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine
from bpclip_fast.rules import RULES, StepRefused
from test_refused_before_landing import _Scale

MODES = ("flat", "per_layer", "backprop")
# One backward against micro-batches, float64: the same terms summed in another grouping, |error| ≤
# n·ε·Σ|terms| with n ≤ 32 rows and Σ|terms| ≤ 2 (a clipped mean, each term ≤ C/B̄ = O(1/16), and the
# noise added once, in both).
_F64_GROUPING = 64 * torch.finfo(torch.float64).eps
F = nn.functional


def _private(mode, sigma=1.0, dtype=torch.float32, seed=7, generic=False, model=None, **extra):
    torch.manual_seed(0)
    tail = [_Scale(3)] if generic else []
    model = (model or nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), *tail)).to(dtype)
    x, y = torch.randn(64, 6, dtype=dtype), torch.randint(0, 3, (64,))
    kw = {"clipping": mode, "max_grad_norm": 1.0} if mode != "backprop" else {
        "clipping": "backprop", "input_clip": 2.0, "grad_clip": 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the explicit noise_seed's warning
        engine = PrivacyEngine()
        m, o, dl = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
                                       noise_multiplier=sigma, noise_seed=seed, **kw, **extra)
    return engine, m, o, dl


def _grads(m):
    return [p.grad.detach().double().clone() for p in m.parameters()]


def _nothing_readable(m):
    """Every ``.grad`` unset or zero: what a pass inside the block leaves."""
    return all(p.grad is None or not p.grad.any() for p in m.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_nothing_of_the_step_is_readable_inside_the_block(mode):
    """After each micro-batch ``.grad`` is zero, and a gradient tensor the loop kept from the last step
    (``zero_grad(set_to_none=False)``) stays zero, also after the block (review 51 R1: the first pass
    had added its release into it, and the final ``.grad`` minus it was the other micro-batches' sum);
    at the block's end ``.grad`` holds the step, in a new tensor."""
    engine, m, o, dl = _private(mode)
    it = iter(dl)
    xb, yb = next(it)
    o.zero_grad()
    F.cross_entropy(m(xb), yb).backward()
    o.step()
    o.zero_grad(set_to_none=False)
    kept = [p.grad for p in m.parameters()]
    assert all(g is not None and not g.any() for g in kept)
    xb, yb = next(it)
    with o.accumulate():
        for xm, ym in zip(xb.split(5), yb.split(5)):
            F.cross_entropy(m(xm), ym).backward()
            assert _nothing_readable(m)
            assert not any(g.any() for g in kept)
    assert all(p.grad is not None and p.grad.any() for p in m.parameters())
    assert all(p.grad is not g for p, g in zip(m.parameters(), kept))
    assert not any(g.any() for g in kept)
    o.step()
    assert engine.steps == 2 and len(engine.accountant) == 2


@pytest.mark.parametrize("mode", MODES)
def test_the_block_releases_what_one_backward_releases(mode):
    """In float64, the same noise key: three uneven micro-batches inside the block leave the gradient one
    backward over the (Poisson) batch leaves, to float64 rounding of sums of its ~16 terms."""
    one = _private(mode, dtype=torch.float64)
    blk = _private(mode, dtype=torch.float64)
    (_, m1, o1, dl1), (_, m2, o2, dl2) = one, blk
    xb, yb = next(iter(dl1))
    xb2, yb2 = next(iter(dl2))
    assert torch.equal(xb, xb2)
    o1.zero_grad()
    F.cross_entropy(m1(xb), yb).backward()
    o2.zero_grad()
    with o2.accumulate():
        cuts = [len(xb) // 2, len(xb) - 2]  # uneven, one of them small
        for xm, ym in zip(xb.tensor_split(cuts), yb.tensor_split(cuts)):
            F.cross_entropy(m2(xm), ym).backward()
    tol = _F64_GROUPING
    for a, b in zip(_grads(m1), _grads(m2)):
        assert torch.allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", MODES)
def test_a_second_landing_pass_outside_the_block_is_refused_before_it_lands(mode):
    """Review 49 H1's loop: micro-batches of B − 1 and 1 with ``.grad`` read between them. The second
    pass is refused before it computes, charged, and leaves no gradient."""
    engine, m, o, dl = _private(mode, sigma=1.0)
    xb, yb = next(iter(dl))
    o.zero_grad()
    F.cross_entropy(m(xb[:-1]), yb[:-1]).backward()
    with pytest.raises(StepRefused) as info:
        F.cross_entropy(m(xb[-1:]), yb[-1:]).backward()
    assert info.value.rule == "accumulate" and info.value.charged and len(engine.accountant) == 1
    assert RULES["accumulate"][1] in str(info.value)
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("where", ("before", "after"))
def test_a_pass_outside_the_block_in_the_same_step_is_refused(where):
    """A pass before the block was readable, so the block's passes would add to a read release; a pass
    after it would add to the block's release."""
    engine, m, o, dl = _private("flat")
    xb, yb = next(iter(dl))
    o.zero_grad()

    def outside():
        F.cross_entropy(m(xb[:8]), yb[:8]).backward()

    def block():
        with o.accumulate():
            F.cross_entropy(m(xb[8:]), yb[8:]).backward()

    first, second = (outside, block) if where == "before" else (block, outside)
    first()
    with pytest.raises(StepRefused) as info:
        second()
    assert info.value.rule == "accumulate" and info.value.charged
    assert all(p.grad is None for p in m.parameters())


def test_a_gradient_written_inside_the_block_is_refused():
    """A gradient the loop writes inside the block is not the layer's: refused at the next pass, or at
    ``step()`` after the block (``grad-edit``), charged."""
    for at_end in (False, True):
        engine, m, o, dl = _private("per_layer")
        xb, yb = next(iter(dl))
        o.zero_grad()
        with pytest.raises(StepRefused) as info:
            with o.accumulate():
                first = xb[:8] if not at_end else xb  # at the end: all the rows landed, only the write is wrong
                F.cross_entropy(m(first), yb[:len(first)]).backward()
                m[0].weight.grad = torch.ones_like(m[0].weight)
                if not at_end:
                    F.cross_entropy(m(xb[8:]), yb[8:]).backward()
            o.step()
        assert info.value.rule == "grad-edit" and info.value.charged
        assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("mode", ["per_layer", "backprop"])
@pytest.mark.parametrize("between, rule", [("zero_grad", "redraw"), (".data write", "grad-edit")])
def test_what_the_loop_does_between_the_blocks_passes_is_refused(mode, between, rule):
    """``zero_grad()`` between the block's passes drops what the block held, and the next landing pass
    would need the step's draw again (``redraw``). A write through ``.data`` into the zeros ``.grad``
    holds (no version bump) is fingerprinted between the passes like any gradient (review 52 S5):
    refused at the next pass or at ``step()`` (``grad-edit``). Both charged."""
    engine, m, o, dl = _private(mode)
    xb, yb = next(iter(dl))
    o.zero_grad()
    with pytest.raises(StepRefused) as info:
        with o.accumulate():
            F.cross_entropy(m(xb[:8]), yb[:8]).backward()
            if between == "zero_grad":
                o.zero_grad()
            else:
                m[0].weight.grad.data.add_(1.0)
            F.cross_entropy(m(xb[8:]), yb[8:]).backward()
        o.step()
    assert info.value.rule == rule and info.value.charged


def test_step_inside_the_block_is_refused_uncharged_and_the_block_still_ends_well():
    engine, m, o, dl = _private("flat")
    xb, yb = next(iter(dl))
    o.zero_grad()
    with o.accumulate():
        F.cross_entropy(m(xb), yb).backward()
        with pytest.raises(RuntimeError, match="inside optimizer.accumulate"):
            o.step()
        with pytest.raises(RuntimeError, match="do not nest"):
            with o.accumulate():
                pass
        assert len(engine.accountant) == 0 and _nothing_readable(m)
    o.step()
    assert engine.steps == 1 and len(engine.accountant) == 1


def test_a_hook_inside_the_pass_cannot_read_a_landed_gradient():
    """An activation hook of an earlier layer runs after the later layer's gradient landed in the same
    pass: it sees zero (per_layer: the layers are called one by one)."""
    engine, m, o, dl = _private("per_layer")
    xb, yb = next(iter(dl))
    seen = []

    def hook(g):
        seen.append(m[2].weight.grad)
        return g

    o.zero_grad()
    with o.accumulate():
        for xm, ym in zip(xb.split(8), yb.split(8)):
            h = m[1](m[0](xm))
            h.register_hook(hook)
            F.cross_entropy(m[2](h), ym).backward()
    assert len(seen) == 2 and all(g is None or not g.any() for g in seen)
    assert m[2].weight.grad.any()


def test_integer_noise_refuses_a_second_pass_in_the_block_too():
    """Integer noise releases the layer's whole sum once: its own rule stays."""
    engine, m, o, dl = _private("flat", integer_noise=True)
    xb, yb = next(iter(dl))
    o.zero_grad()
    with pytest.raises(StepRefused) as info:
        with o.accumulate():
            F.cross_entropy(m(xb[:8]), yb[:8]).backward()
            F.cross_entropy(m(xb[8:]), yb[8:]).backward()
    assert info.value.rule == "integer-passes"


def test_one_backward_in_the_block_and_input_gradients_outside_it_are_fine():
    """A pass that lands nothing (``torch.autograd.grad`` of the input) is no release, inside or out."""
    engine, m, o, dl = _private("per_layer")
    xb, yb = next(iter(dl))
    x = xb.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(F.cross_entropy(m(x), yb), x)
    o.zero_grad()
    with o.accumulate():
        F.cross_entropy(m(xb + 0.01 * gx.sign()), yb).backward()
        (gx,) = torch.autograd.grad(F.cross_entropy(m(x), yb), x)
    o.step()
    assert engine.steps == 1


@pytest.mark.parametrize("kind, mode", [("compiled", "flat"), ("compiled", "per_layer"), ("compiled", "backprop"),
                                        ("generic", "flat"), ("generic", "per_layer")])
def test_compiled_and_generic_layers_are_held_too(kind, mode):
    """A compiled model (the layers' custom ops) and a generic unit: ``.grad`` unset between the
    micro-batches, and the block's gradient the one backward's, in float64 (tolerance as above)."""
    released = []
    for block in (False, True):
        engine, m, o, dl = _private(mode, dtype=torch.float64, generic=kind == "generic")
        run = torch.compile(m, backend="aot_eager") if kind == "compiled" else m
        xb, yb = next(iter(dl))
        o.zero_grad()
        if block:
            with o.accumulate():
                for xm, ym in zip(xb.tensor_split(2), yb.tensor_split(2)):
                    F.cross_entropy(run(xm), ym).backward()
                    assert _nothing_readable(m)
        else:
            F.cross_entropy(run(xb), yb).backward()
        released.append(_grads(m))
    tol = _F64_GROUPING
    for a, b in zip(*released):
        assert torch.allclose(a, b, rtol=tol, atol=tol)


def test_banded_noise_holds_its_gradients_too():
    """Correlated noise adds the step's row in the first landing pass, like the other noises."""
    engine, m, o, dl = _private("flat", noise="banded", bands=2)
    for xb, yb in dl:
        o.zero_grad()
        with o.accumulate():
            for xm, ym in zip(xb.tensor_split(2), yb.tensor_split(2)):
                F.cross_entropy(m(xm), ym).backward()
                assert _nothing_readable(m)
        assert all(p.grad is not None and p.grad.any() for p in m.parameters())
        o.step()
    assert engine.steps == 4


def _walk(fn, seen):
    if fn is None or id(fn) in seen:
        return
    seen.add(id(fn))
    yield fn
    for nxt, _ in fn.next_functions:
        yield from _walk(nxt, seen)


@pytest.mark.parametrize("mode", MODES)
def test_node_hooks_inside_the_block_see_only_zeros_for_the_parameters(mode):
    """Review 51 R2: a post-hook on every node of the graph (the layers' backward nodes, whose outputs
    include the parameters' gradients, and the parameters' ``AccumulateGrad`` nodes, which receive
    them) saw each pass's clipped sum, the second without noise. Every parameter-shaped tensor they
    see inside the block is zero; the step still goes through (these hooks are not the layers')."""
    engine, m, o, dl = _private(mode)
    shapes = {tuple(p.shape) for p in m.parameters()}
    xb, yb = next(iter(dl))
    seen = []

    def hook(grad_inputs, grad_outputs):
        seen.extend(t for t in (*grad_inputs, *grad_outputs) if t is not None and tuple(t.shape) in shapes)

    o.zero_grad()
    with o.accumulate():
        for xm, ym in zip(xb.tensor_split([len(xb) - 1]), yb.tensor_split([len(yb) - 1])):
            loss = F.cross_entropy(m(xm), ym)
            for node in _walk(loss.grad_fn, set()):
                node.register_hook(hook)
            loss.backward()
    assert len(seen) >= 2 * len(shapes) and not any(t.any() for t in seen)
    o.step()
    assert engine.steps == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", [False, True])
def test_a_pass_that_lands_nothing_adds_nothing_and_shows_nothing(mode, block):
    """``torch.autograd.grad`` of the input after the training backward (an adversarial example's
    gradient): the layers compute their parameters' gradients and autograd drops them. Inside the
    block they must not join the held sum (their rows are never counted: the batch would count twice),
    in or out of it a hook on the layers' nodes must not see them (after the noise landed they are
    the batch's clipped sum without noise), and the released gradient is bit for bit the one without
    that pass (review 52)."""
    released = []
    for extra in (False, True):
        engine, m, o, dl = _private(mode, dtype=torch.float64)
        xb, yb = next(iter(dl))
        o.zero_grad()
        with o.accumulate() if block else contextlib.nullcontext():
            F.cross_entropy(m(xb), yb).backward()
            if extra:
                x = xb.clone().requires_grad_(True)
                loss = F.cross_entropy(m(x), yb)
                shapes, seen = {tuple(p.shape) for p in m.parameters()}, []
                for node in _walk(loss.grad_fn, set()):
                    node.register_hook(lambda gi, go: seen.extend(
                        t for t in gi if t is not None and tuple(t.shape) in shapes))
                torch.autograd.grad(loss, x)
                # (flat's collector releases nothing for a pass that lands on no layer: nothing to see)
                assert (mode == "flat" or seen) and not any(t.any() for t in seen)
        released.append(_grads(m))
        o.step()
    for a, b in zip(*released):
        assert torch.equal(a, b)


_LAYER_NODE = {"flat": "_CollectorBackward", "per_layer": "_ExactLayerBackward", "backprop": "_ClippedLinearBackward"}


@pytest.mark.parametrize("mode", MODES)
def test_a_pass_that_raises_after_the_layer_computed_adds_nothing(mode):
    """Review 52 S1: a hook on a layer's backward node that raises once (a NaN guard), after the layer
    computed its sum and before the pass landed, then the same micro-batch retried. The aborted pass's
    sum had joined the block's: the last example twice. Now the block's gradient equals one backward
    over the batch in float64 (tolerance as above), after one abort or three."""
    for aborts in (1, 3):
        released = []
        for attack in (False, True):
            engine, m, o, dl = _private(mode, dtype=torch.float64)
            xb, yb = next(iter(dl))
            o.zero_grad()
            with o.accumulate():
                F.cross_entropy(m(xb[:-1]), yb[:-1]).backward()
                for _ in range(aborts if attack else 0):
                    loss = F.cross_entropy(m(xb[-1:]), yb[-1:])
                    node = next(n for n in _walk(loss.grad_fn, set()) if type(n).__name__ == _LAYER_NODE[mode])

                    def boom(gi, go):
                        raise FloatingPointError("a non-finite guard")

                    node.register_hook(boom)
                    with pytest.raises(FloatingPointError):
                        loss.backward()
                F.cross_entropy(m(xb[-1:]), yb[-1:]).backward()
            released.append(_grads(m))
            o.step()
        tol = _F64_GROUPING
        for a, b in zip(*released):
            assert torch.allclose(a, b, rtol=tol, atol=tol)


class _TwiceOnHalves(nn.Module):
    """The last layer applied to each half of the batch: a second use, added after make_private."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.split = nn.Linear(6, 8), nn.Linear(8, 3), False

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if not self.split:
            return self.fc2(h)
        k = len(h) // 2
        return torch.cat([self.fc2(h[:k]), self.fc2(h[k:])])


@pytest.mark.parametrize("mode", ["per_layer", "backprop"])
@pytest.mark.parametrize("block", [False, True])
def test_a_layer_called_twice_in_one_pass_is_refused_before_its_second_call_computes(mode, block):
    """Review 52 S3: only a layer's first call in a pass takes the step's draw, and a hook on the
    second call's node read its rows' clipped sum without noise before the pre-hook refused the two
    calls' sum. Refused now at the second call, before it computes (``weight-reuse``, charged)."""
    engine, m, o, dl = _private(mode, model=_TwiceOnHalves())
    m.split = True
    xb, yb = next(iter(dl))
    seen = []
    o.zero_grad()
    with pytest.raises(StepRefused) as info:
        with o.accumulate() if block else contextlib.nullcontext():
            loss = F.cross_entropy(m(xb), yb)
            for node in _walk(loss.grad_fn, set()):
                if type(node).__name__ == _LAYER_NODE[mode]:
                    node.register_hook(lambda gi, go: seen.append(gi))
            loss.backward()
    assert info.value.rule == "weight-reuse" and info.value.charged
    assert len(seen) <= 1  # the call that ran first took the draw; the other never computed
    assert all(p.grad is None for p in m.parameters())


def test_a_compiled_plain_use_of_a_weight_is_refused_before_it_lands_in_the_block():
    """Review 52 S2: inductor adds a plain use's gradient into the buffer the layer returned, after it
    was zeroed, so ``.grad`` would hold the unclipped gradient alone. Refused in the pre-hook inside the
    block (``weight-reuse``), before anything lands."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.tie = nn.Linear(6, 8), nn.Linear(8, 3), False

        def forward(self, x):
            out = self.fc2(torch.tanh(self.fc1(x)))
            return out * (1 + 0.5 * self.fc2.weight.square().sum()) if self.tie else out

    torch._dynamo.reset()
    try:
        engine, m, o, dl = _private("per_layer", model=Tied())
        m.tie = True
        run = torch.compile(m, backend="inductor")
        xb, yb = next(iter(dl))
        o.zero_grad()
        with pytest.raises(StepRefused) as info:
            with o.accumulate():
                F.cross_entropy(run(xb[:8]), yb[:8]).backward()
        assert info.value.rule == "weight-reuse" and info.value.charged
        assert all(p.grad is None for p in m.parameters())
    finally:
        torch._dynamo.reset()


class _Many(nn.Module):
    """The last layer called k times, each call seeing the single call's upstream gradient (added after
    make_private): k computations of one clipped sum."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.k = nn.Linear(6, 8), nn.Linear(8, 3), 1

    def forward(self, x):
        self.h = torch.tanh(self.fc1(x))
        if self.k == 1:
            return self.fc2(self.h)
        self.calls = [self.fc2(self.h) for _ in range(self.k)]
        return self.calls[0] + sum(c - c.detach() for c in self.calls[1:])


@pytest.mark.parametrize("mode", ["per_layer", "backprop"])
@pytest.mark.parametrize("reset", ["zero_grad", "nested pass"])
def test_a_reset_between_two_calls_of_a_layer_does_not_make_a_new_pass(mode, reset):
    """Review 53 T1: a hook on each call's node that resets the layer between calls (``zero_grad()``, or
    a nested backward through it that lands nothing) made every call look like a new pass with a fresh
    draw: k noisy copies of one sum for one charge, averaged to noise σ/√k. The passes a layer's
    backward ran in are kept for the step: the second call is refused before it computes, whatever ran
    in between, and only one (noised) sum was ever computed."""
    engine, m, o, dl = _private(mode, model=_Many())
    xb, yb = next(iter(dl))
    m.k = 8
    reads = []
    o.zero_grad()
    out = m(xb)
    spare_in = m.h.detach().requires_grad_(True)
    spare_loss = m.fc2(spare_in).sum()

    def hook(gi, go):
        reads.append(gi[1])
        if reset == "zero_grad":
            o.zero_grad()
        else:
            torch.autograd.grad(spare_loss, spare_in, retain_graph=True)

    for c in m.calls:
        c.grad_fn.register_hook(hook)
    with pytest.raises(StepRefused) as info:
        F.cross_entropy(out, yb).backward()
    # the second call, seen as a new pass, is refused before it computes by the first rule that sees
    # it: a pass after a draw taken for a landing that never landed (review 54) or a call in a pass
    # the layer already ran in
    assert info.value.rule in ("redraw", "weight-reuse") and info.value.charged and len(engine.accountant) == 1
    assert len(reads) == 1


@pytest.mark.parametrize("mode", ["per_layer", "backprop"])
def test_a_pass_whose_gradient_a_hook_dropped_does_not_get_a_fresh_draw(mode):
    """Review 54 U1: a hook on the layer's backward node read the pass's noised sum and returned
    ``None`` for the parameters, so nothing landed and the next pass over the batch took a fresh draw:
    K forwards gave K noisy copies of one sum (noise down by √K) for one charge, the last one landed
    and the step went through. The pass after a draw that was taken for a landing and never landed is
    refused before it computes (``redraw``, charged); only one sum was ever read."""
    engine, m, o, dl = _private(mode)
    xb, yb = next(iter(dl))
    reads = []

    def drop(gi, go):  # read the parameters' gradients, land nothing
        reads.append(gi[1])
        return tuple(None if j in (1, 2) else t for j, t in enumerate(gi))

    m[0].register_forward_hook(lambda mod, i, y: y.grad_fn.register_hook(
        lambda gi, go: tuple(None if j in (1, 2) else t for j, t in enumerate(gi))) and None)
    m[2].register_forward_hook(lambda mod, i, y: y.grad_fn.register_hook(drop) and None)
    o.zero_grad()
    F.cross_entropy(m(xb), yb).backward()
    assert len(reads) == 1 and all(p.grad is None for p in m.parameters())
    with pytest.raises(StepRefused) as info:
        F.cross_entropy(m(xb), yb).backward()
    assert info.value.rule == "redraw" and info.value.charged and len(engine.accountant) == 1
    assert len(reads) == 1
