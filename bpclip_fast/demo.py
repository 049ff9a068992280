"""Backpropagation-clipped training of a small CNN on scikit-learn's 8x8 digits (no downloads).

    python -m bpclip_fast.demo [--epochs 30] [--batch-size 128] [--sigma 1.0] ...

A stand-in until the reference trainer (``bpclip_fast.train``) exists. It shows the per-step
protocol of the ``bpclip_fast.nn`` API: set each clipped layer's ``noise_multiplier``, arm the
noise stream, forward, backward, ``check_finite``, optimizer step. No privacy guarantee (epsilon)
is computed or claimed here; accounting comes with the trainer.

``--backend reference`` runs the same maths with the plain-PyTorch hooks of
``bpclip_fast.reference`` (noise from ``torch.randn``), which needs no compiled extension.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .models import digits_net


def load_data(split_seed: int = 0):
    """Digits as ``[N,1,8,8]`` float32 in [0, 1]; a fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.2, random_state=split_seed, stratify=y)
    return (torch.from_numpy(Xtr), torch.from_numpy(ytr).long(),
            torch.from_numpy(Xte), torch.from_numpy(yte).long())


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bpclip_fast.demo", description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--sigma", type=float, default=1.0, help="noise multiplier of every layer")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    p.add_argument("--input-clip", type=float, default=2.0, help="C_x, per-example L2 bound on inputs")
    p.add_argument("--grad-clip", type=float, default=0.5, help="C_g, per-example bound on upstream grads")
    p.add_argument("--seed", type=int, default=0, help="model init and batch shuffle (not the noise)")
    p.add_argument("--noise-seed", type=int, default=None,
                   help="explicit noise seed: reproducible but INSECURE (default: OS entropy)")
    p.add_argument("--backend", choices=("nn", "reference"), default="nn",
                   help="'nn': bpclip_fast.nn fused layers (default); 'reference': plain hooks")
    return p.parse_args(argv)


class _NNBackend:
    """The library's clipped layers; noise is added inside their backward once armed."""

    def __init__(self, model, args):
        from . import nn as bnn

        self.bnn = bnn
        self.model = bnn.convert_model(model, input_clip=args.input_clip, grad_clip=args.grad_clip)
        self.layers = [layer for _, layer in bnn.clipped_layers(self.model)]
        self.stream = bnn.NoiseStream(args.noise_seed)
        self.sigma = args.sigma

    def before_forward(self):
        for layer in self.layers:
            layer.noise_multiplier = self.sigma
        self.bnn.arm_noise(self.model, self.stream)

    def after_backward(self):
        # One host sync per step: turns any non-finite example count into an error naming the layer.
        self.bnn.check_finite(self.model)

    def describe(self):
        secure = getattr(self.stream, "secure", None)
        lines = [f"  {name}: sensitivity {layer.sensitivity:.4g}, noise std {self.sigma * layer.sensitivity:.4g}"
                 for name, layer in self.bnn.clipped_layers(self.model)]
        lines.append(f"  noise stream: {'secure OS-entropy seed' if secure else 'explicit seed (INSECURE)'}")
        return "\n".join(lines)


class _ReferenceBackend:
    """The hook oracle; noise is added to .grad after backward with torch.randn."""

    def __init__(self, model, args):
        from . import reference as ref

        self.ref = ref
        self.model = model
        self.args = args
        ref.attach(model, input_clip=args.input_clip, grad_clip=args.grad_clip)
        self.shapes, _ = ref.record_input_shapes(model)
        self.gen = torch.Generator()
        if args.noise_seed is not None:
            self.gen.manual_seed(args.noise_seed)
        else:
            self.gen.seed()

    def before_forward(self):
        pass

    def after_backward(self):
        for p in self.model.parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                raise FloatingPointError("non-finite gradient")
        self.ref.add_noise(self.model, self.args.sigma, input_clip=self.args.input_clip,
                           grad_clip=self.args.grad_clip, input_shapes=self.shapes, generator=self.gen)

    def describe(self):
        return "  reference hooks (bpclip_fast.reference), noise from torch.randn"


def evaluate(model, X, y, batch_size=512):
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(X), batch_size):
            correct += (model(X[i:i + batch_size]).argmax(1) == y[i:i + batch_size]).sum().item()
    model.train()
    return correct / len(X)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    Xtr, ytr, Xte, yte = load_data()

    if args.backend == "nn":
        from .nn import TemperedSigmoid

        backend = _NNBackend(digits_net(act=TemperedSigmoid), args)  # default (2, 2, 1) = tanh
    else:
        backend = _ReferenceBackend(digits_net(act=nn.Tanh), args)
    model = backend.model
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    shuffle = torch.Generator().manual_seed(args.seed)
    B = args.batch_size
    steps = len(Xtr) // B  # disjoint fixed-size batches; the remainder is dropped each epoch

    print("NOTE: stand-in demo until the bpclip_fast trainer exists. Noise is calibrated to each "
          "layer's sensitivity, but no privacy accounting is done: no epsilon is claimed here.")
    print(f"train {len(Xtr)} / test {len(Xte)}, batch {B}, {steps} steps/epoch, sigma {args.sigma}, "
          f"C_x {args.input_clip}, C_g {args.grad_clip}, backend {args.backend}")
    with torch.no_grad():
        model(Xtr[:B])  # records input shapes, so the sensitivities below are the training ones
    print(backend.describe())
    t0 = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(Xtr), generator=shuffle)
        total = 0.0
        for s in range(steps):
            idx = perm[s * B:(s + 1) * B]
            opt.zero_grad(set_to_none=True)
            backend.before_forward()
            out = model(Xtr[idx])
            # Sum, not mean: with mean the upstream gradient of each example is scaled by 1/B, so
            # grad_clip would no longer be the per-example bound the noise is calibrated to.
            loss = F.cross_entropy(out, ytr[idx], reduction="sum")
            loss.backward()
            backend.after_backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(B)  # noisy sum -> noisy mean (scales the noise too)
            opt.step()
            total += loss.item()
        print(f"epoch {epoch:3d}  train loss {total / (steps * B):.4f}  "
              f"test acc {evaluate(model, Xte, yte):.4f}  ({time.perf_counter() - t0:.1f}s)")
    acc = evaluate(model, Xte, yte)
    print(f"final test accuracy: {acc:.4f}  ({time.perf_counter() - t0:.1f}s)")
    return acc


if __name__ == "__main__":
    main()
