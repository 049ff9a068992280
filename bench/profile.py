"""Where a training step's device time goes, by kernel (torch.profiler):

    python -m bench.profile --device cuda --batch 128 cifar10:flat cifar10:nonprivate resnet20-gn:flat

Each ``model:method`` (``bench.models.MODELS``, ``bench.methods.REGISTRY``) is built as ``bench.step``
builds it, warmed up, timed over ``--timed`` steps (wall clock, the device synchronized), then
profiled over ``--steps`` steps. Printed per spec: wall ms per step, device ms per step (the sum of
the kernels' own time), kernels per step, and the table of the ops with the most device time. On the
CPU the device columns are the CPU's own time. ``bench/gpu_check.sh`` runs it on the issue-25 models.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.methods import REGISTRY
from bench.models import MODELS


def run(spec: str, device: str, batch: int, steps: int, timed: int, rows: int) -> None:
    name, method = spec.split(":")
    factory, shape, classes = MODELS[name]
    torch.manual_seed(0)
    model = factory().to(device)
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    step, _ = REGISTRY[method].build(model, x, y, 0, torch.nn.CrossEntropyLoss())
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(5):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(timed):
        step()
    sync()
    wall = (time.perf_counter() - t) / timed * 1e3
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
        busy = sum(e.self_device_time_total for e in kernels) / steps / 1e3
        count = sum(e.count for e in kernels) / steps
    else:
        busy = sum(e.self_cpu_time_total for e in events) / steps / 1e3
        count = sum(e.count for e in events) / steps
    print(f"\n### {spec} b{batch} on {device}: wall {wall:.2f} ms/step, device {busy:.2f} ms/step, "
          f"{count:.0f} {'kernels' if cuda else 'ops'}/step", flush=True)
    print(events.table(sort_by=key, row_limit=rows, max_name_column_width=60), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+", help="model:method, e.g. cifar10:flat")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    ap.add_argument("--timed", type=int, default=20, help="wall-clock timed steps")
    ap.add_argument("--rows", type=int, default=12, help="ops listed per spec")
    args = ap.parse_args(argv)
    for spec in args.specs:
        run(spec, args.device, args.batch, args.steps, args.timed, args.rows)


if __name__ == "__main__":
    main()
