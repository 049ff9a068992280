"""Micro-benchmarks of the bandwidth-bound kernels (norm+clip, its backward, noise), in GB/s next
to a plain copy of the same bytes (the machine's practical limit) and next to the same computation
composed of torch ops, from 1 MB to 1 GB of data.

    .venv/bin/python -m pytest bench --benchmark-only [--bench-device cuda] [--bench-sizes-mb 1,32,512,1024]

Bytes counted are the minimum each op must move: read x and write the result (norm+clip: 2 x
size), read two tensors and write one (backward: 3 x size), write (noise) or read and write
(noise, accumulate). The copy that an op is compared with moves bytes the same way and allocates
its output the same way: ops that return a fresh tensor are compared with ``x.clone()`` (a fresh
output costs page faults on CPU), in-place ops with ``dst.copy_(x)`` into a preallocated buffer.
The torch-composed versions are what a user would write without our kernels.
"""

from __future__ import annotations

import pytest
import torch

from bpclip_fast import _ops

BOUND = 1.0


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _run(benchmark, device, name, fn, nbytes, size_mb, limit):
    RESULTS = benchmark._bpclip_results
    def call():
        fn()
        _sync(device)

    rounds = max(3, min(30, int(2e9 / max(nbytes, 1))))
    benchmark.pedantic(call, rounds=rounds, warmup_rounds=1, iterations=1)
    median = benchmark.stats.stats.median
    gbps = nbytes / median / 1e9
    benchmark.extra_info.update({"GB/s": gbps, "bytes": nbytes, "limit": limit})
    RESULTS.append({"name": name, "size_mb": size_mb, "ms": median * 1e3, "gbps": gbps, "limit": limit})


def _rows(size_mb, device):
    n = size_mb * (1 << 20) // 4
    b = 64
    x = torch.randn(b, n // b, device=device)
    return x


def _conv(size_mb, device):
    n = size_mb * (1 << 20) // 4
    b, c = 64, 64
    hw = n // (b * c)
    return torch.randn(b, c, hw, 1, device=device)


@pytest.mark.parametrize("kind", ["clone", "copy_"])
def test_copy(benchmark, device, size_mb, kind):
    x = _rows(size_mb, device)
    nbytes = 2 * x.numel() * 4
    if kind == "clone":
        _run(benchmark, device, "copy: clone (fresh output)", lambda: x.clone(), nbytes, size_mb, None)
    else:
        dst = torch.empty_like(x)
        _run(benchmark, device, "copy: copy_ (preallocated)", lambda: dst.copy_(x), nbytes, size_mb, None)


def _torch_clip(x, flat_norm):
    n = flat_norm(x)
    f = (BOUND / n).clamp(max=1.0)
    return x * f.view(-1, *([1] * (x.dim() - 1)))


@pytest.mark.parametrize("norm", ["l2", "l15"])
@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_norm_clip(benchmark, device, size_mb, norm, impl):
    x = _rows(size_mb, device) if norm == "l2" else _conv(size_mb, device)
    cnt = torch.zeros(1, dtype=torch.int64, device=device)
    nbytes = 2 * x.numel() * 4
    name = f"norm+clip {norm}"
    if impl == "ours":
        _run(benchmark, device, name, lambda: _ops.clip_rows(x, cnt, BOUND, norm), nbytes, size_mb,
             "copy: clone (fresh output)")
    else:
        fn = (lambda t: t.flatten(1).norm(dim=1)) if norm == "l2" else (
            lambda t: t.abs().sum(dim=(2, 3)).norm(dim=1))
        _run(benchmark, device, "torch: " + name, lambda: _torch_clip(x, fn), nbytes, size_mb, None)


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_clip_backward(benchmark, device, size_mb, impl):
    x = _rows(size_mb, device) * 10
    g = torch.randn_like(x)
    cnt = torch.zeros(1, dtype=torch.int64, device=device)
    xc, f, n = _ops.clip_rows(x, cnt, BOUND)
    nbytes = 3 * x.numel() * 4
    if impl == "ours":
        _run(benchmark, device, "clip backward", lambda: _ops.clip_rows_backward(g, xc, f, n, BOUND), nbytes,
             size_mb, "copy: clone (fresh output)")
    else:
        # s g - (xc . g) xc / (n C) over the clipped rows, as torch ops
        over = (n > BOUND).to(x.dtype)
        kappa = over / (n * BOUND)

        def composed():
            dot = (xc * g).sum(dim=1)
            return f[:, None] * g - (kappa * dot)[:, None] * xc

        _run(benchmark, device, "torch: clip backward", composed, nbytes, size_mb, None)


@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_noise(benchmark, device, size_mb, accumulate, impl):
    buf = torch.zeros(size_mb * (1 << 20) // 4, device=device)
    nbytes = (2 if accumulate else 1) * buf.numel() * 4
    name = "noise " + ("accumulate" if accumulate else "write")
    if impl == "ours":
        _run(benchmark, device, name, lambda: _ops.philox_noise_(buf, 1, 2, 1.0, accumulate), nbytes, size_mb,
             "copy: copy_ (preallocated)")
    elif accumulate:
        tmp = torch.empty_like(buf)
        _run(benchmark, device, "torch: " + name, lambda: buf.add_(tmp.normal_()), nbytes, size_mb, None)
    else:
        _run(benchmark, device, "torch: " + name, lambda: buf.normal_(), nbytes, size_mb, None)


def test_integer_release(benchmark, device, size_mb):
    """``integer_release_`` (``make_private(integer_noise=True)``) on a float32 buffer of clipped sums:
    the coupled rounding and an exact discrete Gaussian per element, read and written in place. It is
    compute-bound (rejection loops: ~2.7 Philox blocks and ~2 trials a draw), so its GB/s is far below
    the copy's; on a CPU, sizes above 32 MB take seconds a call."""
    buf = torch.randn(size_mb * (1 << 20) // 4, device=device)
    _run(benchmark, device, "integer release", lambda: _ops.integer_release_(buf, 1, 2, 0, 1.0, -26, 1 << 27, 1.0),
         2 * buf.numel() * 4, size_mb, "copy: copy_ (preallocated)")
