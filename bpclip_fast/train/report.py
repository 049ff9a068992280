"""Plots and tables of the trainer: a run's ``curves.png``, the sweep's plot and markdown table."""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(result: dict, path: str) -> None:
    """Training loss, validation accuracy and ε per epoch of one run."""
    plt = _pyplot()
    h = result["history"]
    ep = [r["epoch"] for r in h]
    eps = [r["epsilon"] for r in h]
    private = any(e is not None for e in eps)
    fig, axes = plt.subplots(1, 3 if private else 2, figsize=(12 if private else 8, 3.4))
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
    c = result["config"]
    fig.suptitle(f"{c['method']} / {c['data']} / {c['model']} ({c['activation']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
