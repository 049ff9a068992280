"""Runs one (model, method, batch size) measurement in a fresh process and returns its record.

``run_one`` is the measurement, in the process that calls it; ``launch`` gives it a process of its
own, by ``fork`` (CPU default: the launcher has already paid for the imports) or by a new
interpreter (``--launch exec``; CUDA, whose runtime must not be forked), and turns a child that
died, hung or wrote nothing into a record with a ``status`` rather than a missing row.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.methods import build_step, import_for
from bench.probes import (LiveBytes, cpu_busy_s, fix_mmap_threshold, peak_rss_mb, proc_status, reset_peak_rss,
                          rss_mb, self_cpu_s)

FAILED = ("oom", "timeout", "unsupported", "error", "crashed")  # deterministic: another rep would fail again
MAX_EXTRA_STEPS = 100  # cap on the steps added by warmup_time / min_time

ROOT = Path(__file__).resolve().parents[1]


def _classify(exc: BaseException) -> str:
    import torch

    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, MemoryError) or isinstance(exc, getattr(torch, "OutOfMemoryError", ())) \
            or "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text:
        return "oom"
    if isinstance(exc, NotImplementedError) or "not supported" in text or "unsupported" in text:
        return "unsupported"
    return "error"


def run_one(spec: dict) -> dict:
    """Measures one (model, method, batch size) in this process; returns the rep's record."""
    import_for([spec["method"]])
    import torch

    from bench.models import MODELS

    device = spec["device"]
    rec = {"status": "ok", "times_ms": [], "hwm_reset": None}
    cuda = device.startswith("cuda")
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    rec["threads"] = torch.get_num_threads()
    if cuda:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
        rec["mem_base_mb"] = torch.cuda.memory_allocated() / 2 ** 20
    else:
        if spec.get("mmap_threshold_mb"):
            rec["mallopt_ok"] = fix_mmap_threshold(spec["mmap_threshold_mb"])
        rec["mem_base_mb"] = rss_mb()
        file_base = proc_status("RssFile").get("RssFile")
        rec["hwm_reset"] = reset_peak_rss()
        if spec.get("mem_limit_mb"):
            # An address-space cap relative to now: an allocation beyond it fails with an error we can
            # record as "oom", instead of the kernel's OOM killer hitting whatever it picks.
            vm = proc_status("VmSize").get("VmSize", 0.0)
            cap = int((vm + spec["mem_limit_mb"]) * 2 ** 20)
            resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))

    def sync():
        if cuda:
            torch.cuda.synchronize()

    stage = "setup"
    live = LiveBytes(not cuda)
    try:
        factory, shape, classes = MODELS[spec["model"]]
        act = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU}[spec.get("act", "tanh")]
        torch.manual_seed(spec["seed"])
        model = factory(act).to(device)
        rec["params"] = sum(p.numel() for p in model.parameters())
        gen = torch.Generator().manual_seed(spec["seed"])
        b = int(spec["batch_size"])
        x = torch.randn((b,) + tuple(shape), generator=gen).to(device)
        y = torch.randint(0, classes, (b,), generator=gen).to(device)
        step, _ = build_step(spec["method"], model, x, y, spec["seed"])
        sync()
        rec["mem_setup_mb"] = (torch.cuda.memory_allocated() / 2 ** 20) if cuda else rss_mb()
        stage = "warmup"
        # At least `warmup` steps and at least `warmup_time` seconds: the first steps of a fresh
        # process pay for lazy initialisation, allocator growth and first-touch page faults.
        t_w, n = time.perf_counter(), 0
        while n < int(spec["warmup"]) or (time.perf_counter() - t_w < spec.get("warmup_time", 0.0)
                                          and n < MAX_EXTRA_STEPS):
            step()
            sync()
            n += 1
        rec["warmup_steps"] = n
        live.stop()
        rec["live_peak_mb"] = live.peak_mb
        stage = "timed steps"
        busy0, self0, wall0 = cpu_busy_s(), self_cpu_s(), time.perf_counter()
        # `steps` timed steps; more while under `min_time` seconds (fast configs get more samples),
        # fewer (but at least 2) once over `max_time` seconds (slow configs fit the time budget).
        n_min, min_t, max_t = int(spec["steps"]), spec.get("min_time", 0.0), spec.get("max_time", math.inf)
        while True:
            elapsed, n = time.perf_counter() - wall0, len(rec["times_ms"])
            if n >= min(2, n_min) and elapsed > max_t:
                break
            if n >= n_min and (elapsed >= min_t or n >= n_min + MAX_EXTRA_STEPS):
                break
            t0 = time.perf_counter()
            step()
            sync()
            rec["times_ms"].append((time.perf_counter() - t0) * 1e3)
        busy1, self1, wall1 = cpu_busy_s(), self_cpu_s(), time.perf_counter()
        if busy0 is not None and wall1 > wall0:
            # Cores' worth of CPU that *other* processes used while this child was timed: contention.
            rec["foreign_cores"] = max(0.0, ((busy1 - busy0) - (self1 - self0)) / (wall1 - wall0))
    except BaseException as exc:  # noqa: BLE001 -- every failure becomes a status
        rec["status"] = _classify(exc)
        rec["error"] = f"{stage}: {type(exc).__name__}: {str(exc).strip()[:600]}"
        rec["traceback"] = traceback.format_exc()[-2000:]
    live.stop()  # after a failure in set-up or warm-up (no peak is recorded then)
    if cuda:
        rec["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
        rec["mem_increase_mb"] = rec["peak_mem_mb"] - rec["mem_base_mb"]
        rec["live_peak_mb"] = rec["peak_mem_mb"]  # the same measure: live tensor bytes
    else:
        rec["peak_mem_mb"] = peak_rss_mb()
        # File-backed pages faulted in since the baseline are library code and data touched for the
        # first time (e.g. oneDNN kernels, Opacus' modules), not memory the step allocates: leave them
        # out, so that Δ is the anonymous (tensor and heap) memory the step added.
        file_end = proc_status("RssFile").get("RssFile")
        rec["mem_file_faulted_mb"] = (file_end - file_base) if (file_end is not None and file_base is not None) else 0.0
        rec["mem_increase_mb"] = rec["peak_mem_mb"] - rec["mem_base_mb"] - rec["mem_file_faulted_mb"]
    return rec


def child_main(spec: dict, out_path: str) -> None:
    rec = run_one(spec)
    with open(out_path, "w") as f:
        json.dump(rec, f)


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _failure_from_exit(how: str, stderr_tail: str) -> dict:
    low = stderr_tail.lower()
    status = "oom" if ("memory" in low and ("alloc" in low or "out of" in low)) or "sigkill" in how else "crashed"
    return {"status": status, "error": f"child {how}; stderr tail: {stderr_tail[-600:]}", "times_ms": []}


def launch(spec: dict, timeout: float, mode: str) -> dict:
    """Runs ``spec`` in a fresh child; returns its record (a failure record if it died or timed out)."""
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        out_path, err_path = os.path.join(tmp, "out.json"), os.path.join(tmp, "stderr.txt")
        t0 = time.perf_counter()
        if mode == "fork":
            # The parent has imported the libraries but run no tensor op (no OpenMP pool exists),
            # so the child starts clean; it resets its peak RSS to its own baseline first thing.
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # child
                code = 0
                try:
                    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    child_main(spec, out_path)
                except BaseException:  # noqa: BLE001
                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            how = None
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    if os.WIFSIGNALED(status):
                        sig = os.WTERMSIG(status)
                        how = f"killed by {signal.Signals(sig).name}"
                    elif os.WEXITSTATUS(status):
                        how = f"exited with {os.WEXITSTATUS(status)}"
                    break
                if time.perf_counter() - t0 > timeout:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    how = "timeout"
                    break
                time.sleep(0.02)
        else:
            cmd = [sys.executable, "-m", "bench.step", "--child", json.dumps(spec), "--child-out", out_path]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            if spec.get("threads"):
                env["OMP_NUM_THREADS"] = str(spec["threads"])
            how = None
            with open(err_path, "w") as err:
                try:
                    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=err, stderr=err, timeout=timeout)
                    if proc.returncode < 0:
                        how = f"killed by {signal.Signals(-proc.returncode).name}"
                    elif proc.returncode:
                        how = f"exited with {proc.returncode}"
                except subprocess.TimeoutExpired:
                    how = "timeout"
        wall = time.perf_counter() - t0
        if how == "timeout":
            rec = {"status": "timeout", "error": f"no result within --timeout {timeout:g} s", "times_ms": []}
        elif os.path.exists(out_path) and os.path.getsize(out_path):
            with open(out_path) as f:
                rec = json.load(f)
        else:
            rec = _failure_from_exit(how or "wrote no result", _tail(err_path))
        rec["child_wall_s"] = wall
        return rec
