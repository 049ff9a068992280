"""Effective memory bandwidth of the bandwidth-bound kernels, against a plain copy on the same device.

    .venv/bin/python bench/kernel_bandwidth.py [--device cpu|cuda] [--threads N]

Bytes counted are the minimum each op must move (reads + writes of its tensors); a copy of the
same tensor is the practical limit. The first part of the issue-5 benchmark harness.
"""

import argparse
import time

import torch

from bpclip_fast import _ops


def timed(fn, device, reps):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    n = 29_360_128  # the paper's CIFAR-10 first Linear layer, 32768 x 896
    cnt = torch.zeros(1, dtype=torch.int64, device=dev)
    rows = [("float32", torch.float32)] + ([("bfloat16", torch.bfloat16)] if dev == "cpu" else
                                            [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
    print(f"device={dev} threads={torch.get_num_threads()} elements={n}")
    for name, dt in rows:
        e = torch.tensor([], dtype=dt).element_size()
        x = torch.randn(256, n // 256, device=dev).to(dt)
        g = torch.randn_like(x)
        conv = x.reshape(256, 128, 32, 28)
        buf = torch.empty(n, device=dev, dtype=dt)
        dst = torch.empty_like(x)
        xc, f, nn_ = _ops.clip_rows(x, cnt, 1.0)
        cases = [
            ("copy_ (limit)", lambda: dst.copy_(x), 2 * n * e),
            ("clip_rows l2", lambda: _ops.clip_rows(x, cnt, 1.0), 3 * n * e),
            ("clip_rows l15", lambda: _ops.clip_rows(conv, cnt, 1.0, "l15"), 3 * n * e),
            ("clip_rows_backward", lambda: _ops.clip_rows_backward(g, xc, f, nn_, 1.0), 5 * n * e),
            ("philox_noise_ write", lambda: _ops.philox_noise_(buf, 1, 2, 1.0, False), n * e),
            ("philox_noise_ accumulate", lambda: _ops.philox_noise_(buf, 1, 2, 1.0, True), 2 * n * e),
            ("torch normal_ (reference)", lambda: buf.normal_(), n * e),
        ]
        for label, fn, nbytes in cases:
            t = timed(fn, dev, args.reps)
            print(f"{name:9s} {label:28s} {t * 1e3:8.2f} ms  {nbytes / t / 1e9:7.2f} GB/s")


if __name__ == "__main__":
    main()
