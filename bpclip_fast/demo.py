"""``make demo``: the reference trainer's ``bpclip`` run on scikit-learn's digits (no download).

    python -m bpclip_fast.demo [any bpclip-train option, e.g. --epsilon 1 --out runs/demo]

is ``bpclip-train --method bpclip --data digits --epsilon 3`` (the paper's MNIST net with tanh,
Poisson sampling, RDP accountant, δ = 1e-5); it prints the test accuracy and the ε spent. Later
options override these. About 10 s on a 2-core CPU. See ``bpclip-train --help``.
"""

from __future__ import annotations

import numpy as np
import torch

DEMO_ARGS = ["--method", "bpclip", "--data", "digits", "--epsilon", "3"]


def load_data(split_seed: int = 0):
    """Digits as ``[N,1,8,8]`` float32 in [0, 1]; a fixed stratified 80/20 split (train, test).

    For the README's first example (``models.digits_net``); the trainer's own digits split
    (28x28, train/validation/test) is ``bpclip_fast.train.data.load_dataset("digits")``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.2, random_state=split_seed, stratify=y)
    return (torch.from_numpy(Xtr), torch.from_numpy(ytr).long(),
            torch.from_numpy(Xte), torch.from_numpy(yte).long())


def main(argv=None):
    import sys

    from .train.cli import main as train_main

    argv = list(sys.argv[1:] if argv is None else argv)
    print("bpclip_fast demo: backpropagation clipping on scikit-learn's digits, epsilon 3 at delta 1e-5 "
          "(bpclip-train " + " ".join(DEMO_ARGS + argv) + ")")
    return train_main(DEMO_ARGS + argv)


if __name__ == "__main__":
    main()
