"""The host-cost report's counting rules (bench/launches.py) on steps whose ops are known."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import launches  # noqa: E402


def _counted(fn, inner=None):
    mode, py = launches._Ops(), [0]
    with mode, launches.python_syncs(py):
        fn()
    ops, syncs, hist = launches.count(mode.names, inner or {})
    return ops, syncs + py[0], hist


def test_views_and_allocations_are_free_and_data_work_counts_once():
    x = torch.randn(4, 3)
    ops, syncs, hist = _counted(lambda: (x[:, :2].t().unsqueeze(0).expand(2, 2, 4) * 2.0).sum())
    assert (ops, syncs) == (2, 0)
    assert set(hist) == {"aten::mul", "aten::sum"}
    ops, _, hist = _counted(lambda: (torch.empty(5), x.detach(), x.t().contiguous()))
    assert (ops, dict(hist)) == (1, {"aten::clone": 1})  # the transposed copy is one kernel


def test_every_kind_of_host_sync_counts_once():
    x = torch.randn(4, 3)
    steps = [lambda: x.sum().item(), lambda: bool((x > 0).all()), lambda: x.nonzero(),
             lambda: torch.equal(x, x), lambda: x.tolist(), lambda: x.numpy(), lambda: x.cpu()]
    for step in steps:
        assert _counted(step)[1] == 1
    assert _counted(lambda: x.sum() * 2)[1] == 0


def test_an_extension_op_counts_its_own_kernel_and_what_it_calls():
    from bpclip_fast import _ops

    if not _ops.extension_loaded():
        pytest.skip("the bpclip_fast extension is not built")
    x, factor = torch.randn(4, 3), torch.rand(4)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ops.bpclip_fast.scale_rows(x, factor)
    inner = launches.inner_leaves(prof.events())
    ops, _, hist = _counted(lambda: torch.ops.bpclip_fast.scale_rows(x, factor), inner)
    # scale_rows is one kernel of its own that allocates its output and calls no ATen op with data
    # work: one launch.
    assert ops == hist["bpclip_fast::scale_rows"] == 1


def test_a_composite_extension_op_counts_only_what_it_calls():
    """linear_forward is written over clip_rows and ATen's linear (CompositeExplicitAutograd): it
    launches nothing of its own, so it counts as clip_rows' kernel plus the GEMM."""
    from bpclip_fast import _ops

    if not _ops.extension_loaded():
        pytest.skip("the bpclip_fast extension is not built")
    from torch.profiler import ProfilerActivity, profile

    x, w, b, counter = torch.randn(3, 5), torch.randn(4, 5), torch.randn(4), torch.zeros(1, dtype=torch.int64)

    def fwd():
        return torch.ops.bpclip_fast.linear_forward(x, w, b, counter, 1.0, "clip", 0.01)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fwd()
    inner = launches.inner_leaves(prof.events())
    ops, _, _ = _counted(fwd, inner)
    assert ops == 2  # clip_rows + addmm


def test_each_call_of_an_extension_op_counts_its_own_route():
    """One composite op called twice along two routes (with noise: the mm, then the noise added in
    place; without: the mm alone) counts each call's own leaves, not the larger route twice."""
    from bpclip_fast import _ops

    if not _ops.extension_loaded():
        pytest.skip("the bpclip_fast extension is not built")
    from torch.profiler import ProfilerActivity, profile

    g, x, w, factor = torch.randn(3, 4), torch.randn(3, 5), torch.randn(4, 5), torch.rand(3)

    def release(std):
        return torch.ops.bpclip_fast.linear_clipped_grads(g, x, factor, w, [True, False], [1, 0], std)

    def both():
        release(1.0)
        release(0.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        both()
    inner = launches.inner_leaves(prof.events())
    ops, _, _ = _counted(both, inner)
    routes = inner["bpclip_fast::linear_clipped_grads"]
    assert len(routes) == 2 and routes[0] > routes[1]  # the noise is a launch of its own
    # scale_rows2 + mm + philox_noise_, then scale_rows2 + mm
    assert routes == [3, 2] and ops == 5  # (without a draw or a scale the epilogue, layer_tail_, is not launched)


def test_per_layer_makes_an_instantiated_layers_bound_and_factors_in_one_launch():
    """Issue 25: under per_layer a layer with instantiated per-example gradients (here a LayerNorm)
    made its bound (``examples_bound``) and its factors (``exact_factors``) in two launches; one
    kernel (``examples_factors``) makes both. The Linear layers keep their own ``exact_factors``."""
    from bpclip_fast import PrivacyEngine, _ops

    if not _ops.extension_loaded():
        pytest.skip("the bpclip_fast extension is not built")
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))  # q = 1: every batch holds all four
    model, opt, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
        clipping="per_layer")

    def step(batch):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()
    step(next(iter(loader)))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(next(iter(loader)))
    batch = next(iter(loader))
    _, _, hist = _counted(lambda: step(batch), launches.inner_leaves(prof.events()))
    assert "bpclip_fast::examples_bound" not in hist
    assert hist["bpclip_fast::examples_factors"] == 1 and hist["bpclip_fast::exact_factors"] == 2


def test_flat_instantiate_keeps_the_per_example_gradients_and_releases_them_in_one_launch():
    """``--methods flat_instantiate``: the ViT's Linears over 17 positions instantiate their
    per-example gradients and release them by ``examples_release`` instead of the release GEMM
    (``linear_clipped_grads``' scale, bias sum, ``mm`` and noise), so the step counts fewer
    leaf ops than flat by the cost rule (ghost norms at these shapes)."""
    from bpclip_fast import _ops

    if not _ops.extension_loaded():
        pytest.skip("the bpclip_fast extension is not built")
    counts = {}
    for method in ("flat", "flat_instantiate"):
        fetch, step = launches.build(method, "vit")
        step(fetch())
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(fetch())
        batch = fetch()
        counts[method] = _counted(lambda: step(batch), launches.inner_leaves(prof.events()))
    (flat, _, flat_hist), (inst, _, inst_hist) = counts["flat"], counts["flat_instantiate"]
    # Per Linear over 17 positions: 4 launches of the release from the upstream gradient become 1.
    assert flat_hist["bpclip_fast::linear_clipped_grads"] - inst_hist["bpclip_fast::linear_clipped_grads"] == 3 * 16
    assert inst < flat


@pytest.mark.parametrize("method", ["flat", "per_layer", "backprop"])
def test_a_mean_loss_scale_other_than_one_launches_nothing_more(method):
    """Issue 25: a Poisson step's batch almost never holds B̄ rows, so its mean-loss scale d/B̄ is not
    1; the release ops apply it in their noise launch. At q = 1 (the bench's default) the scale is 1,
    which hid the ``mul_`` per parameter it used to cost: ``--expected-batch`` counts that step, and
    it must count no more than the q = 1 step (before the fix, 6 more on the digits net's 3 layers).
    Since the eighteenth session it counts fewer under the exact modes: with a scale their Linear
    release sums the bias inside the noise's launch (layer_tail_), where at scale 1 the draw is
    written before the GEMM and the bias summed by ATen (one launch more per biased Linear)."""
    from bpclip_fast import _ops

    if not _ops.extension_loaded():
        pytest.skip("the bpclip_fast extension is not built")
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    for expected in (None, 2.5):
        fetch, step = launches.build(method, "digits", expected_batch=expected)
        step(fetch())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(fetch())
        batch = fetch()
        ops, syncs, hist = _counted(lambda: step(batch), launches.inner_leaves(prof.events()))
        counts[expected] = (ops, syncs)
        if expected is not None:
            assert not any(name.startswith("aten::mul") for name in hist), hist
    biased_linears = 2  # the digits net's two Linear layers; its Conv2d's bias comes from ATen's conv backward
    fewer = biased_linears if method in ("flat", "per_layer") else 0
    assert counts[2.5] == (counts[None][0] - fewer, counts[None][1])


def test_flat_unchecked_is_flat_without_the_boundary_and_only_on_request():
    """``flat_unchecked`` measures the step boundary's share of the host cost: the same release as
    ``flat`` (same seed, same data: the same gradients after one step), with no layer hook, no layer
    record and no verification at ``step()``; never among the default methods (it is not private)."""
    from bpclip_fast import _ops

    if not _ops.extension_loaded():
        pytest.skip("the bpclip_fast extension is not built")
    assert "flat_unchecked" not in launches.METHODS[:-launches.ON_REQUEST]
    grads = {}
    for method in ("flat", "flat_unchecked"):
        fetch, step = launches.build(method, "digits")
        model = step.__closure__[step.__code__.co_freevars.index("model")].cell_contents
        opt = step.__closure__[step.__code__.co_freevars.index("opt")].cell_contents
        xb, yb = fetch()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        grads[method] = [p.grad.clone() for p in model.parameters()]
        steps = opt.engine._steps_of
        if method == "flat_unchecked":
            assert not any(st.enforce or st._handles or st._expected or st._produced for st in steps)  # no records
        else:
            assert all(st.enforce and st._handles for st in steps)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(grads["flat"], grads["flat_unchecked"], strict=True))


def test_host_times_interleave_the_methods_and_drop_each_blocks_first_step():
    """The methods of a model are timed in alternating blocks (a machine's drift falls on all alike);
    each block starts with one uncounted step after the switch; every method gets exactly ``reps``
    counted steps, also when ``reps`` does not divide into the rounds."""
    calls = []

    def cell(name):
        return (lambda: name, lambda batch: calls.append(batch))
    cells = {"a": cell("a"), "b": cell("b")}
    host = launches.host_times(cells, reps=7, rounds=3)
    assert set(host) == {"a", "b"}
    # blocks of 1 + 3, 1 + 2, 1 + 2 steps, a then b in each round
    assert calls == ["a"] * 4 + ["b"] * 4 + ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    calls.clear()
    launches.host_times(cells, reps=2, rounds=5)  # never more rounds than counted steps
    assert calls == ["a", "a", "b", "b"] * 2


def test_the_breakdown_names_the_private_steps_own_nodes():
    """``--breakdown``: per method, the profiler entries whose self CPU time grew over non-private's,
    largest first; the flat collector's node exists only in the private step, so it must be among
    them, and the non-private row has none."""
    from bpclip_fast import _ops

    if not _ops.extension_loaded():
        pytest.skip("the bpclip_fast extension is not built")
    rows = launches.measure_model("digits", ["nonprivate", "flat"], reps=2, warmup=1, rounds=2, breakdown=200)
    by = {r["method"]: r for r in rows}
    assert "grew" not in by["nonprivate"] and by["nonprivate"]["host_ms"] > 0
    grew = by["flat"]["grew"]
    assert any(k == "_CollectorBackward" for k, _ in grew), grew
    assert all(v > 0 for _, v in grew) and [v for _, v in grew] == sorted((v for _, v in grew), reverse=True)
    assert by["flat"]["ops"] > by["nonprivate"]["ops"] and by["flat"]["host_ms"] > 0
