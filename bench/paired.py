"""Step-time ratio of private training (bpclip_fast.PrivacyEngine) to non-private training, paired.

    python -m bench.paired --models mnist,cifar10 --pairs 21 --json paired.json

Both trainings live in one process, on the same initial weights and the same synthetic batch
(bench.step's data and hyper-parameters; MNIST net at batch 512, CIFAR-10 net at batch 32). After
a few untimed warm-up steps of each, pair k times one non-private step and one private step, each
alone (time.perf_counter), the order alternating from pair to pair, and ratio_k = private/nonprivate.
On a shared machine the load drifts over seconds, so the two steps of a pair see nearly the same
load and their ratio is steadier than a ratio of medians taken at different times. Reported: the
median ratio, its IQR (quartiles interpolated linearly), min/max, and each method's median step.

Public API only, so that the very same file runs against any tree of the library: copy it into
<tree>/bench/ and run `cd <tree> && python -m bench.paired` (bpclip_fast is imported from the cwd).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast
from bench.models import MODELS
from bpclip_fast import PrivacyEngine

# bench.step's values, copied rather than imported, so both trees run exactly the same benchmark.
INPUT_CLIP, GRAD_CLIP, SIGMA, LR = 1.0, 1.0, 1.0, 0.01
BATCH = {"mnist": 512, "cifar10": 32}  # the two configurations the step-time targets are about

# Compatibility: keyword arguments of make_private that only a newer tree has (and needs for these
# models), passed only where the signature has them. Empty: the arguments main has added so far
# (max_input_shape, nonfinite, probe) all have defaults, so the d181165 call works unchanged.
NEWER_ONLY_KWARGS: dict = {}


def make_private(model, x, y, b):
    """(model, optimizer, loader) of bpclip_fast with the defaults: Poisson sampling at q = b/N = 1
    (every batch is all b examples) and the mean loss."""
    kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                  data_loader=DataLoader(TensorDataset(x, y), batch_size=b),
                  noise_multiplier=SIGMA, input_clip=INPUT_CLIP, grad_clip=GRAD_CLIP)
    engine = PrivacyEngine()
    params = inspect.signature(engine.make_private).parameters
    kwargs.update({k: v for k, v in NEWER_ONLY_KWARGS.items() if k in params})  # compatibility branch
    missing = [k for k, p in params.items() if p.default is p.empty and k not in kwargs
               and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if missing:  # fail loudly rather than time something else than the documented call
        raise SystemExit(f"make_private now requires {missing}: add them to NEWER_ONLY_KWARGS in {__file__}")
    return engine.make_private(**kwargs)


def build_steps(name: str, seed: int):
    """Two zero-argument callables, one training step each: (nonprivate, private)."""
    factory, shape, classes = MODELS[name]
    b = BATCH[name]
    torch.manual_seed(seed)
    model = factory(nn.Tanh)  # bench.step's default activation
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((b,) + tuple(shape), generator=gen)
    y = torch.randint(0, classes, (b,), generator=gen)
    crit = nn.CrossEntropyLoss()  # mean, the default of make_private's loss_reduction
    pmodel, popt, ploader = make_private(copy.deepcopy(model), x, y, b)  # same initial weights
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(TensorDataset(x, y), batch_size=b)  # one batch: every step sees the same b examples

    # Both steps fetch their batch from their loader inside the timed region, as a training loop does.
    def nonprivate():
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            crit(model(xb), yb).backward()
            opt.step()

    def private():
        for xb, yb in ploader:  # q = 1: one batch of all b examples per pass
            popt.zero_grad(set_to_none=True)
            crit(pmodel(xb), yb).backward()
            popt.step()  # clipping happened in backward; noise check, SGD, accountant

    return nonprivate, private


def timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def quartiles(v):
    q1, q2, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return q1, q2, q3


def measure(name: str, pairs: int, warmup: int, seed: int) -> dict:
    nonprivate, private = build_steps(name, seed)
    for _ in range(warmup):  # lazy initialisation, allocator growth, first-touch page faults
        nonprivate()
        private()
    t_np, t_p, first = [], [], []
    for k in range(pairs):
        if k % 2 == 0:  # alternate the order: neither method always runs right after the other
            a, b_ = timed(nonprivate), timed(private)
        else:
            b_, a = timed(private), timed(nonprivate)
        t_np.append(a)
        t_p.append(b_)
        first.append("nonprivate" if k % 2 == 0 else "bpclip_fast")
    ratios = [p / n for p, n in zip(t_p, t_np)]
    q1, med, q3 = quartiles(ratios)
    return {"model": name, "batch_size": BATCH[name], "pairs": pairs, "warmup": warmup,
            "ratio_median": med, "ratio_q1": q1, "ratio_q3": q3, "ratio_iqr": q3 - q1,
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "nonprivate_ms_median": statistics.median(t_np), "bpclip_fast_ms_median": statistics.median(t_p),
            "ratios": ratios, "nonprivate_ms": t_np, "bpclip_fast_ms": t_p, "first": first}


def _git(*args) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.paired", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mnist,cifar10", help=f"comma-separated, of {list(BATCH)}")
    p.add_argument("--pairs", type=int, default=21, help="timed pairs per model, at least 15 (21)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each method first (3)")
    p.add_argument("--seed", type=int, default=0, help="weights and data (0); the noise seed is the engine's")
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if any(m not in BATCH for m in models):
        p.error(f"--models: choose from {list(BATCH)}")
    if args.pairs < 15:
        p.error("--pairs: at least 15 (the IQR of fewer ratios says little)")

    status = _git("status", "--porcelain", "--untracked-files=no")
    # The load average at start and end: the machine is shared, so a result is read with it.
    meta = {"command": " ".join([os.path.basename(sys.executable), "-m", "bench.paired"] + (argv or sys.argv[1:])),
            "cwd": os.getcwd(), "bpclip_fast_file": bpclip_fast.__file__, "git_commit": _git("rev-parse", "HEAD"),
            "git_dirty": None if status is None else bool(status),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "input_clip": INPUT_CLIP, "grad_clip": GRAD_CLIP, "sigma": SIGMA, "lr": LR,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
            "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "loadavg_1min_start": os.getloadavg()[0]}
    t0 = time.perf_counter()
    results = [measure(m, args.pairs, args.warmup, args.seed) for m in models]
    meta["loadavg_1min_end"] = os.getloadavg()[0]
    meta["wall_s"] = time.perf_counter() - t0

    print(f"bench.paired  {meta['cwd']}  commit {str(meta['git_commit'])[:7]}  threads {meta['threads']}  "
          f"load {meta['loadavg_1min_start']:.2f} -> {meta['loadavg_1min_end']:.2f}  wall {meta['wall_s']:.0f} s")
    print("| model | batch | pairs | ratio median | IQR (q1–q3) | min–max | nonprivate ms | bpclip_fast ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['model']} | {r['batch_size']} | {r['pairs']} | {r['ratio_median']:.3f} | "
              f"{r['ratio_iqr']:.3f} ({r['ratio_q1']:.3f}–{r['ratio_q3']:.3f}) | "
              f"{r['ratio_min']:.3f}–{r['ratio_max']:.3f} | {r['nonprivate_ms_median']:.1f} | "
              f"{r['bpclip_fast_ms_median']:.1f} |")
    out = {"meta": meta, "results": results}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
