"""Plots and tables of the trainer: a run's ``curves.png``, the sweep's plot and markdown table."""

from __future__ import annotations

import itertools


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(result: dict, path: str) -> None:
    """Training loss, validation accuracy and ε per epoch of one run; adaptive clipping thresholds
    (any that moved) per step."""
    plt = _pyplot()
    h = result["history"]
    ep = [r["epoch"] for r in h]
    eps = [r["epsilon"] for r in h]
    private = any(e is not None for e in eps)
    th = [t for t in result.get("thresholds") or [] if not t.get("resumed")]
    moved = th and any(t["values"] != th[0]["values"] for t in th)
    n = 2 + private + bool(moved)
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.4))
    axes[0].plot(ep, [r["train_loss"] for r in h], marker="o")
    axes[0].set(xlabel="epoch", ylabel="train loss", title="training loss")
    axes[1].plot(ep, [r["val_accuracy"] for r in h], marker="o", label="validation")
    axes[1].plot(ep, [r["train_accuracy"] for r in h], marker=".", ls="--", label="train (running)")
    axes[1].axhline(result["test_accuracy"], color="k", lw=0.8, ls=":", label="final test")
    axes[1].set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    axes[1].legend(fontsize=8)
    if private:
        axes[2].plot(ep, eps, marker="o")
        axes[2].set(xlabel="epoch", ylabel=f"epsilon at delta={result['delta']:g}",
                    title=f"privacy spent ({result['accountant']})")
    if moved:
        ax = axes[-1]
        for name in th[0]["values"]:
            ax.plot([t["step"] for t in th], [t["values"][name] for t in th], lw=1, label=name)
        ax.set_yscale("log")
        ax.set(xlabel="step", ylabel="threshold", title="adaptive clipping thresholds")
        if len(th[0]["values"]) <= 8:
            ax.legend(fontsize=6)
    c = result["config"]
    fig.suptitle(f"{c['method']} / {c['data']} / {c['model']} ({c['activation']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt_hp(hp):
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(hp.items())) or "-"


#: what the table's "median step (ms)" column is (written under the table in results.md)
STEP_TIME_NOTE = ("median step (ms): the wall time of one training step (forward, backward, clipping, noise "
                  "and the optimizer's update; not data loading or evaluation), the median over the selected "
                  "setting's seeds of each run's median step; measured with the sweep's --threads per run "
                  "and --jobs runs side by side, so compare it within one sweep, on one machine.")


def markdown_table(best: list[dict]) -> str:
    """One row per (arm, ε budget): validation-selected test accuracy and ECE, mean ± std over seeds,
    and the selected setting's median step time (:data:`STEP_TIME_NOTE`)."""
    rows = ["| method | ε budget | ε spent | σ | test accuracy | ECE | val. accuracy | median step (ms) | seeds | "
            "selected (of n) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for b in best:
        eps = "∞ (not private)" if b["epsilon_budget"] is None else f"{b['epsilon_budget']:g}"
        spent = "-" if b["epsilon_spent"] is None else f"{b['epsilon_spent']:.3f}"
        sigma = "-" if b["sigma"] is None else f"{b['sigma']:.3g}"
        step = "-" if b.get("step_time_median_s") is None else f"{1000 * b['step_time_median_s']:.1f}"
        rows.append(f"| {b['label']} | {eps} | {spent} | {sigma} | {b['test_mean']:.4f} ± {b['test_std']:.4f} | "
                    f"{b['ece_mean']:.4f} ± {b['ece_std']:.4f} | {b['val_mean']:.4f} | {step} | {b['n_seeds']} | "
                    f"{_fmt_hp(b['hparams'])} ({b['n_configs']}) |")
    return "\n".join(rows) + "\n"


def plot_sweep(best: list[dict], path: str, title: str = "") -> None:
    """Test accuracy (validation-selected, mean ± std) against ε: each private arm a curve, each
    non-private reference a horizontal band."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels = list(dict.fromkeys(b["label"] for b in best))
    private_eps = sorted({b["epsilon_budget"] for b in best if b["epsilon_budget"] is not None})
    markers = itertools.cycle("osD^v<>")
    references = itertools.cycle([("0.2", "--"), ("0.55", ":"), ("0.4", "-.")])
    for label in labels:
        bs = [b for b in best if b["label"] == label]
        if bs[0]["epsilon_budget"] is None:
            m, s = bs[0]["test_mean"], bs[0]["test_std"]
            color, ls = next(references)
            ax.axhline(m, ls=ls, lw=1.2, color=color, label=f"{label} (ε = ∞)")
            if private_eps:
                ax.axhspan(m - s, m + s, color=color, alpha=0.10)
            continue
        bs.sort(key=lambda b: b["epsilon_budget"])
        ax.errorbar([b["epsilon_budget"] for b in bs], [b["test_mean"] for b in bs],
                    yerr=[b["test_std"] for b in bs], marker=next(markers), capsize=3, label=label)
    if private_eps:
        from matplotlib.ticker import NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(private_eps)
        ax.set_xticklabels([f"{e:g}" for e in private_eps])
    ax.set_xlabel("ε (budget, δ as configured)")
    ax.set_ylabel("test accuracy (validation-selected)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
