"""Batches of any shape (issue 26): how ``make_private`` and its probes split a collated batch.

The convention is Opacus users' loop: a tuple batch is ``(*inputs, label)``, the model called as
``model(*batch[:-1])`` and the loss on the last element; ``make_private(..., batch_inputs=k)``
names how many leading elements are model inputs where the batch ends in several targets
(``(x, y1, y2)``: ``batch_inputs=1``); a dict batch is ``model(**batch)``; a lone tensor is
``model(batch)``. ``bpclip_fast/batches.py`` is the one home of the rule.

Releases are checked with the noise off (σ = 1e-20: the engine requires σ > 0, and σΔ/d within the
kernels' range) against per-example clipping computed in float64 from batches of one, with every
example sampled (sample rate 1).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import bpclip_fast
from bpclip_fast import PrivacyEngine, StepRefused
from bpclip_fast.engine import InsecureSeedWarning

N, VOCAB, T, K = 6, 11, 5, 3
IMAGE = (1, 3, 3)
C = 1.7  # some examples' gradients are clipped, some are not (both branches of min(1, C/n))
SEED = 1234
NO_NOISE = 1e-20  # σ must be positive; σ·C = 7e-21 is below every tolerance here by 10 orders


class TwoInputs(nn.Module):
    """``model(tokens, image)``: an Embedding averaged over the tokens and a Linear over the image."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 4)
        self.img = nn.Linear(math.prod(IMAGE), 4)
        self.head = nn.Linear(8, K)

    def forward(self, tokens, image):
        return self.head(torch.tanh(torch.cat([self.emb(tokens).mean(1), self.img(image.flatten(1))], 1)))


class OneInput(nn.Module):
    def __init__(self, out=K + 1):
        super().__init__()
        torch.manual_seed(1)
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def two_input_data(n=N):
    g = torch.Generator().manual_seed(5)
    return (torch.randint(0, VOCAB, (n, T), generator=g), torch.randn(n, *IMAGE, generator=g),
            torch.randint(0, K, (n,), generator=g))


def private(model, loader, **kw):
    kw.setdefault("clipping", "flat")
    kw.setdefault("max_grad_norm", C)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureSeedWarning)
        return bpclip_fast.PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader,
                                                        noise_multiplier=kw.pop("sigma", NO_NOISE),
                                                        noise_seed=SEED, **kw)


def truth(plain, private_model, per_example_loss, examples, mode="flat", both=True):
    """Σ_i c_i G_i / N in float64: ``plain`` (a twin of the private model's architecture) takes the
    private model's current values; ``per_example_loss(model, i)`` is example i's loss alone.
    ``both``: some examples are clipped and some are not (checked where the data make it so)."""
    ref = copy.deepcopy(plain)
    ref.load_state_dict({k: v.detach() for k, v in private_model.state_dict().items()})
    ref = ref.double()
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    params = [p for p in ref.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    clipped = 0
    for i in range(examples):
        grads = torch.autograd.grad(per_example_loss(ref, i), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        if mode == "flat":
            norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
            factors = [min(1.0, C / norm) if norm > 0 else 1.0] * len(grads)
            clipped += norm > C
        else:
            raise AssertionError(mode)
        total = [t + f * g for t, f, g in zip(total, factors, grads)]
    assert not both or 0 < clipped < examples  # the release checks the factor and the unclipped sum alike
    return {n: t / examples for n, t in zip(names, total)}


def tolerance(model) -> float:
    """Each released coordinate is a mean of N terms of size ≤ C, computed in float32 through the
    forward and backward of a few small layers and a flat norm over P parameters: a relative
    rounding of at most (P + 64)·u per term (recursive summation of P squares; 64 for the dot products
    of length ≤ 9, the tanh, the mean over T tokens and the factor), so (P + 64)·u·C for the mean."""
    params = sum(p.numel() for p in model.parameters())
    return (params + 64) * torch.finfo(torch.float32).eps / 2 * C


def assert_release(model, before, expect, tol):
    moved = {n: p.detach().double() - before[n] for n, p in model.named_parameters()}
    assert set(moved) == set(expect)
    assert max(float(v.abs().max()) for v in expect.values()) > 100 * tol  # the step releases something
    for n in expect:
        err = float((-moved[n] - expect[n]).abs().max())
        assert err <= tol, (n, err, tol)


def snapshot(model):
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------ several inputs


def test_a_two_input_model_trains_with_the_label_last_and_releases_the_clipped_float64_truth():
    tokens, image, y = two_input_data()
    plain = TwoInputs()
    loader = DataLoader(TensorDataset(tokens, image, y), batch_size=N)
    crit = nn.CrossEntropyLoss()
    model, opt, loader = private(copy.deepcopy(plain), loader, criterion=crit)
    tol = tolerance(model)

    def loss_one(ref, i):
        return F.cross_entropy(ref(tokens[i:i + 1], image[i:i + 1].double()), y[i:i + 1], reduction="sum")

    for _ in range(3):
        for *inputs, target in loader:
            assert len(inputs) == 2 and len(target) == N  # sample rate 1: every example
            expect = truth(plain, model, loss_one, N)
            before = snapshot(model)
            opt.zero_grad()
            loss = crit(model(*inputs), target)
            loss.backward()
            opt.step()
            assert_release(model, before, expect, tol)


def test_max_input_shape_takes_one_shape_per_input():
    tokens, image, y = two_input_data()
    loader = DataLoader(TensorDataset(tokens, image, y), batch_size=N)
    model, _, _ = private(TwoInputs(), loader, max_input_shape=((T + 3,), IMAGE))
    assert model.emb.max_input_shape == (T + 3,)  # the token input's shape, probed with integer zeros
    assert model.img.max_input_shape == (math.prod(IMAGE),)


class SeqAndImage(nn.Module):
    """A biased Linear over ``[B, T, d]`` (under backprop its Δ grows with T) and one over an image."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.seq = nn.Linear(4, 4)
        self.img = nn.Linear(math.prod(IMAGE), 4)
        self.head = nn.Linear(8, K)

    def forward(self, seq, image):
        return self.head(torch.cat([self.seq(seq).mean(1), self.img(image.flatten(1))], 1))


def backprop_private(model, loader, **kw):
    return private(model, loader, clipping="backprop", max_grad_norm=None, input_clip=1.0, grad_clip=1.0, **kw)


def seq_data(t=T):
    g = torch.Generator().manual_seed(6)
    return torch.randn(N, t, 4, generator=g), torch.randn(N, *IMAGE, generator=g), torch.randint(0, K, (N,), generator=g)


def test_a_shape_dependent_layer_of_a_second_input_gets_its_declared_shape_and_refuses_longer_inputs():
    seq, image, y = seq_data()
    loader = DataLoader(TensorDataset(seq, image, y), batch_size=N)
    with pytest.raises(ValueError, match="max_input_shape"):
        backprop_private(SeqAndImage(), loader)  # Δ of seq depends on T: it must be declared
    model, opt, loader = backprop_private(SeqAndImage(), loader, max_input_shape=((T, 4), IMAGE))
    assert model.seq.max_input_shape == (T, 4)
    longer = seq_data(T + 1)
    opt.zero_grad()
    for _ in loader:  # the one batch of the step, drawn as the loop must
        with pytest.raises(StepRefused) as info:
            F.cross_entropy(model(longer[0], longer[1]), longer[2]).backward()
    assert info.value.rule == "max-shape"


def test_max_input_shape_with_the_wrong_number_of_shapes_is_refused():
    seq, image, y = seq_data()
    loader = DataLoader(TensorDataset(seq, image, y), batch_size=N)
    with pytest.raises(ValueError, match=r"max_input_shape.*2 inputs.*one shape per input"):
        backprop_private(SeqAndImage(), loader, max_input_shape=(T, 4))  # one shape for two inputs
    with pytest.raises(ValueError, match=r"max_input_shape.*3 shapes.*2 inputs"):
        backprop_private(SeqAndImage(), loader, max_input_shape=((T, 4), IMAGE, (1,)))
    with pytest.raises(ValueError, match="max_input_shape"):
        backprop_private(SeqAndImage(), loader, max_input_shape=((T, 4), 3))  # neither a shape nor shapes


# ------------------------------------------------------------------------------ the split's errors


def test_a_wrong_split_is_a_clear_error_naming_batch_inputs():
    tokens, image, y = two_input_data()
    loader = DataLoader(TensorDataset(tokens, image, y), batch_size=N)
    with pytest.raises(ValueError) as info:
        private(TwoInputs(), loader, batch_inputs=1)
    text = str(info.value)
    assert "model(batch[0])" in text and "batch_inputs" in text and "TypeError" in text, text
    assert "batch_inputs=2" in text, text  # what forward(tokens, image) takes, read from its signature


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "1"])
def test_batch_inputs_must_be_a_positive_integer(value):
    loader = DataLoader(TensorDataset(*two_input_data()), batch_size=N)
    with pytest.raises((TypeError, ValueError), match="batch_inputs must be a positive integer"):
        private(TwoInputs(), loader, batch_inputs=value)


def test_batch_inputs_beyond_the_batch_is_refused():
    loader = DataLoader(TensorDataset(*two_input_data()), batch_size=N)
    with pytest.raises(ValueError, match=r"batch_inputs=4.*3 elements"):
        private(TwoInputs(), loader, batch_inputs=4)


# ------------------------------------------------------------------------------ several targets


def two_targets_data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, 6, generator=g), torch.randint(0, K, (N,), generator=g), torch.randn(N, generator=g)


def two_targets_loss(out, y1, y2, reduction="mean"):
    """A class and a regression target: ``criterion(output, y1, y2)``."""
    return F.cross_entropy(out[:, :K], y1, reduction=reduction) + F.mse_loss(out[:, K], y2, reduction=reduction)


def test_several_targets_with_the_default_split_are_a_clear_error():
    loader = DataLoader(TensorDataset(*two_targets_data()), batch_size=N)
    with pytest.raises(ValueError) as info:
        private(OneInput(), loader, criterion=two_targets_loss)
    text = str(info.value)
    assert "model(batch[0], batch[1])" in text and "batch_inputs=1" in text, text


def test_several_targets_with_batch_inputs_one_train_and_release_the_clipped_float64_truth():
    x, y1, y2 = two_targets_data()
    plain = OneInput()
    loader = DataLoader(TensorDataset(x, y1, y2), batch_size=N)
    model, opt, loader = private(copy.deepcopy(plain), loader, batch_inputs=1, criterion=two_targets_loss)
    tol = tolerance(model)

    def loss_one(ref, i):
        return two_targets_loss(ref(x[i:i + 1].double()), y1[i:i + 1], y2[i:i + 1].double(), reduction="sum")

    for step in range(2):
        for xb, t1, t2 in loader:
            expect = truth(plain, model, loss_one, N, both=step == 0)
            before = snapshot(model)
            opt.zero_grad()
            two_targets_loss(model(xb), t1, t2).backward()
            opt.step()
            assert_release(model, before, expect, tol)


def test_the_criterion_probe_sees_every_target_of_the_split():
    """A loss coupled through its second target (examples weighted by |y2| over the batch's mean
    |y2|) is refused: the probe passed it both targets, as the loop does."""
    loader = DataLoader(TensorDataset(*two_targets_data()), batch_size=N)

    def coupled(out, y1, y2):
        return (F.cross_entropy(out[:, :K], y1, reduction="none") * y2.abs() / y2.abs().mean()).mean()

    with pytest.raises(ValueError, match="coupled loss"):
        private(OneInput(), loader, batch_inputs=1, criterion=coupled)


# ------------------------------------------------------------------------------ dict batches


class DictData(Dataset):
    def __init__(self):
        self.tokens, self.image, self.labels = two_input_data()

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"tokens": self.tokens[i], "image": self.image[i], "labels": self.labels[i]}


class DictModel(TwoInputs):
    """Hugging Face style: ``model(**batch)`` with the labels inside, the loss returned."""

    def forward(self, tokens, image, labels, reduction="mean"):
        return F.cross_entropy(super().forward(tokens, image), labels, reduction=reduction)


def test_a_dict_batch_is_called_with_keywords_and_releases_the_clipped_float64_truth():
    data = DictData()
    plain = DictModel()
    model, opt, loader = private(copy.deepcopy(plain), DataLoader(data, batch_size=N))
    tol = tolerance(model)

    def loss_one(ref, i):
        return ref(data.tokens[i:i + 1], data.image[i:i + 1].double(), data.labels[i:i + 1], reduction="sum")

    for _ in range(2):
        for batch in loader:
            expect = truth(plain, model, loss_one, N)
            before = snapshot(model)
            opt.zero_grad()
            model(**batch).backward()
            opt.step()
            assert_release(model, before, expect, tol)


def test_batch_inputs_with_a_dict_batch_is_refused():
    with pytest.raises(ValueError, match=r"batch_inputs.*dict"):
        private(DictModel(), DataLoader(DictData(), batch_size=N), batch_inputs=1)


def test_max_input_shape_of_a_dict_batch_takes_one_shape_per_key():
    model, _, _ = private(DictModel(), DataLoader(DictData(), batch_size=N),
                          max_input_shape={"tokens": (T + 2,), "image": IMAGE, "labels": ()})
    assert model.emb.max_input_shape == (T + 2,)
    with pytest.raises(ValueError, match=r"max_input_shape.*labels"):
        private(DictModel(), DataLoader(DictData(), batch_size=N), max_input_shape={"tokens": (T,), "image": IMAGE})


# ------------------------------------------------------------------------------ the one home of the rule


def test_every_probe_uses_the_one_split():
    """make_private's static probe, the dynamic probes and the criterion probe take the split from
    bpclip_fast.batches: a split that disagrees anywhere would call the model differently there."""
    from bpclip_fast import batches

    seen = []
    original = batches.split_batch

    def spy(batch, batch_inputs=None):
        seen.append(batch_inputs)
        return original(batch, batch_inputs)

    batches.split_batch = spy
    try:
        loader = DataLoader(TensorDataset(*two_targets_data()), batch_size=N)
        private(OneInput(), loader, batch_inputs=1, criterion=two_targets_loss)
    finally:
        batches.split_batch = original
    assert seen.count(1) >= 3, seen  # static probe, dynamic probes, criterion probe


def test_a_mapping_batch_that_is_not_a_dict_is_called_with_keywords():
    """Hugging Face's BatchEncoding is a UserDict, not a dict: it is a dict batch all the same."""
    from collections import UserDict

    class Encoding(UserDict):
        pass

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, labels):
            return nn.functional.cross_entropy(self.lin(x), labels, reduction="sum")

    items = [{"x": torch.randn(4), "labels": torch.tensor(i % 3)} for i in range(16)]
    loader = DataLoader(items, batch_size=8,
                        collate_fn=lambda b: Encoding({k: torch.stack([e[k] for e in b]) for k in b[0]}))
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader,
                                                      noise_multiplier=1.0, max_grad_norm=1.0, clipping="flat",
                                                      loss_reduction="sum")
    before = model.lin.weight.detach().clone()
    for batch in loader:
        opt.zero_grad()
        model(**batch).backward()
        opt.step()
    assert not torch.equal(before, model.lin.weight)
