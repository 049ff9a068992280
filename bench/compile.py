"""Eager vs ``torch.compile`` (inductor) step time of a private model under exact clipping (issue 25).

    OMP_NUM_THREADS=1 python -m bench.compile [--models digits,mnist] [--modes flat,per_layer,none]
                                              [--batch 64] [--steps 20] [--warmup 3] [--clock wall|cpu]
                                              [--device cpu|cuda] [--compile-mode default|reduce-overhead]

One step is ``zero_grad; forward; cross-entropy (mean); backward; step()`` of a PrivacyEngine
private model on fixed-size batches of synthetic data (``poisson_sampling=False``, so every step has
the same shape and the compiled graph is reused; Poisson batches add one recompile, after which the
batch dimension is dynamic). The compiled model is warmed up (compilation excluded) before timing;
eager and compiled steps alternate, so a slow phase of a shared machine falls on both alike. Median
of ``--steps`` steps, milliseconds, on this machine's CPU. Mode ``none`` times the same net without
privacy (plain SGD), to tell inductor's own cost from the private layers' ops. ``--clock cpu`` times
the process's CPU time instead of wall time (with ``OMP_NUM_THREADS=1``: the step's own work,
without the time other processes of a shared machine took the core away). ``--device cuda`` runs the
models and data on the GPU and synchronizes the device before each clock read (wall clock only);
``--compile-mode reduce-overhead`` is ``torch.compile``'s CUDA-graph mode, the route to launch-free
steps on a GPU (``bench/gpu_check.sh`` runs it).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine
from bpclip_fast.models import digits_net, mnist_net

def mlp_net():
    """Linear layers only: the ops' own overhead, without the max-pools whose inductor kernels are
    slower than eager's on this CPU in training mode (they also return the pooling indices)."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


MODELS = {"digits": (digits_net, (1, 8, 8)), "mnist": (mnist_net, (1, 28, 28)), "mlp": (mlp_net, (1, 28, 28))}


def _private(base, shape, mode, batch, device="cpu"):
    model = copy.deepcopy(base).to(device)
    g = torch.Generator().manual_seed(0)
    n = 4 * batch
    data = TensorDataset(torch.randn(n, *shape, generator=g).to(device),
                         torch.randint(0, 10, (n,), generator=g).to(device))
    if mode == "none":  # the same net without privacy: what inductor itself gains or costs
        return model, torch.optim.SGD(model.parameters(), lr=0.01), DataLoader(data, batch_size=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(accountant="zcdp").make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                            data_loader=DataLoader(data, batch_size=batch), noise_multiplier=1.0,
                                            clipping=mode, max_grad_norm=1.0, noise_seed=0, poisson_sampling=False)


def _batches(loader):
    while True:
        yield from loader


_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter
_sync = lambda: None  # noqa: E731 -- torch.cuda.synchronize under --device cuda


def _step(model, opt, batches):
    x, y = next(batches)
    _sync()
    t = _clock()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    _sync()
    return _clock() - t


def measure(name, mode, batch, steps, warmup, device="cpu", compile_mode="default"):
    factory, shape = MODELS[name]
    # Each configuration gets its own dynamo cache: the models share Sequential.forward's code
    # object, so a second model of another input size would otherwise be compiled with its sizes
    # dynamic (automatic dynamic shapes after a size guard failed), not as a user's one model is.
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = factory()
    me, oe, le = _private(base, shape, mode, batch, device)
    mc, oc, lc = _private(base, shape, mode, batch, device)
    cm = torch.compile(mc, mode=compile_mode)
    be, bc = _batches(le), _batches(lc)
    t = time.perf_counter()
    _step(cm, oc, bc)
    compile_s = time.perf_counter() - t
    for _ in range(warmup):
        _step(me, oe, be)
        _step(cm, oc, bc)
    eager, compiled = [], []
    for _ in range(steps):
        eager.append(_step(me, oe, be))
        compiled.append(_step(cm, oc, bc))
    return statistics.median(eager) * 1e3, statistics.median(compiled) * 1e3, compile_s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits,mnist,mlp")
    ap.add_argument("--modes", default="flat,per_layer")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--clock", choices=sorted(_CLOCKS), default="wall")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--compile-mode", choices=("default", "reduce-overhead", "max-autotune"), default="default")
    args = ap.parse_args(argv)
    if args.device == "cuda" and args.clock != "wall":
        ap.error("--clock cpu measures this process's CPU time, not the GPU's: use --clock wall with --device cuda")
    global _clock, _sync
    _clock = _CLOCKS[args.clock]
    if args.device == "cuda":
        _sync = torch.cuda.synchronize
        where = torch.cuda.get_device_name()
    else:
        where = f"{torch.get_num_threads()} thread(s)"
    print(f"torch {torch.__version__}, {where}, batch {args.batch}, median of {args.steps} steps, "
          f"{args.clock} clock, torch.compile mode {args.compile_mode}")
    print(f"{'model':8} {'mode':10} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6} {'compile s':>10}")
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            e, c, s = measure(name, mode, args.batch, args.steps, args.warmup, args.device, args.compile_mode)
            print(f"{name:8} {mode:10} {e:9.2f} {c:12.2f} {c / e:6.2f} {s:10.1f}", flush=True)


if __name__ == "__main__":
    main()
