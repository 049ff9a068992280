"""The fused exact ``nn.EmbeddingBag`` (issue 26; bpclip_fast/layers/embedding_bag.py).

Before, an EmbeddingBag was trained by the generic exact path (2-D input only); now it is a
registered layer type whose per-example gradients are table rows keyed by (bag, index) and
released through RowExamples.

* Exactness: a zero-noise step (never armed: no noise, no scaling) equals the clipped sum of
  per-example gradients computed by running each bag alone through torch's own ``nn.EmbeddingBag``
  in float64, in flat and per_layer, modes sum (with and without per_sample_weights), mean and max,
  with padding_idx, repeated indices within and across bags, a tie of two rows in max mode, 2-D
  input and 1-D input with offsets (include_last_offset both ways, an empty bag, an all-padding
  bag), float64/float32/bfloat16, and a batch of one. The model is ``bag -> PositionalEmbedding``
  with the loss ``Σ out ⊙ G``, so both layers' upstream gradient is ``G`` exactly and flat clips two
  layers' norms together.
* No example's norm bound depends on another example (the RowExamples bound counts each example's
  own rows), for EmbeddingBag and Embedding.
* Refusals, the registry, and the engine (2-D input; 1-D + offsets refused under make_private).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine, modules, registry
from bpclip_fast import nn as bnn

F64 = torch.float64
V, D, PAD = 9, 3, 0

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Net(nn.Module):
    """EmbeddingBag then a PositionalEmbedding on its ``[B, D]`` output: two clipping units."""

    def __init__(self, mode, dtype, include_last_offset=False, seed=0):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode=mode, padding_idx=PAD, include_last_offset=include_last_offset,
                                   dtype=F64)
        self.pos = modules.PositionalEmbedding(D, dtype=F64)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
            self.bag.weight[6] = self.bag.weight[5]  # a tie between two rows (max mode: torch picks one)
        self.to(dtype)

    def forward(self, x, offsets=None, per_sample_weights=None):
        return self.pos(self.bag(x, offsets, per_sample_weights))


def _bags(layout, n, seed=1):
    """The bags as lists of indices: repeats within a bag (and across), padding entries, the tied
    rows 5 and 6 together; with offsets also an empty bag and an all-padding bag."""
    gen = torch.Generator().manual_seed(seed)
    t = 4
    if layout == "2d":
        x = torch.randint(1, V, (n, t), generator=gen)
        x[0, 1] = x[0, 0]                           # a repeat within a bag
        if n > 1:
            x[1, 2] = x[0, 0]                       # the same row in another bag
            x[n - 1, 3] = PAD                       # a padding entry
            x[1, :2] = torch.tensor([5, 6])         # the tied rows
        return [row.tolist() for row in x]
    lengths = [3, 0, 5, 2, 1, 4][:n] if n > 1 else [3]
    bags = [torch.randint(1, V, (k,), generator=gen).tolist() for k in lengths]
    bags[0][1] = bags[0][0]
    if n > 1:
        bags[2][0] = bags[0][0]
        bags[2][1:3] = [5, 6]
        bags[2][4] = PAD
        bags[3] = [PAD, PAD]                        # all padding: no entry counts
    return bags


def _inputs(layout, bags, dtype, weighted, seed=2):
    """``(args for the model, per-bag weights)``: ``(x, offsets, weights)`` in the layout."""
    gen = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(len(b), generator=gen, dtype=F64) + 0.5).to(dtype) for b in bags] if weighted else None
    if layout == "2d":
        x = torch.tensor(bags)
        return (x, None, torch.stack(weights) if weighted else None), weights
    flat = torch.tensor([i for b in bags for i in b], dtype=torch.long)
    starts = torch.tensor([0] + [len(b) for b in bags]).cumsum(0)
    offsets = starts if layout == "offsets_last" else starts[:-1]
    psw = torch.cat(weights) if weighted else None
    return (flat, offsets, psw), weights


def _truth(model, bags, weights, g):
    """Each bag alone through torch's float64 EmbeddingBag: ``{param name: [B, *shape]}`` and, per
    entry, the float64 ``A`` (``Σ_t |w_t|·|g_i|`` over the entries that reach it; ``|g|`` for the
    positional table): the scale of that entry's rounding errors."""
    ref = copy.deepcopy(model).double()
    ref.bag.include_last_offset = False
    grads, scales = {}, {}
    for i, bag in enumerate(bags):
        gi = g[i:i + 1].double()
        ref.zero_grad(set_to_none=True)
        psw = weights[i].double() if weights is not None else None
        out = ref(torch.tensor(bag, dtype=torch.long), torch.tensor([0]), psw)
        (out * gi).sum().backward()
        for name, p in ref.named_parameters():
            grads.setdefault(name, []).append(p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        a = torch.zeros(V, D, dtype=F64)
        if ref.bag.mode == "max":
            a = ref.bag.weight.grad.abs() if ref.bag.weight.grad is not None else a
        else:
            kept = [(t, j) for t, j in enumerate(bag) if j != PAD]
            for t, j in kept:
                w = float(psw[t].abs()) if psw is not None else (1.0 / len(kept) if ref.bag.mode == "mean" else 1.0)
                a[j] += w * gi[0].abs()
        scales.setdefault("bag.weight", []).append(a)
        scales.setdefault("pos.weight", []).append(gi[0].abs())
    return ({k: torch.stack(v) for k, v in grads.items()}, {k: torch.stack(v) for k, v in scales.items()})


def _units(mode):
    return [["bag.weight", "pos.weight"]] if mode == "flat" else [["bag.weight"], ["pos.weight"]]


def _clipped_sum(grads, scales, mode, thresholds):
    """The clipped sum and, per entry, ``Σ_i c_i (A_i,e + ‖A_i‖)`` over each unit (a factor's relative
    error ``ε‖A_i‖/‖G_i‖`` times ``|G_i,e| ≤ ‖G_i‖`` gives the ``‖A_i‖`` term)."""
    sums, scale = {}, {}
    for unit, c in zip(_units(mode), thresholds):
        norms = torch.sqrt(sum(grads[k].flatten(1).square().sum(1) for k in unit))
        a_norm = torch.sqrt(sum(scales[k].flatten(1).square().sum(1) for k in unit))
        factor = torch.where(norms > c, c / norms.clamp(min=1e-300), torch.ones_like(norms))
        for k in unit:
            shape = (-1,) + (1,) * (grads[k].dim() - 1)
            sums[k] = (grads[k] * factor.reshape(shape)).sum(0)
            scale[k] = ((scales[k] + a_norm.reshape(shape)) * factor.reshape(shape)).sum(0)
    return sums, scale


def _epsilon(dtype, t, b):
    """Relative error per unit of scale. Roundings of the parameters' dtype (u_d): the per-position
    weight as given, the stored per-example row, the norm of those stored values in the factor, the
    release's product (toward zero: 2) and its final rounding (6). The accumulation dtype (u_acc):
    ``1/|bag|`` and the product ``w·g``, the sum of at most ``t`` entries per row, the factor's few
    roundings and the sum over ``b`` examples (``t + b + 16``)."""
    u_d = 2.0 ** -53 if dtype == F64 else torch.finfo(dtype).eps / 2
    u_acc = 2.0 ** -53 if dtype == F64 else 2.0 ** -24
    return 6 * u_d + (t + b + 16) * u_acc


def _check(kind, clipping, dtype, layout, n):
    mode = "sum" if kind == "sum_weighted" else kind
    model = Net(mode, dtype, include_last_offset=layout == "offsets_last")
    bags = _bags(layout, n)
    args, weights = _inputs(layout, bags, dtype, kind == "sum_weighted")
    g = torch.randn(len(bags), D, generator=torch.Generator().manual_seed(3), dtype=F64)
    g = (g * torch.logspace(-1, 1, len(bags), dtype=F64).unsqueeze(1)).to(dtype)  # norms that differ
    grads, scales = _truth(model, bags, weights, g)
    norms = [torch.sqrt(sum(grads[k].flatten(1).square().sum(1) for k in u)) for u in _units(clipping)]
    # thresholds below the median norm: some examples clipped, some (for n > 1) not
    thresholds = [float(v[v > 0].median()) * (0.9 if n > 1 else 0.5) for v in norms]
    want, scale = _clipped_sum(grads, scales, clipping, thresholds)
    ours = bnn.convert_model(copy.deepcopy(model), clipping=clipping,
                             max_grad_norm=thresholds if clipping == "per_layer" else thresholds[0])
    assert type(ours.bag) is bnn.EmbeddingBag and not registry.is_generic(ours.bag)
    out = ours(*args)
    assert out.shape == (len(bags), D)
    with torch.no_grad():
        torch.testing.assert_close(out, model(*args), rtol=0, atol=0)  # torch's forward, bit for bit
    (out * g).sum().backward()
    eps = _epsilon(dtype, max(len(b) for b in bags), len(bags))
    got = dict(ours.named_parameters())
    for k in want:
        assert got[k].grad.dtype == dtype
        err = (got[k].grad.double() - want[k]).abs()
        tol = eps * scale[k]
        assert bool((err <= tol).all()), f"{kind} {clipping} {dtype} {layout} {k}: error {err.max():.3g} > tolerance"


KINDS = ["sum", "sum_weighted", "mean", "max"]
LAYOUTS = ["2d", "offsets", "offsets_last"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("kind", KINDS)
def test_release_equals_the_clipped_sum_of_bags_run_alone_in_float64(kind, clipping, dtype, layout):
    _check(kind, clipping, dtype, layout, n=6 if layout != "2d" else 5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_of_one(kind, layout):
    _check(kind, "flat", torch.float32, layout, n=1)


def test_per_sample_weights_get_torchs_gradient():
    """The weights' gradient (an input gradient) comes from the unclipped upstream gradient, as torch's."""
    model = Net("sum", F64)
    (x, _, psw), _ = _inputs("2d", _bags("2d", 4), F64, True)
    g = torch.randn(4, D, dtype=F64)
    ours = bnn.convert_model(copy.deepcopy(model), clipping="per_layer", max_grad_norm=[1e-3, 1e-3])
    ws = [psw.clone().requires_grad_(), psw.clone().requires_grad_()]
    (model(x, None, ws[0]) * g).sum().backward()
    (ours(x, None, ws[1]) * g).sum().backward()
    torch.testing.assert_close(ws[1].grad, ws[0].grad, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------- the bound


def _bound(layer, args, g):
    """The layer's RowExamples bound of each example, as its backward computes it."""
    w = layer.weight.detach()
    if isinstance(layer, bnn.EmbeddingBag):
        _, saved = layer._forward(layer._bags(*args, None), w, None, True)
    else:
        _, saved = layer._forward(args[0], w, None, True)
    return layer._examples(saved, g, [True, False]).bound([True, False])


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_no_bag_moves_another_bags_norm_bound(mode):
    """Bag 0's bound is the same whether the other bag is short or long (no cross-example term)."""
    layer = bnn.EmbeddingBag(V, D, mode=mode, clipping="per_layer", max_grad_norm=1.0, dtype=torch.float32)
    g = torch.randn(2, D)
    short = _bound(layer, (torch.tensor([1, 2, 2, 3]), torch.tensor([0, 3])), g)
    long_ = _bound(layer, (torch.tensor([1, 2, 2] + [4, 5, 6, 7, 8, 1, 2, 3] * 8), torch.tensor([0, 3])), g)
    assert short[0].item() == long_[0].item()


def test_embedding_bound_does_not_follow_the_batchs_padded_length():
    """Embedding: an example's bound is the same in a batch padded to 4 or to 400 positions (the old
    bound summed D·T squares' worth of slack, T the batch's padded length)."""
    layer = bnn.Embedding(V, D, padding_idx=PAD, clipping="per_layer", max_grad_norm=1.0, dtype=torch.float32)
    x = torch.tensor([[1, 2, 2, 3]])
    g = torch.randn(1, 4, D)
    wide = torch.cat([x, torch.full((1, 396), PAD)], 1)
    gw = torch.cat([g, torch.randn(1, 396, D)], 1)
    assert _bound(layer, (x,), g).item() == _bound(layer, (wide,), gw).item()


# ---------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("option,value,rule", [("max_norm", 1.0, "max_norm rewrites"),
                                               ("scale_grad_by_freq", True, "scale_grad_by_freq divides"),
                                               ("sparse", True, "sparse gradients")])
def test_options_that_break_the_bound_are_refused(option, value, rule):
    with pytest.raises(ValueError, match=f"EmbeddingBag: {rule}"):
        bnn.EmbeddingBag(V, D, mode="sum", clipping="flat", max_grad_norm=1.0, **{option: value})
    model = nn.Sequential(nn.EmbeddingBag(V, D, mode="sum", **{option: value}))
    with pytest.raises(ValueError, match=rule):
        bnn.convert_model(model, clipping="flat", max_grad_norm=1.0)


def test_backprop_clipping_is_refused():
    with pytest.raises(ValueError, match="clipping='backprop' has no proved bound.*'flat' or 'per_layer'"):
        bnn.EmbeddingBag(V, D)
    with pytest.raises(ValueError, match="clipping='backprop' has no proved bound"):
        bnn.convert_model(nn.Sequential(nn.EmbeddingBag(V, D)), clipping="backprop", input_clip=1.0, grad_clip=1.0)


@pytest.mark.parametrize("mode", ["mean", "max"])
def test_per_sample_weights_only_in_sum_mode(mode):
    layer = bnn.EmbeddingBag(V, D, mode=mode, clipping="flat", max_grad_norm=1.0)
    with pytest.raises(ValueError, match="per_sample_weights are only supported with mode='sum'"):
        layer(torch.tensor([[1, 2]]), None, torch.ones(1, 2))


@pytest.mark.parametrize("args,match", [
    ((torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])), "non-decreasing"),
    ((torch.tensor([1, 2, 3]), torch.tensor([1, 2])), "start at 0"),
    ((torch.tensor([1, 2, 3]), torch.tensor([0, 4])), "end at"),
    ((torch.tensor([1, 2, 3]), None), "needs offsets"),
    ((torch.tensor([[[1]]]), None), "2-D"),
    ((torch.tensor([[1, 2]]), torch.tensor([0])), "offsets must be None"),
    ((torch.tensor([[1.0, 2.0]]), None), "int64/int32"),
])
def test_bad_bags_are_refused(args, match):
    layer = bnn.EmbeddingBag(V, D, mode="sum", clipping="per_layer", max_grad_norm=1.0)
    with pytest.raises((ValueError, TypeError), match=match):
        layer(*args)


def test_include_last_offset_needs_the_input_length_at_the_end():
    """torch's CPU kernel puts the entries past a short last offset into the last bag (and crashes on a
    single offset): refused, so that bag i is entries offsets[i]:offsets[i + 1]."""
    layer = bnn.EmbeddingBag(V, D, mode="sum", include_last_offset=True, clipping="per_layer", max_grad_norm=1.0)
    for offsets in (torch.tensor([0, 1, 2]), torch.tensor([0])):
        with pytest.raises(ValueError, match="end at the input's length.*at least one bag"):
            layer(torch.tensor([1, 2, 3, 4]), offsets)


# ---------------------------------------------------------------------------------------- registry, engine


def test_the_registry_converts_it_to_the_fused_type_not_a_generic_unit():
    bag = nn.EmbeddingBag(V, D, mode="max")
    assert registry.layer_type(bag).clipped_type is bnn.EmbeddingBag
    assert not registry.generic_candidate(bag)
    model = bnn.convert_model(nn.Sequential(bag), clipping="flat", max_grad_norm=1.0)
    assert type(model[0]) is bnn.EmbeddingBag and model[0].weight is bag.weight


class BagClassifier(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, 8, mode=mode, padding_idx=PAD)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.bag(x)))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_make_private_trains_a_bag_model_on_2d_input(mode, clipping):
    """The whole engine path (probes, arming, records, noise) with the fused layer, in float32."""
    torch.manual_seed(4)
    model = BagClassifier(mode)
    before = [p.detach().clone() for p in model.parameters()]
    data = TensorDataset(torch.randint(0, V, (48, 5)), torch.randint(0, 3, (48,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt,
                                                      data_loader=DataLoader(data, batch_size=16),
                                                      noise_multiplier=1.0, max_grad_norm=1.0, clipping=clipping)
    bags = [m for m in model.modules() if isinstance(m, nn.EmbeddingBag)]
    assert len(bags) == 1 and type(bags[0]) is bnn.EmbeddingBag
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="1-D input with offsets is not supported under make_private.*2-D"):
        bags[0](torch.tensor([1, 2, 3]), torch.tensor([0, 1]))


def test_make_private_with_per_sample_weights():
    """The gradient-ownership probe recomputes the layer's gradient with the call's per_sample_weights
    (before, it dropped them and refused the model as if its table were used elsewhere)."""
    torch.manual_seed(5)

    class Weighted(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(V, 8, mode="sum", padding_idx=PAD)
            self.head = nn.Linear(8, 3)

        def forward(self, x, w):
            return self.head(self.bag(x, per_sample_weights=w))

    model = Weighted()
    data = TensorDataset(torch.randint(0, V, (48, 5)), torch.rand(48, 5), torch.randint(0, 3, (48,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt,
                                                      data_loader=DataLoader(data, batch_size=16),
                                                      noise_multiplier=1.0, max_grad_norm=1.0, clipping="flat")
    before = model.bag.weight.detach().clone()
    for x, w, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x, w), y).backward()
        opt.step()
    assert not torch.equal(before, model.bag.weight)
