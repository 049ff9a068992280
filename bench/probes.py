"""What a benchmark process can read about its own memory and CPU time, and the machine's load.

Linux first (``/proc``), with ``getrusage`` where ``/proc`` is missing. No torch at import: the step
benchmark's launcher imports this before it sets ``OMP_WAIT_POLICY``.
"""

from __future__ import annotations

import os
import resource
import time


def proc_status(*keys) -> dict:
    """The named fields of ``/proc/self/status`` (those in kB), in MiB."""
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


def rss_mb() -> float:
    return proc_status("VmRSS").get("VmRSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)


def reset_peak_rss() -> bool:
    """Resets this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    hwm = proc_status("VmHWM").get("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def mem_available_mb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return None


def fix_mmap_threshold(mb: float) -> bool:
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


class LiveBytes:
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


def cpu_busy_s() -> float | None:
    """Seconds of CPU time all processes of the machine have used (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def wait_quiet(max_wait: float, threshold: float = 0.3, window: float = 0.5) -> float:
    """Waits (up to ``max_wait`` s) until other processes use under ``threshold`` cores; returns the wait."""
    t0 = time.perf_counter()
    while max_wait > 0:
        b0, s0 = cpu_busy_s(), self_cpu_s()
        time.sleep(window)
        b1, s1 = cpu_busy_s(), self_cpu_s()
        if b0 is None or ((b1 - b0) - (s1 - s0)) / window < threshold or time.perf_counter() - t0 > max_wait:
            break
    return time.perf_counter() - t0
