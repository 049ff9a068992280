"""From the reps' records to the results: one record per (model, method, batch size), the
markdown table and the bar chart, each with its ratios to ``nonprivate``."""

from __future__ import annotations

import math
import statistics

from bench.methods import METHODS


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


def fmt(v, spec=".1f"):
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
                f"| {model} | {bs} | {r['method']} | {fmt(r['step_ms_median'])} | {fmt(r['step_ms_min'])} | "
                f"{fmt(r['step_ms_iqr'])} | {t_ratio or '–'} | "
                f"{fmt(r.get('peak_mem_mb'), '.0f') if has_t else '–'} | "
                f"{fmt(r.get('mem_increase_mb'), '.0f') if has_t else '–'} | {m_ratio or '–'} | "
                f"{fmt(r.get('live_peak_mb'), '.0f') if has_t else '–'} | {l_ratio or '–'} | "
                f"{fmt(r.get('foreign_cores_max'), '.2f')} | {r['status']} |")
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
