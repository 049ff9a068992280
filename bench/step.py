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
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

METHODS = ("nonprivate", "bpclip_fast", "bpclip_reference", "opacus_hooks", "opacus_ghost", "opacus_functorch")
MODEL_NAMES = ("mnist", "cifar10", "mlp", "resnet20")
OPACUS_MODE = {"opacus_hooks": "hooks", "opacus_ghost": "ghost", "opacus_functorch": "functorch"}
FAILED = ("oom", "timeout", "unsupported", "error", "crashed")

# DP hyper-parameters: they change no cost, only the numbers. sigma = 1 so that noise is drawn.
INPUT_CLIP, GRAD_CLIP, SIGMA, LR = 1.0, 1.0, 1.0, 0.01

# --quick: the targets of issue 5 (MNIST b512; CIFAR-10 b32 and b128) and the two other models small.
QUICK_GRID = [("mnist", 512), ("cifar10", 32), ("cifar10", 128), ("mlp", 128), ("resnet20", 16)]
QUICK = dict(reps=3, warmup=1, steps=4, timeout=150.0, warmup_time=1.0, min_time=1.0, max_time=8.0)
DEFAULTS = dict(reps=5, warmup=2, steps=5, timeout=600.0, warmup_time=2.0, min_time=2.0, max_time=60.0)
MAX_EXTRA_STEPS = 100  # cap on the steps added by warmup_time / min_time

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# The child: one (model, method, batch size) measured in its own process.
# ----------------------------------------------------------------------------------------------

def _import_for(methods) -> None:
    """Imports what the methods need, so that the child's memory baseline is taken after them."""
    import torch  # noqa: F401

    import bench.models  # noqa: F401
    import bpclip_fast  # noqa: F401
    if any(m.startswith("opacus") for m in methods):
        import opacus  # noqa: F401


def _proc_status(*keys) -> dict:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in keys:
                    out[k] = int(v.split()[0]) / 1024.0  # kB -> MiB
    except OSError:
        pass
    return out


def _rss_mb() -> float:
    return _proc_status("VmRSS").get("VmRSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)


def _reset_peak_rss() -> bool:
    """Resets this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    hwm = _proc_status("VmHWM").get("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _cpu_busy_s() -> float | None:
    """Seconds of CPU time all processes of the machine have used (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _fix_mmap_threshold(mb: float) -> bool:
    """glibc: serve every allocation of ``mb`` MB or more by its own mmap, returned to the system on
    free, and stop the dynamic threshold (which after a large free rises to that size, so later big
    tensors come from the heap, whose freed space RSS keeps). Makes peak RSS follow live tensors."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        M_MMAP_THRESHOLD = -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(mb * 2 ** 20)))
    except (OSError, AttributeError):
        return False


class _LiveBytes:
    """CPU: the peak of live tensor bytes, the counterpart of ``torch.cuda.max_memory_allocated``.

    Peak RSS also holds what the C allocator keeps after tensors are freed (glibc raises its mmap
    threshold after a large free and then serves big tensors from a heap it rarely returns), which
    depends on the order of allocations more than on their sizes. PyTorch's profiler with
    ``profile_memory=True`` reports every CPU tensor allocation and free with its size; summing them
    in time order from before the model is built gives the exact peak of live bytes. Run over the
    warm-up steps only (never the timed ones). ``None`` where the profiler's event tree (a private
    API of torch) is unavailable.
    """

    def __init__(self, enabled: bool):
        self.prof, self.peak_mb = None, None
        if enabled:
            try:
                import torch.profiler as tp

                self.prof = tp.profile(activities=[tp.ProfilerActivity.CPU], profile_memory=True)
                self.prof.__enter__()
            except Exception:  # noqa: BLE001 -- an optional measurement
                self.prof = None

    def stop(self) -> None:
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        try:
            prof.__exit__(None, None, None)
            from torch._C._profiler import _EventType

            allocs, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
            while stack:
                node = stack.pop()
                if node.typed[0] == _EventType.Allocation:
                    allocs.append((node.start_time_ns, node.typed[1].alloc_size))
                stack.extend(node.children)
            live = peak = 0
            for _, size in sorted(allocs):
                live += size
                peak = max(peak, live)
            self.peak_mb = peak / 2 ** 20
        except Exception:  # noqa: BLE001
            self.peak_mb = None


def _build_step(method: str, model, x, y, seed: int):
    """The method's training step over ``model`` (wrapped here) as a zero-argument callable."""
    import torch
    from torch import nn

    crit = nn.CrossEntropyLoss(reduction="sum")  # sum: grad_clip is a per-example bound

    if method == "nonprivate":
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def step():
            opt.zero_grad(set_to_none=True)
            crit(model(x), y).backward()
            opt.step()
        return step, model

    if method == "bpclip_fast":
        import bpclip_fast.nn as bnn

        bnn.convert_model(model, input_clip=INPUT_CLIP, grad_clip=GRAD_CLIP)  # norm l15, clip_fn clip
        for _, layer in bnn.clipped_layers(model):
            layer.noise_multiplier = SIGMA
        stream = bnn.NoiseStream(seed=seed)  # explicit seed: reproducible (insecure; cost is the same)
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def step():
            opt.zero_grad(set_to_none=True)
            bnn.arm_noise(model, stream)         # noise added inside this step's backward
            crit(model(x), y).backward()
            bnn.check_finite(model)              # the per-step sync of the documented protocol
            opt.step()
        return step, model

    if method == "bpclip_reference":
        from bpclip_fast import reference as ref

        ref.attach(model, input_clip=INPUT_CLIP, grad_clip=GRAD_CLIP)
        shapes, _ = ref.record_input_shapes(model)
        gen = torch.Generator(device=x.device).manual_seed(seed)
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def step():
            opt.zero_grad(set_to_none=True)
            crit(model(x), y).backward()
            ref.add_noise(model, SIGMA, input_clip=INPUT_CLIP, grad_clip=GRAD_CLIP, input_shapes=shapes,
                          generator=gen)
            opt.step()
        return step, model

    if method in OPACUS_MODE:
        import warnings

        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        warnings.filterwarnings("ignore")  # secure_mode / accountant chatter
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        # The loader only tells make_private the batch size and sampling rate; the step feeds x, y.
        loader = DataLoader(TensorDataset(x, y), batch_size=x.shape[0])
        engine = PrivacyEngine(accountant="rdp")
        out = engine.make_private(module=model, optimizer=opt, data_loader=loader, criterion=crit,
                                  noise_multiplier=SIGMA, max_grad_norm=GRAD_CLIP, loss_reduction="sum",
                                  poisson_sampling=False, grad_sample_mode=OPACUS_MODE[method])
        if method == "opacus_ghost":
            pmodel, popt, pcrit, _ = out  # the criterion runs both backward passes of ghost clipping
        else:
            pmodel, popt, _ = out
            pcrit = crit

        def step():
            popt.zero_grad(set_to_none=True)
            pcrit(pmodel(x), y).backward()
            popt.step()                          # per-example clipping + noise + SGD
        return step, pmodel

    raise ValueError(f"unknown method {method!r}")


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
    _import_for([spec["method"]])
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
            rec["mallopt_ok"] = _fix_mmap_threshold(spec["mmap_threshold_mb"])
        rec["mem_base_mb"] = _rss_mb()
        file_base = _proc_status("RssFile").get("RssFile")
        rec["hwm_reset"] = _reset_peak_rss()
        if spec.get("mem_limit_mb"):
            # An address-space cap relative to now: an allocation beyond it fails with an error we can
            # record as "oom", instead of the kernel's OOM killer hitting whatever it picks.
            vm = _proc_status("VmSize").get("VmSize", 0.0)
            cap = int((vm + spec["mem_limit_mb"]) * 2 ** 20)
            resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))

    def sync():
        if cuda:
            torch.cuda.synchronize()

    stage = "setup"
    live = _LiveBytes(not cuda)
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
        step, _ = _build_step(spec["method"], model, x, y, spec["seed"])
        sync()
        rec["mem_setup_mb"] = (torch.cuda.memory_allocated() / 2 ** 20) if cuda else _rss_mb()
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
        busy0, self0, wall0 = _cpu_busy_s(), _self_cpu_s(), time.perf_counter()
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
        busy1, self1, wall1 = _cpu_busy_s(), _self_cpu_s(), time.perf_counter()
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
        rec["peak_mem_mb"] = _peak_rss_mb()
        # File-backed pages faulted in since the baseline are library code and data touched for the
        # first time (e.g. oneDNN kernels, Opacus' modules), not memory the step allocates: leave them
        # out, so that Δ is the anonymous (tensor and heap) memory the step added.
        file_end = _proc_status("RssFile").get("RssFile")
        rec["mem_file_faulted_mb"] = (file_end - file_base) if (file_end is not None and file_base is not None) else 0.0
        rec["mem_increase_mb"] = rec["peak_mem_mb"] - rec["mem_base_mb"] - rec["mem_file_faulted_mb"]
    return rec


# ----------------------------------------------------------------------------------------------
# The launcher: children by fork (CPU default) or by a new interpreter (--launch exec; CUDA).
# ----------------------------------------------------------------------------------------------

def _child_main(spec: dict, out_path: str) -> None:
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
                    _child_main(spec, out_path)
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


# ----------------------------------------------------------------------------------------------
# Aggregation and reports.
# ----------------------------------------------------------------------------------------------

def _quantile(sorted_xs, q):
    if not sorted_xs:
        return float("nan")
    pos = (len(sorted_xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def aggregate(key, reps: list, common: dict) -> dict:
    """One record per (model, method, batch size) from its reps' records."""
    model, method, bs = key
    ok = [r for r in reps if r["status"] == "ok"]
    bad = [r for r in reps if r["status"] != "ok"]
    times = sorted(t for r in ok for t in r["times_ms"])
    if ok and not bad:
        status = "ok"
    elif ok:
        status = "partial"
    else:
        status = bad[0]["status"] if bad else "not_run"
    rec = {"model": model, "method": method, "batch_size": bs, **common, "status": status}
    rec.update({
        "step_ms_median": statistics.median(times) if times else None,
        "step_ms_min": times[0] if times else None,
        "step_ms_max": times[-1] if times else None,
        "step_ms_q25": _quantile(times, 0.25) if times else None,
        "step_ms_q75": _quantile(times, 0.75) if times else None,
        "rep_medians_ms": [statistics.median(r["times_ms"]) for r in ok],
        "n_steps": len(times),
        "n_reps": len(reps),
        "n_reps_ok": len(ok),
    })
    rec["step_ms_iqr"] = (rec["step_ms_q75"] - rec["step_ms_q25"]) if times else None
    src = ok or reps
    mem = [r for r in src if r.get("peak_mem_mb") is not None]
    if mem:
        rec["peak_mem_mb"] = max(r["peak_mem_mb"] for r in mem)
        rec["mem_base_mb"] = statistics.median(r["mem_base_mb"] for r in mem)
        rec["mem_increase_mb"] = max(r["mem_increase_mb"] for r in mem)
        rec["mem_setup_mb"] = max((r["mem_setup_mb"] for r in mem if r.get("mem_setup_mb") is not None),
                                  default=None)
        live = [r["live_peak_mb"] for r in mem if r.get("live_peak_mb") is not None]
        rec["live_peak_mb"] = max(live) if live else None
    else:
        rec.update(peak_mem_mb=None, mem_base_mb=None, mem_increase_mb=None, mem_setup_mb=None, live_peak_mb=None)
    rec["params"] = next((r["params"] for r in reps if r.get("params")), None)
    rec["threads"] = next((r["threads"] for r in reps if r.get("threads")), common.get("threads"))
    rec["peak_reset_ok"] = all(r.get("hwm_reset") is not False for r in src)
    if any("mallopt_ok" in r for r in src):
        rec["mallopt_ok"] = all(r.get("mallopt_ok") for r in src)
    if bad:
        rec["errors"] = sorted({r.get("error", "")[:400] for r in bad})
    rec["child_wall_s"] = sum(r.get("child_wall_s", 0.0) for r in reps)
    # 1-minute load average around the children (this benchmark's own child counts ~threads): a value
    # well above the thread count means another process competed for the cores.
    rec["loadavg_max"] = max((r.get("loadavg", 0.0) for r in reps), default=None)
    foreign = [r["foreign_cores"] for r in ok if r.get("foreign_cores") is not None]
    rec["foreign_cores_max"] = max(foreign) if foreign else None
    if any(r.get("mem_file_faulted_mb") is not None for r in mem):
        rec["mem_file_faulted_mb"] = max(r.get("mem_file_faulted_mb") or 0.0 for r in mem)
    return rec


def _fmt(v, spec=".1f"):
    return "–" if v is None else format(v, spec)


def _mem_ratio(r: dict, base: dict | None, key: str) -> str | None:
    if base and r.get(key) is not None and base.get(key):
        return f"{r[key] / base[key]:.2f}×"
    return None


def markdown_table(records: list) -> str:
    """Per (model, batch size): every method's step time and memory, and their ratios to nonprivate.

    Time ratios use the medians (and, in brackets, the minima); the memory ratio uses Δ peak, the
    peak memory above the child's baseline after imports; "live peak" is the peak of live tensor
    bytes (on CPU from the profiler over the warm-up steps, on CUDA max_memory_allocated), which
    leaves out what the C allocator keeps (see docs/benchmarks.md).
    """
    lines = ["| model | batch | method | median ms | min ms | IQR ms | × nonprivate time (min) | "
             "peak MB | Δ peak MB | × nonprivate Δ mem | live peak MB | × nonprivate live | others' cores | status |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    groups = {}
    for r in records:
        groups.setdefault((r["model"], r["batch_size"]), []).append(r)
    for (model, bs), rs in groups.items():
        base = next((r for r in rs if r["method"] == "nonprivate" and r["step_ms_median"] is not None), None)
        for r in sorted(rs, key=lambda r: METHODS.index(r["method"]) if r["method"] in METHODS else 99):
            has_t = r["step_ms_median"] is not None
            t_ratio = None
            if base and has_t:
                t_ratio = (f"{r['step_ms_median'] / base['step_ms_median']:.2f}× "
                           f"({r['step_ms_min'] / base['step_ms_min']:.2f}×)")
            m_ratio, l_ratio = (_mem_ratio(r, base, key) if has_t else None
                                for key in ("mem_increase_mb", "live_peak_mb"))
            lines.append(
                f"| {model} | {bs} | {r['method']} | {_fmt(r['step_ms_median'])} | {_fmt(r['step_ms_min'])} | "
                f"{_fmt(r['step_ms_iqr'])} | {t_ratio or '–'} | "
                f"{_fmt(r.get('peak_mem_mb'), '.0f') if has_t else '–'} | "
                f"{_fmt(r.get('mem_increase_mb'), '.0f') if has_t else '–'} | {m_ratio or '–'} | "
                f"{_fmt(r.get('live_peak_mb'), '.0f') if has_t else '–'} | {l_ratio or '–'} | "
                f"{_fmt(r.get('foreign_cores_max'), '.2f')} | {r['status']} |")
    return "\n".join(lines)


def plot(records: list, path: str) -> None:
    """Two panels of grouped bars: step time and Δ peak memory, each as a ratio to nonprivate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = []
    for r in records:
        if (r["model"], r["batch_size"]) not in groups:
            groups.append((r["model"], r["batch_size"]))
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    by = {(r["model"], r["batch_size"], r["method"]): r for r in records}
    fig, axes = plt.subplots(2, 1, figsize=(max(7, 1.7 * len(groups) + 2), 8), sharex=True)
    width = 0.8 / max(1, len(methods))
    for ax, field, label in ((axes[0], "step_ms_median", "step time / nonprivate"),
                             (axes[1], "mem_increase_mb", "Δ peak memory / nonprivate")):
        for j, m in enumerate(methods):
            xs, hs, fails = [], [], []
            for i, (model, bs) in enumerate(groups):
                base = by.get((model, bs, "nonprivate"))
                r = by.get((model, bs, m))
                x = i - 0.4 + width * (j + 0.5)
                if r is None:
                    continue
                ok = r["step_ms_median"] is not None and base and base.get(field)
                if ok and r.get(field) is not None:
                    xs.append(x)
                    hs.append(r[field] / base[field])
                else:
                    fails.append((x, r["status"]))
            ax.bar(xs, hs, width, label=m)
            for x, st in fails:
                ax.text(x, 1.0, st, rotation=90, ha="center", va="bottom", fontsize=7, color="crimson")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(label + " (log)")
        ax.grid(axis="y", alpha=0.3, which="both")
    axes[1].set_xticks(range(len(groups)))
    axes[1].set_xticklabels([f"{m}\nb{b}" for m, b in groups])
    axes[0].legend(fontsize=8, ncol=3)
    first = records[0] if records else {}
    axes[0].set_title(f"bench.step on {first.get('device', '?')}, {first.get('threads', '?')} threads "
                      f"(failures labelled in red)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _versions() -> dict:
    import torch

    import bpclip_fast
    v = {"python": platform.python_version(), "torch": torch.__version__, "bpclip_fast": bpclip_fast.__version__}
    try:
        from importlib.metadata import version
        v["opacus"] = version("opacus")
    except Exception:  # noqa: BLE001
        v["opacus"] = None
    return v


def _machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            mem_total = next(int(ln.split()[1]) // 1024 for ln in f if ln.startswith("MemTotal"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpus": len(os.sched_getaffinity(0)), "mem_total_mb": mem_total,
            "platform": platform.platform()}


def wait_quiet(max_wait: float, threshold: float = 0.3, window: float = 0.5) -> float:
    """Waits (up to ``max_wait`` s) until other processes use under ``threshold`` cores; returns the wait."""
    t0 = time.perf_counter()
    while max_wait > 0:
        b0, s0 = _cpu_busy_s(), _self_cpu_s()
        time.sleep(window)
        b1, s1 = _cpu_busy_s(), _self_cpu_s()
        if b0 is None or ((b1 - b0) - (s1 - s0)) / window < threshold or time.perf_counter() - t0 > max_wait:
            break
    return time.perf_counter() - t0


def _mem_available_mb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"the fixed grid {QUICK_GRID} with {QUICK} (finishes in < 10 min on 2 CPU cores); "
                        "--models/--batch-sizes then filter that grid, other options still override")
    p.add_argument("--models", default=None, help=f"comma-separated, of {MODEL_NAMES} (default: all)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {METHODS}")
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
        _child_main(json.loads(args.child), args.child_out)
        return []

    models = _split(args.models or ",".join(MODEL_NAMES), MODEL_NAMES)
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
            avail = _mem_available_mb()
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
    _import_for(methods)
    common = {"device": args.device, "threads": threads, "warmup": warmup, "steps_per_rep": steps,
              "warmup_time_s": warmup_time, "min_time_s": min_time, "max_time_s": max_time,
              "mem_limit_mb": mem_limit, "launch": launch_mode, "act": args.act, "seed": args.seed,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
              "mmap_threshold_mb": args.mmap_threshold_mb or None,
              "versions": _versions(), "machine": _machine(),
              "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              "memory_metric": "cuda max_memory_allocated" if cuda else "peak RSS (VmHWM, reset after imports)"}
    print(f"bench.step: {len(grid)} (model, batch) × {len(methods)} methods × {reps} reps; warmup {warmup}, "
          f"{steps} timed steps per child; device {args.device}, threads {threads}, launch {launch_mode}, "
          f"timeout {timeout:g} s, mem limit {_fmt(mem_limit, '.0f')} MB", flush=True)

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
                      f"median {_fmt(med, '8.1f')} ms  peak {_fmt(rec.get('peak_mem_mb'), '6.0f')} MB "
                      f"(Δ {_fmt(rec.get('mem_increase_mb'), '.0f')})  [{rec['child_wall_s']:.1f} s, "
                      f"others used {_fmt(rec.get('foreign_cores'), '.2f')} cores]"
                      + (f"  {rec.get('error', '')[:160]}" if rec["status"] != "ok" else ""), flush=True)

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
