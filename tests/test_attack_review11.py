"""Attack review 11 (DESIGN §5): the fused Conv3d, the [1, T] broadcast index and the probe that
perturbs integer inputs, each against what an ordinary loop or input can do.

* Conv3d: padding modes that repeat an input entry inside a patch, a channels_last_3d input and a
  batch expanded from one example (stride 0) release per-example clipping, checked against each
  example run alone in float64 (tests/fused_release.py's bound).
* The broadcast index: a model that calls its Embedding on part of the batch, and activation
  checkpointing (the lookup recomputed outside the call, with one row), fail closed.
* The integer perturbation: ordinary models (HF BERT with attention_mask, token_type_ids and labels
  in the batch dict; a [B] length building a mask) are accepted; a model mixing examples through
  the batch's multiset of tokens is refused (it passed while the perturbation only rolled a row)."""

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, TensorDataset

import fused_release as fr
import bpclip_fast.nn as bnn
from bpclip_fast import PrivacyEngine, StepRefused
from test_fused_conv3d import _scale

F64 = torch.float64


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------------------ 1. Conv3d

KINDS = {
    "replicate": (lambda: nn.Conv3d(2, 3, 3, padding=(1, 2, 1), padding_mode="replicate"), (2, 3, 4, 3)),
    "circular": (lambda: nn.Conv3d(2, 3, (2, 3, 3), padding=(1, 1, 2), padding_mode="circular"), (2, 3, 4, 3)),
    "reflect-same": (lambda: nn.Conv3d(2, 3, (2, 3, 2), padding="same", padding_mode="reflect"), (2, 3, 4, 3)),
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_repeating_padding_modes_release_per_example_clipping_in_float64(kind, mode):
    """A patch holds a replicated/circular entry several times: the bound is still each example's
    own clipped norm (an exact norm of the patches' product, whatever they repeat)."""
    fr.check(KINDS, _scale, kind, mode, F64, n=4)


def _release(model, x, g, C):
    ours = bnn.convert_model(copy.deepcopy(model), clipping="flat", max_grad_norm=C)
    assert type(ours[0]) is bnn.Conv3d
    (ours(x) * g).sum().backward()
    return {k: p.grad for k, p in ours.named_parameters()}


@pytest.mark.parametrize("layout", ["channels_last_3d", "expanded"])
def test_channels_last_and_an_expanded_batch_release_per_example_clipping(layout):
    """channels_last_3d strides, and ``x1.expand(B, ...)`` (stride 0 along the batch: B identical
    rows, each its own example): Σ_i clip(G_i, C) in float64, C below every example's norm."""
    model = fr.model_of(KINDS, "replicate", F64)
    gen = torch.Generator().manual_seed(5)
    n = 4
    x = torch.randn(n, *KINDS["replicate"][1], generator=gen, dtype=F64)
    if layout == "channels_last_3d":
        x = x.to(memory_format=torch.channels_last_3d)
        assert not x.is_contiguous()
    else:
        x = x[:1].expand(n, *x.shape[1:])
        assert x.stride(0) == 0
    with torch.no_grad():
        out_shape = model[0](x[:1]).shape[1:]
    spread = torch.arange(1.0, n + 1, dtype=F64).reshape(-1, 1, 1, 1, 1)  # the examples' norms differ
    g = torch.randn(n, *out_shape, generator=gen, dtype=F64) * spread
    grads = fr.truth(model, x, g)
    norms = torch.sqrt(sum(v.flatten(1).square().sum(1) for v in grads.values()))
    C = 0.5 * float(norms.min())
    want = {k: (v * (C / norms).reshape(-1, *[1] * (v.dim() - 1))).sum(0) for k, v in grads.items()}
    got = _release(model, x, g, C)
    # float64 throughout but the fp32-accumulated norms (fused_release's U32): the release of n
    # examples each of norm C errs by ≤ 2·K·U32 relative to C per example, K the terms summed
    k_terms = x[0].numel() + 2 * math.prod(out_shape) + sum(p.numel() for p in model.parameters()) + n
    tol = n * C * 2 * k_terms * fr.U32
    err = math.sqrt(sum(float((got[k] - want[k]).square().sum()) for k in want))
    assert err <= tol, (err, tol)
    released = math.sqrt(sum(float(v.square().sum()) for v in got.values()))
    assert released <= n * C * (1 + 2 * k_terms * fr.U32)  # removal of any one example: ≤ C each


# ------------------------------------------------------------------------------ 2. the [1, T] index

T, D, V = 6, 4, 50


class Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos, self.lin = nn.Embedding(T, D), nn.Linear(D, D)

    def forward(self, h):
        return torch.tanh(self.lin(h) + self.pos(torch.arange(h.shape[1]).unsqueeze(0))).sum(1)


class Halves(nn.Module):
    """Calls the submodule holding the position Embedding on each half of the batch: the rows the
    engine pushed are the whole call's B, the half's tensors B/2."""

    def __init__(self, ckpt=False):
        super().__init__()
        self.inp, self.sub, self.out, self.ckpt, self.halves = nn.Linear(D, D), Sub(), nn.Linear(D, 3), ckpt, True

    def forward(self, x):
        h = self.inp(x)
        if self.ckpt and torch.is_grad_enabled():  # switched on after make_private, as HF's flag can be
            return self.out(checkpoint(self.sub, h, use_reentrant=True))
        if self.halves:
            return self.out(torch.cat([self.sub(c) for c in h.chunk(2)]))
        return self.out(self.sub(h))


def _toy(n=12):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, T, D, generator=g, dtype=F64), torch.randint(0, 3, (n,), generator=g))


def _make_private(model, data, clipping, C=1.0):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=6),
                                        noise_multiplier=1.0, max_grad_norm=C, clipping=clipping,
                                        loss_reduction="sum", noise_seed=3)


def test_an_embedding_called_on_part_of_the_batch_is_refused():
    """Expanded to the outer call's B inside a call on B/2 rows: refused before training, not mixed."""
    with pytest.raises(ValueError, match=r"sub\.pos.*rule: example rows"):
        _make_private(Halves().double(), _toy(), "flat")


def test_a_lookup_recomputed_by_checkpointing_releases_nothing():
    """Reentrant checkpointing recomputes the lookup in the backward, outside the model's call: one
    row, not B. per_layer clipping lets a layer run outside the call, so the step's row count is what
    stops it: refused, nothing released."""
    model = Halves().double()
    model.halves = False
    model, opt, loader = _make_private(model, _toy(), "per_layer")
    model.ckpt = True
    x, y = next(iter(loader))
    assert x.shape[0] > 1
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    with pytest.raises(StepRefused) as info:
        opt.step()
    assert info.value.rule == "rows"


# ------------------------------------------------------------------------------ 3. the integer probe

N = 12


def _tokens():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (N, T), generator=g)
    lengths = torch.randint(2, T + 1, (N,), generator=g)
    return ids, lengths, torch.randint(0, 3, (N,), generator=g)


class Dicts(Dataset):
    def __init__(self, **columns):
        self.columns = columns

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.columns.items()}


class Lengths(nn.Module):
    """A [B] integer length per example builds the mask (arange < length)."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(V, D), nn.Linear(D, 3)

    def forward(self, input_ids, lengths):
        keep = (torch.arange(input_ids.shape[1])[None] < lengths[:, None]).unsqueeze(-1)
        return self.out((self.emb(input_ids) * keep).sum(1) / lengths[:, None])


class BatchFrequency(nn.Module):
    """Each token's embedding divided by its count in the whole batch: example i's output moves with
    another example's tokens, but not with their order within it."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(V, D), nn.Linear(D, 3)

    def forward(self, ids):
        counts = torch.bincount(ids.flatten(), minlength=V).to(self.out.weight.dtype)
        return self.out((self.emb(ids) / counts[ids].unsqueeze(-1)).sum(1))


def _dict_private(model, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=4),
                                        noise_multiplier=1.0, max_grad_norm=1.0, clipping="flat")


@pytest.mark.parametrize("labels", [False, True], ids=["logits", "labels-in-batch"])
def test_hf_bert_with_masks_and_labels_in_the_batch_is_accepted(labels):
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    ids, lengths, y = _tokens()
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    types = (torch.arange(T)[None] >= lengths[:, None] // 2).long()
    cfg = tf.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    columns = dict(input_ids=ids, attention_mask=mask, token_type_ids=types, **({"labels": y} if labels else {}))
    model, opt, loader = _dict_private(tf.BertForSequenceClassification(cfg), Dicts(**columns))
    # Poisson sampling may draw an empty batch, on which BERT's own forward cannot run: the first other
    batch = next(b for b in loader if b["input_ids"].shape[0] > 0)
    out = model(**batch)
    assert out.logits.shape[0] == batch["input_ids"].shape[0]


def test_a_length_per_example_is_accepted():
    ids, lengths, _ = _tokens()
    _dict_private(Lengths(), Dicts(input_ids=ids, lengths=lengths))


def test_mixing_through_the_batchs_token_counts_is_refused():
    ids, _, y = _tokens()
    with pytest.raises(ValueError, match=r"emb.*rule: batch independence"):
        _dict_private(BatchFrequency(), TensorDataset(ids % 8, y))  # 8 values: tokens shared across examples


class MeanOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(10, 3), nn.Linear(3, 2)

    def forward(self, ids):
        e = self.emb(ids)
        return self.lin(e - e.mean(0))


@pytest.mark.parametrize("rows", [1, 2])
def test_integer_mixing_is_seen_from_an_example_input_of_one_row(rows):
    """The probe batch repeats the example input's rows, so with one row every example holds the
    same ids: the next example's values alone would change nothing; rolled, they do."""
    from bpclip_fast.validate import dynamic_problems

    problems = dynamic_problems(MeanOverBatch(), torch.tensor([[1, 2, 3], [4, 5, 6]])[:rows])
    assert len(problems) == 1 and "batch independence" in problems[0], problems


def test_groups_set_after_conversion_is_refused():
    """The fused path is one Linear over all channels: a ``groups`` changed on the converted layer
    would be ignored silently (torch's own Conv3d would compute another function)."""
    model = bnn.convert_model(nn.Sequential(nn.Conv3d(4, 4, 3)), clipping="flat", max_grad_norm=1.0)
    model[0].groups = 2
    with pytest.raises(ValueError, match=r"groups=2.*generic"):
        model(torch.randn(2, 4, 5, 5, 5))


def test_a_no_grad_pass_before_the_training_pass_changes_nothing():
    """A teacher/EMA pass of the private model under no_grad (nothing expanded, nothing recorded),
    then the training pass: the release is per-example clipping in float64."""
    from test_broadcast_index import Positions, _check_step, _data, _private, _truth

    torch.manual_seed(0)
    model = Positions().double()
    reference, C = copy.deepcopy(model), 0.05
    model, opt, loader = _private(model, _data("toy"), "flat", C)
    x, y = next(iter(loader))
    opt.zero_grad()
    with torch.no_grad():
        model(x)
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    _check_step(model, opt, x, y, _truth(reference, model, x, y, "flat", C), C)
    opt.step()
