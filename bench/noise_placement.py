"""Cost of adding the noise at step() instead of fusing it into the Linear weight-gradient GEMM.

    python -m bench.noise_placement [--reps 15]

The CIFAR-10 net's first Linear at batch 32 (the layer that holds 29.4M of its 29.6M weights).
"fused" is what the Linear backward does at scale 1 (the sum loss): the draw written into the fresh
gradient buffer, then ``addmm_`` with beta = 1 accumulates the GEMM into it. "at_step": the GEMM into
a fresh buffer, then the draw added in place by a separate pass, the alternative the step boundary
rejected (docs/design.md, What the guarantee assumes); the layer op uses that order, right after
the GEMM, only with a mean-loss scale, which then shares the draw's pass. Interleaved, medians printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bpclip_fast import _ops

OUT, IN, BATCH = 3584, 8192, 32


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    g, x = torch.randn(BATCH, OUT, generator=gen), torch.randn(BATCH, IN, generator=gen)

    def fused():
        w = torch.empty(OUT, IN)
        _ops.philox_noise_(w, 1, 0, 1.0)
        return w.addmm_(g.t(), x)

    def at_step():
        w = torch.mm(g.t(), x)
        return _ops.philox_noise_(w, 1, 0, 1.0, accumulate=True)

    times = {"fused": [], "at_step": []}
    for fn in (fused, at_step):
        fn()  # warm-up
    for _ in range(args.reps):
        for name, fn in (("fused", fused), ("at_step", at_step)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        print(f"{name:8s} {1e3 * statistics.median(ts):7.1f} ms  (median of {args.reps}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
