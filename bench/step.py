"""Time and peak memory of one full DP training step, against Opacus and plain PyTorch.

    python -m bench.step --quick                       # the default grid for a 2-core CPU (< 10 min)
    python -m bench.step --models mnist,cifar10 --batch-sizes 32,128,512 --reps 5 \\
        --json out.json --md out.md --plot out.png     # any grid; --device cuda on a GPU

One step is ``zero_grad; forward; loss (cross-entropy, sum); backward; <the method's clipping and
noise>; SGD step`` on one fixed synthetic batch (the same data, weights and optimizer for every
method). Each (model, method, batch size) is measured in a fresh child process (``--warmup``
untimed steps, then ``--steps`` timed ones), so its peak memory is its own; the children are run
rep by rep with the order of the methods rotated each rep, so slow phases of a shared machine fall
on every method alike. Out of memory, timeouts and unsupported combinations are recorded in the
``status`` field, never dropped. See docs/benchmarks.md for the definitions.

This module is the command line and the grid; the methods are ``bench/methods.py``, one measurement
in its own process ``bench/launcher.py``, the records, table and plot ``bench/report.py``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.launcher import FAILED, child_main, launch
from bench.methods import DEFAULT_METHODS, METHODS, import_for
from bench.probes import mem_available_mb, wait_quiet
from bench.report import aggregate, fmt, markdown_table, plot

MODEL_NAMES = ("mnist", "cifar10", "mlp", "resnet20", "vit", "resnet20-gn")
# The issue-26 models (generic path; gpt2 and gpt2-lora need transformers and peft): named, not in the default grid.
MORE_MODELS = ("lstm", "transformer", "conv1d", "gpt2", "gpt2-lora")

# --quick: the targets of issue 5 (MNIST b512; CIFAR-10 b32 and b128) and the two other models small.
QUICK_GRID = [("mnist", 512), ("cifar10", 32), ("cifar10", 128), ("mlp", 128), ("resnet20", 16)]
QUICK = dict(reps=3, warmup=1, steps=4, timeout=150.0, warmup_time=1.0, min_time=1.0, max_time=8.0)
DEFAULTS = dict(reps=5, warmup=2, steps=5, timeout=600.0, warmup_time=2.0, min_time=2.0, max_time=60.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"the fixed grid {QUICK_GRID} with {QUICK} (finishes in < 10 min on 2 CPU cores); "
                        "--models/--batch-sizes then filter that grid, other options still override")
    p.add_argument("--models", default=None, help=f"comma-separated, of {MODEL_NAMES + MORE_MODELS} (default: the first {len(MODEL_NAMES)})")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated, of {METHODS}")
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated; every model runs every size (default 32,128)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--reps", type=int, default=None, help="child processes per (model, method, batch); default 5")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed steps per child, at least (default {DEFAULTS['warmup']})")
    p.add_argument("--warmup-time", type=float, default=None,
                   help=f"... and untimed steps until this many seconds have passed (default {DEFAULTS['warmup_time']})")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per child (default {DEFAULTS['steps']}); "
                                                           "more while under --min-time, fewer past --max-time")
    p.add_argument("--min-time", type=float, default=None,
                   help=f"time more steps until the timed ones took this long, s (default {DEFAULTS['min_time']})")
    p.add_argument("--max-time", type=float, default=None,
                   help=f"stop timing (after at least 2 steps) once past this, s (default {DEFAULTS['max_time']})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads in each child (default: the CPUs this process may use)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per child before it is killed "
                                                               "(status timeout); default 600")
    p.add_argument("--mem-limit-mb", type=float, default=None,
                   help="CPU only: address-space budget of each child beyond its imports (allocations past it "
                        "fail: status oom); default 50%% of MemAvailable at start; 0 = no limit")
    p.add_argument("--launch", choices=("fork", "exec"), default=None,
                   help="fork children from this process (fast; default on CPU) or start a new interpreter "
                        "for each (default on CUDA)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each child, wait up to S seconds for other processes to use < 0.3 cores "
                        "(for shared machines; default 0: do not wait)")
    p.add_argument("--omp-wait-policy", choices=("passive", "active", "inherit"), default="passive",
                   help="OMP_WAIT_POLICY for the children (default passive: stable timings on a shared "
                        "machine; inherit: leave the environment as it is)")
    p.add_argument("--mmap-threshold-mb", type=float, default=0.0, metavar="MB",
                   help="CPU: fix glibc's mmap threshold at MB in every child (mallopt), so that freed large "
                        "tensors leave RSS at once; 0 (default): glibc's dynamic threshold, as users run")
    p.add_argument("--act", choices=("tanh", "relu"), default="tanh", help="activation of every model")
    p.add_argument("--seed", type=int, default=0, help="weights, data and noise seed (same for every method)")
    p.add_argument("--json", dest="json_path", default=None, help="write the records here")
    p.add_argument("--md", dest="md_path", default=None, help="write the markdown table here")
    p.add_argument("--plot", dest="plot_path", default=None, help="write the bar chart PNG here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _split(s: str, allowed=None, conv=str):
    items = [conv(v.strip()) for v in s.split(",") if v.strip()]
    if allowed is not None:
        bad = [v for v in items if v not in allowed]
        if bad:
            raise SystemExit(f"unknown {bad}; choose from {allowed}")
    return items


def main(argv=None) -> list:
    args = parse_args(argv)
    if args.child is not None:
        child_main(json.loads(args.child), args.child_out)
        return []

    models = _split(args.models or ",".join(MODEL_NAMES), MODEL_NAMES + MORE_MODELS)
    methods = _split(args.methods, METHODS)
    sizes = _split(args.batch_sizes or "32,128", conv=int)
    if args.quick:
        grid = [(m, b) for m, b in QUICK_GRID if m in models and (args.batch_sizes is None or b in sizes)]
        defaults = QUICK
    else:
        grid = [(m, b) for m in models for b in sizes]
        defaults = DEFAULTS
    reps = args.reps if args.reps is not None else defaults["reps"]
    warmup = args.warmup if args.warmup is not None else defaults["warmup"]
    steps = args.steps if args.steps is not None else defaults["steps"]
    timeout = args.timeout if args.timeout is not None else defaults["timeout"]
    warmup_time = args.warmup_time if args.warmup_time is not None else defaults["warmup_time"]
    min_time = args.min_time if args.min_time is not None else defaults["min_time"]
    max_time = args.max_time if args.max_time is not None else defaults["max_time"]
    cuda = args.device.startswith("cuda")
    launch_mode = args.launch or ("exec" if cuda else "fork")
    threads = args.threads or (None if cuda else len(os.sched_getaffinity(0)))
    mem_limit = None
    if not cuda:
        if args.mem_limit_mb is None:
            avail = mem_available_mb()
            mem_limit = 0.5 * avail if avail else None
        else:
            mem_limit = args.mem_limit_mb or None

    # OpenMP's wait policy is read when libgomp loads (import torch), so it is set before the imports.
    # Passive (threads sleep between parallel regions) keeps timings stable when another process
    # competes for the cores; GNU OpenMP's default spinning then makes steps 10-30x slower at random.
    if args.omp_wait_policy != "inherit":
        if "torch" in sys.modules and os.environ.get("OMP_WAIT_POLICY", "").lower() != args.omp_wait_policy:
            print("warning: torch was imported before bench.step set OMP_WAIT_POLICY; forked children keep "
                  "the policy torch loaded with", file=sys.stderr)
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    # The launcher imports the libraries (so forked children need not) but runs no tensor op.
    import_for(methods)
    common = {"device": args.device, "threads": threads, "warmup": warmup, "steps_per_rep": steps,
              "warmup_time_s": warmup_time, "min_time_s": min_time, "max_time_s": max_time,
              "mem_limit_mb": mem_limit, "launch": launch_mode, "act": args.act, "seed": args.seed,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
              "mmap_threshold_mb": args.mmap_threshold_mb or None,
              "versions": None, "machine": None,  # bpclip_fast.environment(), once the children are done
              "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              "memory_metric": "cuda max_memory_allocated" if cuda else "peak RSS (VmHWM, reset after imports)"}
    print(f"bench.step: {len(grid)} (model, batch) × {len(methods)} methods × {reps} reps; warmup {warmup}, "
          f"{steps} timed steps per child; device {args.device}, threads {threads}, launch {launch_mode}, "
          f"timeout {timeout:g} s, mem limit {fmt(mem_limit, '.0f')} MB", flush=True)

    results = {(m, meth, b): [] for m, b in grid for meth in methods}
    failed_at = {}  # (model, method) -> smallest batch size that ran out of memory
    t_start = time.perf_counter()
    for rep in range(reps):
        for model, bs in grid:
            k = rep % len(methods)
            for method in methods[k:] + methods[:k]:  # rotated: no method is always first
                key = (model, method, bs)
                prev = results[key]
                if prev and prev[-1]["status"] in FAILED:
                    continue  # a deterministic failure (oom, timeout, unsupported, ...) is not retried
                oom_b = failed_at.get((model, method))
                if oom_b is not None and bs > oom_b:
                    if not prev:
                        prev.append({"status": "oom", "times_ms": [],
                                     "error": f"not run: out of memory at the smaller batch {oom_b}"})
                    continue
                spec = {"model": model, "method": method, "batch_size": bs, "device": args.device,
                        "warmup": warmup, "steps": steps, "threads": threads, "seed": args.seed,
                        "warmup_time": warmup_time, "min_time": min_time, "max_time": max_time,
                        "mem_limit_mb": mem_limit, "act": args.act, "mmap_threshold_mb": args.mmap_threshold_mb}
                waited = wait_quiet(args.wait_quiet) if args.wait_quiet else 0.0
                load_before = os.getloadavg()[0]
                rec = launch(spec, timeout, launch_mode)
                rec["loadavg"] = max(load_before, os.getloadavg()[0])
                rec["waited_s"] = waited
                prev.append(rec)
                if rec["status"] == "oom":
                    failed_at[(model, method)] = min(bs, failed_at.get((model, method), bs))
                med = statistics.median(rec["times_ms"]) if rec["times_ms"] else None
                print(f"  rep {rep + 1}/{reps} {model:9s} b{bs:<5d} {method:17s} {rec['status']:11s} "
                      f"median {fmt(med, '8.1f')} ms  peak {fmt(rec.get('peak_mem_mb'), '6.0f')} MB "
                      f"(Δ {fmt(rec.get('mem_increase_mb'), '.0f')})  [{rec['child_wall_s']:.1f} s, "
                      f"others used {fmt(rec.get('foreign_cores'), '.2f')} cores]"
                      + (f"  {rec.get('error', '')[:160]}" if rec["status"] != "ok" else ""), flush=True)

    # Only now: it asks torch about CUDA, which a launcher that forks must not have done.
    from bpclip_fast.environment import environment

    common.update(environment(args.device))
    records = [aggregate(key, reps_, common) for key, reps_ in results.items()]
    wall = time.perf_counter() - t_start
    for r in records:
        r["bench_wall_s"] = wall
    table = markdown_table(records)
    print()
    print(table)
    print(f"\nwall time {wall:.0f} s", flush=True)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(records, f, indent=1)
    if args.md_path:
        Path(args.md_path).parent.mkdir(parents=True, exist_ok=True)
        cmd = "python -m bench.step " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(args.md_path).write_text(
            f"`{cmd}` — {common['date']}, {common['machine']['cpu']} ({common['machine']['cpus']} CPUs), "
            f"{threads} threads, device {args.device}, wall {wall:.0f} s\n\n{table}\n")
    if args.plot_path:
        try:
            plot(records, args.plot_path)
        except ImportError as exc:
            print(f"no plot ({exc}); pip install matplotlib", file=sys.stderr)
    return records


if __name__ == "__main__":
    main()
