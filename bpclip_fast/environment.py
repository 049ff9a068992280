"""What a result was measured with: library versions, the extension's build, the machine.

One record for every writer of results (the trainer's ``run.json``, ``bench.step``'s records), so
that two results can be compared field by field.
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

import torch

from . import __version__, build_info

__all__ = ["environment"]

# Versions read from the installed distributions' metadata rather than by importing the modules:
# the benchmark's launcher calls this without paying for (or being changed by) imports it does not use.
_DISTRIBUTIONS = {"numpy": "numpy", "opacus": "opacus", "dp_accounting": "dp-accounting",
                  "scikit_learn": "scikit-learn"}


def _installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _first_value(path: str, prefix: str, parse):
    try:
        with open(path) as f:
            return next((parse(ln) for ln in f if ln.startswith(prefix)), None)
    except OSError:
        return None


def environment(device=None) -> dict:
    """``{"versions": {...}, "machine": {...}}``. ``device`` (a torch device or its name) is recorded,
    with the GPU's name when it is a CUDA device; ``None`` leaves CUDA untouched."""
    versions = {"python": platform.python_version(), "bpclip_fast": __version__, "torch": torch.__version__}
    versions.update({name: _installed(dist) for name, dist in _DISTRIBUTIONS.items()})
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpu": _first_value("/proc/cpuinfo", "model name", lambda ln: ln.split(":", 1)[1].strip())
               or platform.processor(),
               "cpu_count": os.cpu_count(),
               "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
               "mem_total_mb": _first_value("/proc/meminfo", "MemTotal", lambda ln: int(ln.split()[1]) // 1024),
               "torch_threads": torch.get_num_threads(), "device": None if device is None else str(device)}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(torch.device(device))
    try:
        machine["build"] = build_info()
    except Exception:  # noqa: BLE001 - informational
        pass
    return {"machine": machine, "versions": versions}
