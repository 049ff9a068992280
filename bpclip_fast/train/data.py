"""Data sets of the reference trainer, as fixed train / validation / test splits of tensors.

* ``digits``: scikit-learn's bundled 8x8 digits (1,797 images, no download), scaled to [0, 1] and
  resized to 28x28 (bilinear) so that the MNIST nets apply; a fixed stratified split.
* ``mnist1d``, ``mnist1d-large``: MNIST-1D (Greydanus 2020, "Scaling down deep learning"), generated
  offline by the ``mnist1d`` package (``make_dataset`` with its default arguments, whose fixed seed 42
  makes every generation the same; never its download). ``mnist1d``: the package's default 5,000
  examples (4,000 train + 1,000 test, 10 classes, length 40, standardised to mean 0 and std 1 over the
  set); ``mnist1d-large``: ``num_samples`` 20,000 (16,000 + 4,000), the same generator and seed.
  Shape ``[N, 1, 40]``. A fixed stratified eighth of the training part is the validation split
  (3,500 / 500 / 1,000 and 14,000 / 2,000 / 4,000).
* ``mnist``, ``fmnist``: the idx files of MNIST / Fashion-MNIST (``*-ubyte`` or ``*-ubyte.gz``),
  the format torchvision reads and writes.
* ``cifar10``: the "python version" of CIFAR-10 (``cifar-10-batches-py/data_batch_1..5`` and
  ``test_batch``, pickled dicts), the format torchvision reads.

The readers are our own (torchvision is not a dependency). With ``download=True`` and torchvision
importable, missing files are fetched with torchvision's own downloaders first; otherwise a missing
file raises :class:`DatasetNotFound` naming the files expected and where to get them.

For mnist/fmnist/cifar10 the validation split is a fixed random subset of the official training
set (``val_size`` examples, 5,000 by default; permutation seeded by ``split_seed``), and the test
split is the official test set. Hyperparameters are chosen on the validation split only.
"""

from __future__ import annotations

import functools
import gzip
import os
import pickle
import random
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["DATASETS", "Splits", "DatasetNotFound", "load_dataset", "read_idx", "write_idx",
           "read_cifar10_batch", "write_cifar10_batch"]

DATASETS = ("digits", "mnist1d", "mnist1d-large", "mnist", "fmnist", "cifar10")

#: the number of examples MNIST-1D's generator makes (its ``train_split`` 0.8 of them are the training part)
MNIST1D_SAMPLES = {"mnist1d": 5000, "mnist1d-large": 20000}

# Where each data set's files are looked for, under --data-dir (torchvision's layouts first).
_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_SUBDIRS = {"mnist": ("MNIST/raw", "MNIST", "mnist", ""),
                "fmnist": ("FashionMNIST/raw", "FashionMNIST", "fashion-mnist", "fmnist", "")}
_SOURCES = {
    "mnist": "http://yann.lecun.com/exdb/mnist/ (or any mirror, e.g. the one torchvision.datasets.MNIST uses)",
    "fmnist": "https://github.com/zalandoresearch/fashion-mnist (data/fashion/)",
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz (unpack it: tar xzf ...)",
}
_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST = "test_batch"


class DatasetNotFound(FileNotFoundError):
    """A data set's files are not under --data-dir; the message names them and their source."""


@dataclass
class Splits:
    """Train / validation / test ``TensorDataset`` s of ``(float32 image [C,H,W] in [0,1], int64 label)``
    (MNIST-1D: ``[1, 40]`` signals, standardised rather than in [0, 1])."""

    name: str
    train: TensorDataset
    val: TensorDataset
    test: TensorDataset
    num_classes: int
    input_shape: tuple

    def sizes(self) -> dict:
        return {"train": len(self.train), "val": len(self.val), "test": len(self.test)}


# --------------------------------------------------------------------------- idx (MNIST, Fashion-MNIST)

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09}


def _open(path):
    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")


def read_idx(path) -> np.ndarray:
    """An idx file (``.gz`` or not): magic ``0x0000 <type> <ndim>``, ``ndim`` big-endian int32 sizes, data."""
    with _open(path) as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an idx file (bad magic number {raw[:4].hex()})")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    offset = 4 + 4 * ndim
    count = int(np.prod(shape)) if shape else 1
    if len(raw) - offset != count * dtype.itemsize:
        raise ValueError(f"{path}: idx header says shape {shape} but the file holds "
                         f"{len(raw) - offset} bytes of data")
    return np.frombuffer(raw, dtype=dtype, count=count, offset=offset).reshape(shape)


def write_idx(path, array) -> None:
    """Writes a uint8/int8 array as an idx file (gzip-compressed when ``path`` ends in ``.gz``)."""
    array = np.ascontiguousarray(array)
    if array.dtype not in _IDX_CODES:
        raise ValueError(f"write_idx: only uint8/int8 arrays, got {array.dtype}")
    header = bytes([0, 0, _IDX_CODES[array.dtype], array.ndim])
    header += np.asarray(array.shape, dtype=">i4").tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def _find(data_dir, subdirs, name):
    """The first of ``data_dir/<sub>/<name>[.gz]`` that exists, or None."""
    for sub in subdirs:
        for candidate in (name, name + ".gz"):
            path = os.path.join(data_dir, sub, candidate)
            if os.path.isfile(path):
                return path
    return None


def _idx_paths(name, data_dir):
    subdirs = _IDX_SUBDIRS[name]
    paths, missing = {}, []
    for split, files in _IDX_FILES.items():
        found = [_find(data_dir, subdirs, f) for f in files]
        missing += [f for f, p in zip(files, found) if p is None]
        paths[split] = found
    return paths, missing


def _missing_message(name, data_dir, files, where):
    return (f"{name}: cannot find {', '.join(files)} under {os.path.abspath(data_dir)!r} (looked in "
            f"{', '.join(repr(w) for w in where)}; '.gz' is fine too). Get them from {_SOURCES[name]}, "
            f"put them in {os.path.join(os.path.abspath(data_dir), where[0])!r} and pass --data-dir "
            f"{data_dir}; or, with network access and torchvision installed, add --download. "
            "The default --data digits needs no files.")


def _load_idx(name, data_dir):
    paths, missing = _idx_paths(name, data_dir)
    if missing:
        raise DatasetNotFound(_missing_message(name, data_dir, missing, [s or "." for s in _IDX_SUBDIRS[name]]))
    out = {}
    for split, (images, labels) in paths.items():
        x, y = read_idx(images), read_idx(labels)
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{name}: {images} has shape {x.shape} and {labels} {y.shape}; expected "
                             "[N, H, W] images and [N] labels")
        out[split] = (x[:, None].astype(np.float32) / 255.0, y.astype(np.int64))
    return out


# --------------------------------------------------------------------------- CIFAR-10 python batches

def read_cifar10_batch(path):
    """``(images uint8 [N,3,32,32], labels int64 [N])`` of one pickled CIFAR-10 batch file."""
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    d = {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}
    if "data" not in d or not ("labels" in d or "fine_labels" in d):
        raise ValueError(f"{path}: not a CIFAR-10 python batch (keys {sorted(d)})")
    data = np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    labels = np.asarray(d.get("labels", d.get("fine_labels")), dtype=np.int64)
    if len(data) != len(labels):
        raise ValueError(f"{path}: {len(data)} images but {len(labels)} labels")
    return data, labels


def write_cifar10_batch(path, images, labels) -> None:
    """Writes ``images`` (uint8 ``[N,3,32,32]``) and labels as a CIFAR-10 python batch file."""
    images = np.asarray(images, dtype=np.uint8)
    d = {b"batch_label": b"written by bpclip_fast", b"labels": [int(v) for v in labels],
         b"data": images.reshape(len(images), -1), b"filenames": [b"%d.png" % i for i in range(len(images))]}
    with open(path, "wb") as f:
        pickle.dump(d, f, protocol=2)


def _load_cifar10(data_dir):
    subdirs = (_CIFAR_DIR, "")
    files = _CIFAR_TRAIN + (_CIFAR_TEST,)
    found = {f: next((os.path.join(data_dir, s, f) for s in subdirs
                      if os.path.isfile(os.path.join(data_dir, s, f))), None) for f in files}
    missing = [f for f, p in found.items() if p is None]
    if missing:
        raise DatasetNotFound(_missing_message("cifar10", data_dir, missing, [_CIFAR_DIR, "."]))
    train = [read_cifar10_batch(found[f]) for f in _CIFAR_TRAIN]
    xtr = np.concatenate([x for x, _ in train]).astype(np.float32) / 255.0
    ytr = np.concatenate([y for _, y in train])
    xte, yte = read_cifar10_batch(found[_CIFAR_TEST])
    return {"train": (xtr, ytr), "test": (xte.astype(np.float32) / 255.0, yte)}


# --------------------------------------------------------------------------- torchvision download

def _download(name, data_dir):
    try:
        import torchvision.datasets as tvd
    except ImportError as exc:
        raise DatasetNotFound(f"--download needs torchvision (pip install torchvision); {exc}") from None
    cls = {"mnist": tvd.MNIST, "fmnist": tvd.FashionMNIST, "cifar10": tvd.CIFAR10}[name]
    for train in (True, False):
        cls(data_dir, train=train, download=True)


# --------------------------------------------------------------------------- splits

def _tensors(x, y):
    return TensorDataset(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y)))


def _digits(split_seed):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = torch.from_numpy((X / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    X = torch.nn.functional.interpolate(X, size=(28, 28), mode="bilinear", align_corners=False).clamp_(0, 1)
    X = X.numpy()
    idx = np.arange(len(y))
    # 1797 = 1167 train + 270 validation + 360 test, stratified; fixed for every run.
    rest, test = train_test_split(idx, test_size=360, random_state=split_seed, stratify=y)
    train, val = train_test_split(rest, test_size=270, random_state=split_seed, stratify=y[rest])
    return {"train": (X[train], y[train]), "val": (X[val], y[val]), "test": (X[test], y[test])}


@functools.lru_cache(maxsize=2)
def _mnist1d_arrays(num_samples):
    """``(x_train, y_train, x_test, y_test)`` of MNIST-1D with ``num_samples`` examples, read-only.

    Cached: a sweep runs many configurations in one process and generation takes seconds. The
    generator seeds and draws from numpy's and Python's global generators; their states are put
    back, so that loading the data does not change the run's own seeding."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:
        raise DatasetNotFound(f"--data mnist1d needs the mnist1d package (pip install mnist1d==0.0.2.post1, "
                              f"or pip install -e .[train]); {exc}") from None
    args = get_dataset_args()
    args.num_samples = num_samples
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        d = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    out = (d["x"].astype(np.float32)[:, None], d["y"].astype(np.int64),
           d["x_test"].astype(np.float32)[:, None], d["y_test"].astype(np.int64))
    for a in out:
        a.flags.writeable = False
    return out


def _mnist1d(name, split_seed):
    from sklearn.model_selection import train_test_split

    xtr, ytr, xte, yte = _mnist1d_arrays(MNIST1D_SAMPLES[name])
    # a fixed stratified eighth of the training part for validation (500 of 4,000; 2,000 of 16,000)
    train, val = train_test_split(np.arange(len(ytr)), test_size=len(ytr) // 8, random_state=split_seed,
                                  stratify=ytr)
    return {"train": (xtr[train], ytr[train]), "val": (xtr[val], ytr[val]), "test": (xte.copy(), yte.copy())}


def load_dataset(name: str = "digits", data_dir: str = "data", *, val_size: int = 5000, split_seed: int = 0,
                 download: bool = False, limit: int | None = None) -> Splits:
    """The train / validation / test splits of ``name`` (one of :data:`DATASETS`).

    ``limit``: keep only the first ``limit`` examples of each split (quick runs, tests).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    if name == "digits":
        parts = _digits(split_seed)
    elif name in MNIST1D_SAMPLES:
        parts = _mnist1d(name, split_seed)
    else:
        loader = _load_cifar10 if name == "cifar10" else (lambda d: _load_idx(name, d))
        try:
            parts = loader(data_dir)
        except DatasetNotFound:
            if not download:
                raise
            _download(name, data_dir)
            parts = loader(data_dir)
        xtr, ytr = parts["train"]
        if not 0 < val_size < len(xtr):
            raise ValueError(f"{name}: val_size must be in (0, {len(xtr)}), got {val_size}")
        perm = np.random.default_rng(split_seed).permutation(len(xtr))
        val, train = perm[:val_size], perm[val_size:]
        parts = {"train": (xtr[train], ytr[train]), "val": (xtr[val], ytr[val]), "test": parts["test"]}
    if limit is not None:
        parts = {k: (x[:limit], y[:limit]) for k, (x, y) in parts.items()}
    num_classes = 10
    return Splits(name=name, train=_tensors(*parts["train"]), val=_tensors(*parts["val"]),
                  test=_tensors(*parts["test"]), num_classes=num_classes,
                  input_shape=tuple(parts["train"][0].shape[1:]))
