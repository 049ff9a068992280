"""The trainer's MNIST-1D data sets (``--data mnist1d``, ``mnist1d-large``; issue 27) and their net.

The generator takes a couple of seconds for the default 5,000 examples, so the default set is
generated once for the module; ``mnist1d-large`` is checked with its size shrunk (the plumbing is
the same, only ``num_samples`` differs)."""

import random

import numpy as np
import pytest
import torch

mnist1d_data = pytest.importorskip("mnist1d.data")

from bpclip_fast import models  # noqa: E402
from bpclip_fast.train import data  # noqa: E402
from bpclip_fast.train.trainer import MODELS, Config, default_model, run  # noqa: E402


@pytest.fixture(scope="module")
def splits():
    return data.load_dataset("mnist1d")


@pytest.fixture(scope="module")
def package_set():
    """The package's own generation of its default set (its seed 42), the truth the splits come from."""
    return mnist1d_data.make_dataset(mnist1d_data.get_dataset_args())


def rows(ds):
    return {x.numpy().tobytes() for x in ds.tensors[0]}


def test_shapes_dtypes_classes_and_sizes(splits):
    assert splits.sizes() == {"train": 3500, "val": 500, "test": 1000}
    assert splits.input_shape == (1, 40) and splits.num_classes == 10
    for part in (splits.train, splits.val, splits.test):
        x, y = part.tensors
        assert x.dtype == torch.float32 and x.shape[1:] == (1, 40) and y.dtype == torch.int64
        assert set(y.tolist()) == set(range(10))  # every class in every split
    # the validation split is stratified: each class's share is within one example of the training part's
    val_counts = torch.bincount(splits.val.tensors[1], minlength=10).double()
    train_counts = torch.bincount(splits.train.tensors[1], minlength=10).double()
    assert torch.all((val_counts - train_counts * 500 / 3500).abs() <= 1)


def test_splits_are_the_packages_train_and_test_parts_without_overlap(splits, package_set):
    train, val, test = rows(splits.train), rows(splits.val), rows(splits.test)
    # every example is distinct (continuous noise), so equal rows would be the same example twice
    assert len(train) == 3500 and len(val) == 500 and len(test) == 1000
    assert not (train & val) and not (train & test) and not (val & test)
    truth_train = {x.astype(np.float32)[None].tobytes() for x in package_set["x"]}
    truth_test = {x.astype(np.float32)[None].tobytes() for x in package_set["x_test"]}
    assert train | val == truth_train and test == truth_test
    # and the labels travel with their examples
    label_of = {x.astype(np.float32)[None].tobytes(): int(y) for x, y in zip(package_set["x"], package_set["y"])}
    for x, y in zip(*splits.val.tensors):
        assert label_of[x.numpy().tobytes()] == int(y)


def test_generation_is_deterministic_and_leaves_the_global_rngs_alone(splits):
    data._mnist1d_arrays.cache_clear()  # regenerate, not the module's cached copy
    np.random.seed(123)
    random.seed(123)
    expect_np, expect_py = np.random.random(), random.random()
    np.random.seed(123)
    random.seed(123)
    again = data.load_dataset("mnist1d")
    assert np.random.random() == expect_np and random.random() == expect_py
    for a, b in ((splits.train, again.train), (splits.val, again.val), (splits.test, again.test)):
        assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    other = data.load_dataset("mnist1d", split_seed=1)  # another carve of the same training part
    assert not torch.equal(other.val.tensors[0], again.val.tensors[0])
    assert rows(other.train) | rows(other.val) == rows(again.train) | rows(again.val)


def test_large_set_has_its_own_size(monkeypatch):
    monkeypatch.setitem(data.MNIST1D_SAMPLES, "mnist1d-large", 2000)
    s = data.load_dataset("mnist1d-large")
    assert s.sizes() == {"train": 1400, "val": 200, "test": 400}
    assert s.input_shape == (1, 40)


def test_the_real_large_size_is_four_times_the_default():
    assert data.MNIST1D_SAMPLES == {"mnist1d": 5000, "mnist1d-large": 20000}


def test_mnist1d_net_shapes_and_default_model():
    net = models.mnist1d_net(act=torch.nn.Tanh)
    assert net(torch.zeros(3, 1, 40)).shape == (3, 10)
    assert all(isinstance(m, (torch.nn.Conv1d, torch.nn.Linear)) for m in net.modules()
               if any(p.requires_grad for p in m.parameters(recurse=False)))
    assert default_model("mnist1d") == default_model("mnist1d-large") == "mnist1d"
    assert MODELS["mnist1d"].build is models.mnist1d_net


@pytest.mark.parametrize("method,noise", [("flat", "independent"), ("flat", "banded"),
                                          ("per-layer", "independent"), ("bpclip", "independent")])
def test_every_clipping_mode_trains_on_mnist1d(method, noise):
    extra = {"noise": "banded", "bands": 4} if noise == "banded" else {}
    r = run(Config(data="mnist1d", method=method, limit=200, epochs=1, batch_size=32, optimizer="sgd", lr=0.01,
                   activation="tanh", epsilon=3.0, progress=False, threads=1, **extra))
    assert r["config"]["model"] == "mnist1d" and r["data"]["input_shape"] == [1, 40]
    assert 0.0 <= r["test_accuracy"] <= 1.0 and r["epsilon"] <= 3.0


def test_a_2d_model_on_mnist1d_is_refused_by_name():
    with pytest.raises(ValueError, match=r"--model mnist .*1-D.*--model auto"):
        run(Config(data="mnist1d", model="mnist", method="flat", limit=64, epochs=1, progress=False, threads=1))
