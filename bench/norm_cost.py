"""The per-example norm cost rule, measured: ghost against instantiation on the layers of our models.

    python -m bench.norm_cost [--device cpu] [--reps 5]

For each layer shape (Linear with T positions, Conv2d) it times ``linear_grad_norms`` /
``conv2d_grad_norms`` with ``method="ghost"`` and ``"instantiate"`` on random data, and prints which
was faster next to the choice of ``auto`` (``csrc/exact.cpp``: ghost iff ``T = 1`` or
``T(d + p) < d·p``). A row where ``auto`` picked the slower method by more than 20% is marked.
"""

from __future__ import annotations

import argparse
import time

import torch

import bpclip_fast  # noqa: F401  (loads the ops)

OPS = torch.ops.bpclip_fast

# (label, kind, batch, shape): Linear (T, d, p); Conv2d (C_in, H, W, C_out, k, stride, padding, groups)
CASES = [
    ("mnist conv1", "conv", 512, (1, 28, 28, 16, 8, 2, 3, 1)),
    ("mnist conv2", "conv", 512, (16, 13, 13, 32, 4, 2, 0, 1)),
    ("cifar conv1", "conv", 32, (3, 32, 32, 32, 3, 1, 1, 1)),
    ("cifar conv2", "conv", 32, (32, 32, 32, 64, 3, 1, 1, 1)),
    ("cifar conv4", "conv", 32, (128, 16, 16, 128, 3, 1, 1, 1)),
    ("resnet 64ch 8x8", "conv", 32, (64, 8, 8, 64, 3, 1, 1, 1)),
    ("depthwise 32ch", "conv", 32, (32, 16, 16, 32, 3, 1, 1, 32)),
    ("linear T=16 d=p=64", "linear", 64, (16, 64, 64)),
    ("linear T=64 d=p=64", "linear", 64, (64, 64, 64)),
    ("linear T=128 d=p=512", "linear", 32, (128, 512, 512)),
    ("linear T=512 d=p=128", "linear", 16, (512, 128, 128)),
]


def _args(kind, batch, shape, device):
    if kind == "linear":
        t, d, p = shape
        x, g = torch.randn(batch, t, d, device=device), torch.randn(batch, t, p, device=device)
        return lambda m: OPS.linear_grad_norms(g, x, [True, True], m, 64 << 20, False), (t, d, p)
    cin, h, w, cout, k, s, pad, groups = shape
    x = torch.randn(batch, cin, h, w, device=device)
    ho, wo = (h + 2 * pad - k) // s + 1, (w + 2 * pad - k) // s + 1
    g = torch.randn(batch, cout, ho, wo, device=device)
    fn = lambda m: OPS.conv2d_grad_norms(g, x, [k, k], [s, s], [pad, pad], [1, 1], groups, [True, True], m,  # noqa: E731
                                         64 << 20, False)
    return fn, (ho * wo, cin // groups * k * k, cout // groups)


def _time(fn, method, reps, device):
    fn(method)
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(method)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.norm_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    print("| layer | B | T | d | p | ghost ms | instantiate ms | faster | auto picks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, kind, batch, shape in CASES:
        fn, (t, d, p) = _args(kind, batch, shape, args.device)
        ghost, inst = _time(fn, "ghost", args.reps, args.device), _time(fn, "instantiate", args.reps, args.device)
        auto = "ghost" if t == 1 or t * (d + p) < d * p else "instantiate"
        faster = "ghost" if ghost < inst else "instantiate"
        slow = (ghost if auto == "ghost" else inst) > 1.2 * min(ghost, inst)
        print(f"| {label} | {batch} | {t} | {d} | {p} | {ghost:.1f} | {inst:.1f} | {faster} | "
              f"{auto}{' **(slower)**' if slow else ''} |")


if __name__ == "__main__":
    main()
