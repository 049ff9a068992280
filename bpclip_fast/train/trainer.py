"""One training run: configuration, loop, evaluation, ``run.json``, ``curves.png``, checkpoints.

``run(Config(...))`` is what ``bpclip-train`` calls and what ``bpclip-sweep`` calls once per grid
point; it returns the same dictionary it writes to ``run.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .. import accounting, models, registry
from .. import data as bdata
from .. import pca as pca_mod
from ..environment import environment
from . import data as data_mod
from . import methods as methods_mod

__all__ = ["Config", "run", "MODELS", "ModelSpec", "expected_calibration_error", "default_model"]

class ModelSpec(NamedTuple):
    """A ``--model``: its builder (``build(act=...)``), the image channels it takes and its
    number of spatial dimensions (2: ``[C, H, W]`` images; 1: ``[C, L]`` signals)."""

    build: Callable
    in_channels: int
    spatial_dims: int = 2


#: --model names; "auto" picks by data set (see default_model)
MODELS = {
    "mnist": ModelSpec(models.mnist_net, 1),                    # the paper's Fig. 3 net (no biases)
    "cifar10": ModelSpec(models.cifar10_net, 3),                # the paper's Fig. 4 net, as reconstructed (29.6M)
    "papernot-mnist": ModelSpec(models.papernot_mnist_net, 1),  # Papernot et al. 2021, Table 1
    "papernot-cifar10": ModelSpec(models.papernot_cifar10_net, 3),  # Papernot et al. 2021, Table 2
    # GroupNorm/LayerNorm, class token, positional embedding: exact per-example clipping only
    "resnet20-gn": ModelSpec(models.resnet20_gn, 1),            # ResNet-20 with GroupNorm (272k)
    "vit": ModelSpec(models.vit, 1),                            # a small vision transformer (139k)
    "mnist1d": ModelSpec(models.mnist1d_net, 1, 1),             # MNIST-1D's conv baseline (5.2k), [1, 40] signals
}

#: the methods whose clipping is backpropagation clipping (its bounds cover Linear/Conv2d/Conv1d only)
BACKPROP_METHODS = tuple(m for m, mode in methods_mod.ENGINE_METHODS.items() if mode == "backprop") + ("clip-only",)


# Settings that must not change between a checkpoint and its resumption.
_RESUME_KEYS = ("data", "val_size", "limit", "model", "activation", "tempered", "method", "epsilon", "sigma",
                "delta", "accountant", "sampling", "clip_fn", "conv_norm", "input_clip", "grad_clip",
                "max_grad_norm", "adaptive", "target_quantile", "clip_lr", "count_noise", "batch_size", "optimizer",
                "lr", "momentum", "seed", "noise", "bands", "integer_noise", "pca", "pca_noise", "pca_hidden")


@dataclass
class Config:
    """Every setting of a run (the CLI's options; see ``bpclip-train --help``).

    The defaults of the clipping bounds, batch size and learning rate were chosen for ``bpclip`` on
    digits: the validation-selected setting at ε = 3 of the first ``bpclip-sweep --preset digits``
    (issue 6; the issue-14 sweep in ``docs/results.md`` selected ``grad_clip`` 0.2 there)."""

    data: str = "digits"
    data_dir: str = "data"
    download: bool = False
    val_size: int = 5000
    limit: int | None = None
    model: str = "auto"
    activation: str = "tanh"
    tempered: str = "2,2,1"
    method: str = "bpclip"
    epsilon: float | None = None
    sigma: float | None = None
    delta: float = 1e-5
    accountant: str | None = None
    sampling: str | None = None
    clip_fn: str = "clip"
    conv_norm: str = "l15"
    input_clip: float = 2.0
    grad_clip: float = 1.0
    max_grad_norm: float = 1.0
    adaptive: bool = False
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    count_noise: float | None = None
    noise: str = "independent"
    bands: int = 1
    integer_noise: bool = False     # the engine's integer release (make_private(integer_noise=True))
    pca: int | None = None          # private PCA input layer of this many components (Abadi et al. 2016)
    pca_noise: float | None = None  # its σ_p
    pca_hidden: int = 256           # the hidden ReLU/--activation units of the MLP on top of it
    batch_size: int = 256
    epochs: int = 15
    optimizer: str = "adam"
    lr: float = 0.03
    momentum: float = 0.9
    seed: int = 0
    noise_seed: int | None = None
    device: str = "cpu"
    threads: int | None = None
    out: str | None = None
    checkpoint: str | None = None
    resume: bool = False
    progress: bool = True
    extra: dict = field(default_factory=dict)  # free-form labels (the sweep's), copied into run.json

    def resolved(self) -> "Config":
        """A copy with the defaults that depend on other settings filled in, validated."""
        c = dataclasses.replace(self, extra=dict(self.extra))
        if c.pca is not None:
            _check_pca(c)
        elif c.pca_noise is not None:
            raise ValueError("--pca-noise needs --pca K (the number of components)")
        if c.model == "auto":
            c.model = default_model(c.data)
        if c.model not in MODELS and c.model != PCA_MODEL:
            raise ValueError(f"unknown model {c.model!r}; choose auto or one of {', '.join(MODELS)}")
        if c.method not in methods_mod.METHODS:
            raise ValueError(f"unknown method {c.method!r}; choose one of {', '.join(methods_mod.METHODS)}")
        if c.method in BACKPROP_METHODS and c.model != PCA_MODEL:  # the PCA MLP: Linear layers only
            _check_backprop_model(c)
        # Which sampling each accountant analyses is the accountant's own attribute.
        samplings = {cls.sampling for cls in accounting.ACCOUNTANTS.values()}
        if c.accountant is None and c.sampling in samplings | {None}:
            c.accountant = accounting.default_accountant(c.sampling or "poisson")
        if c.accountant not in accounting.ACCOUNTANTS or c.sampling not in samplings | {None}:
            raise ValueError(f"unknown accountant {c.accountant!r} or sampling {c.sampling!r}")
        analysed = accounting.ACCOUNTANTS[c.accountant].sampling
        if c.sampling is None:
            c.sampling = analysed
        if c.sampling != analysed:
            raise ValueError(f"--accountant {c.accountant} does not analyse --sampling {c.sampling}: use rdp or pld "
                             "with poisson (add/remove one example), zcdp with shuffle (disjoint batches of a "
                             "shuffle); any other pairing would print an epsilon that does not bound the run")
        if c.method in methods_mod.PRIVATE_METHODS:
            if c.epsilon is not None and c.sigma is not None:
                raise ValueError("give --epsilon (the noise is calibrated to it) or --sigma, not both")
            if c.epsilon is None and c.sigma is None:
                c.epsilon = 3.0
            if not 0 < c.delta < 1:
                raise ValueError(f"--delta must be in (0, 1), got {c.delta}")
        else:  # no noise: ε and σ do not apply
            c.epsilon = c.sigma = None
        if c.adaptive and c.method not in methods_mod.ADAPTIVE_METHODS:
            raise ValueError(f"--adaptive (adaptive clipping thresholds) applies to --method "
                             f"{', '.join(methods_mod.ADAPTIVE_METHODS)}, not {c.method}")
        if c.adaptive:
            methods_mod.adaptive_options(c)  # the engine's checks of the options, before any work
        else:
            given = [opt for opt, key in (("--target-quantile", "target_quantile"), ("--clip-lr", "clip_lr"),
                                          ("--count-noise", "count_noise"))
                     if getattr(c, key) != getattr(_DEFAULTS, key)]
            if given:
                raise ValueError(f"{', '.join(given)}: an option of the adaptive clipping thresholds, which "
                                 "needs --adaptive")
        if c.noise not in ("independent", "banded"):
            raise ValueError(f"--noise must be independent or banded, got {c.noise!r}")
        if c.noise == "banded" and c.method not in methods_mod.ENGINE_METHODS:
            raise ValueError(f"--noise banded (correlated noise) applies to --method "
                             f"{', '.join(methods_mod.ENGINE_METHODS)}, not {c.method}")
        if c.bands != 1 and c.noise != "banded":
            raise ValueError("--bands needs --noise banded")
        if c.integer_noise and c.method not in methods_mod.ENGINE_METHODS:
            raise ValueError(f"--integer-noise applies to --method {', '.join(methods_mod.ENGINE_METHODS)}, "
                             f"not {c.method}")
        if c.epochs < 1 or c.batch_size < 1 or not c.lr > 0:
            raise ValueError("--epochs, --batch-size and --lr must be positive")
        if c.resume and not c.checkpoint:
            raise ValueError("--resume needs --checkpoint PATH")
        parse_tempered(c.tempered)
        return c


_DEFAULTS = Config()


def _check_backprop_model(c: Config) -> None:
    """Refuses a model with trainable layers that backpropagation clipping cannot bound, before any
    data is read. The model is built on the meta device: its layer types, without memory or time."""
    act = models.activation(c.activation, parse_tempered(c.tempered))
    with torch.device("meta"):
        unclipped = registry.unbounded(MODELS[c.model].build(act=act), "backprop")
    if unclipped:
        shown = ", ".join(unclipped[:4]) + (", ..." if len(unclipped) > 4 else "")
        raise ValueError(f"--model {c.model} has trainable layers that backpropagation clipping (--method {c.method}) "
                         f"has no bound for ({shown}): it clips Linear, Conv2d and Conv1d layers only; train this model "
                         "with exact per-example clipping: --method flat or --method per-layer (or --method dpsgd)")


PCA_MODEL = "pca-mlp"


def _check_pca(c) -> None:
    """``--pca K``: a frozen private PCA projection of the training inputs, then an MLP (``PCA_MODEL``).

    Private methods of our engine charge it to their accountant (``--pca-noise`` σ_p required);
    ``nonprivate`` and ``clip-only`` (no ε) use the exact PCA, and ``--pca-noise`` is refused there;
    ``dpsgd`` (Opacus' accountant, which cannot charge it) is refused."""
    if isinstance(c.pca, bool) or not isinstance(c.pca, int) or c.pca < 1:
        raise ValueError(f"--pca must be a positive number of components, got {c.pca!r}")
    if c.model not in ("auto", PCA_MODEL):
        raise ValueError(f"--pca builds its own model ({PCA_MODEL}: the projection, then --pca-hidden units); "
                         f"leave --model auto, not {c.model}")
    c.model = PCA_MODEL
    if c.method == "dpsgd":
        raise ValueError("--pca with --method dpsgd: Opacus' accountant cannot charge the private PCA; use "
                         "--method flat (the same DP-SGD by this library's engine, which charges it)")
    if c.method in methods_mod.ENGINE_METHODS:
        if c.pca_noise is None or not c.pca_noise > 0 or not math.isfinite(c.pca_noise):
            raise ValueError(f"--pca with --method {c.method} needs --pca-noise SIGMA_P > 0 (the PCA's noise "
                             f"multiplier, charged to the run's epsilon), got {c.pca_noise!r}")
    elif c.pca_noise is not None:
        raise ValueError(f"--pca-noise: --method {c.method} is not private and uses the exact PCA; drop it")
    if isinstance(c.pca_hidden, bool) or not isinstance(c.pca_hidden, int) or c.pca_hidden < 1:
        raise ValueError(f"--pca-hidden must be a positive integer, got {c.pca_hidden!r}")


def pca_net(c, train_ds, act, state=None) -> torch.nn.Sequential:
    """The projection (private on the *training* split only; validation and test are not touched),
    then ``Linear(K, H)``, the activation and ``Linear(H, 10)``. A resumed run takes the checkpoint's
    components rather than releasing the data a second time."""
    X = train_ds.tensors[0]
    private = c.method in methods_mod.ENGINE_METHODS
    if c.pca > X[0].numel():
        raise ValueError(f"--pca {c.pca}: more components than the {X[0].numel()} input features")
    if state is not None:
        proj = pca_mod.PCAProjection(state["model"]["0.components"], noise_multiplier=c.pca_noise if private else None,
                                     num_rows=len(X))
    elif private:
        seed = None if c.noise_seed is None else bdata.derive_seed(c.noise_seed, "pca")  # insecure, as the engine's
        proj = pca_mod.private_pca(X, c.pca, c.pca_noise, seed=seed)
    else:
        proj = pca_mod.exact_pca(X, c.pca)
    return torch.nn.Sequential(proj, torch.nn.Linear(c.pca, c.pca_hidden), act(), torch.nn.Linear(c.pca_hidden, 10))


def default_model(data: str) -> str:
    if data.startswith("mnist1d"):
        return "mnist1d"
    return "cifar10" if data == "cifar10" else "mnist"


def parse_tempered(text) -> tuple:
    try:
        s, T, o = (float(v) for v in str(text).split(","))
    except ValueError:
        raise ValueError(f"--tempered takes three numbers s,T,o (s*sigmoid(T*x)-o), got {text!r}") from None
    return s, T, o


# --------------------------------------------------------------------------- evaluation

def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 15) -> float:
    """ECE: ``Σ_b (|b|/n)·|accuracy(b) − confidence(b)|`` over ``n_bins`` equal-width bins of the
    top-class probability (Guo et al. 2017)."""
    if len(labels) == 0:
        return float("nan")
    conf, pred = probs.max(1)
    correct = (pred == labels).float()
    bins = torch.clamp((conf * n_bins).long(), max=n_bins - 1)
    ece = 0.0
    for b in range(n_bins):
        mask = bins == b
        if mask.any():
            ece += mask.float().mean().item() * abs(correct[mask].mean().item() - conf[mask].mean().item())
    return float(ece)


@torch.no_grad()
def evaluate(model, dataset, device, batch_size=1024) -> dict:
    was_training = model.training
    model.eval()
    X, y = dataset.tensors
    logits = torch.cat([model(X[i:i + batch_size].to(device)).float().cpu()
                        for i in range(0, len(X), batch_size)]) if len(X) else torch.zeros(0, 10)
    model.train(was_training)
    probs = logits.softmax(1)
    return {"accuracy": float((logits.argmax(1) == y).float().mean()) if len(y) else float("nan"),
            "loss": float(F.cross_entropy(logits, y)) if len(y) else float("nan"),
            "ece": expected_calibration_error(probs, y)}


# --------------------------------------------------------------------------- progress

class _Bar:
    """A tqdm bar over one epoch's batches, or nothing (--quiet / tqdm missing)."""

    def __init__(self, iterable, total, desc, enabled):
        self.bar = None
        self.iterable = iterable
        if enabled:
            try:
                from tqdm.auto import tqdm

                # Not tqdm(iterable): tqdm closes itself when the iteration ends, and the epoch's
                # validation accuracy and ε, known only after it, would never be shown.
                self.bar = tqdm(total=total, desc=desc, leave=True, dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass

    def __iter__(self):
        for item in self.iterable:
            yield item
            if self.bar is not None:
                self.bar.update(1)  # the step on `item` is done

    def postfix(self, **kw):
        if self.bar is not None:
            self.bar.set_postfix(kw, refresh=False)

    def close(self, **kw):
        if self.bar is not None:
            self.bar.set_postfix(kw)
            self.bar.close()


# --------------------------------------------------------------------------- checkpoints

def _save_checkpoint(path, cfg, method, epoch, history, elapsed, thresholds, step_times):
    state = {"format": "bpclip_fast.train/1", "config": dataclasses.asdict(cfg), "epoch": epoch,
             "history": history, "elapsed_s": elapsed, "thresholds": thresholds, "step_times": step_times,
             "model": method.model_state_dict(),
             "method": method.state_dict(), "sigma": (method.privacy().get("noise_multiplier")
                                                      if method.private else None)}
    tmp = f"{path}.tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(state, tmp)
    os.replace(tmp, path)  # never a half-written checkpoint


def _load_checkpoint(path, cfg):
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != "bpclip_fast.train/1":
        raise ValueError(f"{path}: not a bpclip-train checkpoint")
    saved = state["config"]
    # a key the checkpoint's version did not have yet (noise, bands, integer_noise) had its default then
    diff = [f"{k}: checkpoint {saved.get(k, getattr(_DEFAULTS, k))!r}, now {getattr(cfg, k)!r}" for k in _RESUME_KEYS
            if saved.get(k, getattr(_DEFAULTS, k)) != getattr(cfg, k)]
    if diff:
        raise ValueError(f"--resume: {path} was written by a run with other settings:\n  " + "\n  ".join(diff))
    return state


# --------------------------------------------------------------------------- the run

def _epoch_seed(seed, epoch):
    return (int(seed) * 1_000_003 + int(epoch)) % (2 ** 63)


def run(cfg: Config) -> dict:
    """Trains, evaluates and reports one configuration; returns the ``run.json`` dictionary."""
    t_start = time.perf_counter()
    cfg = cfg.resolved()
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % (2 ** 32))

    splits = data_mod.load_dataset(cfg.data, cfg.data_dir, val_size=cfg.val_size, download=cfg.download,
                                   limit=cfg.limit)
    act = models.activation(cfg.activation, parse_tempered(cfg.tempered))
    state = None
    if cfg.resume and os.path.exists(cfg.checkpoint):
        state = _load_checkpoint(cfg.checkpoint, cfg)
    elif cfg.resume:
        warnings.warn(f"--resume: no checkpoint at {cfg.checkpoint} yet; starting from scratch", stacklevel=2)
    if cfg.pca is not None:
        net = pca_net(cfg, splits.train, act, state)
    else:
        spec = MODELS[cfg.model]
        if len(splits.input_shape) - 1 != spec.spatial_dims:
            kind = {1: "1-D signals [C, L]", 2: "2-D images [C, H, W]"}
            raise ValueError(f"--model {cfg.model} takes {kind[spec.spatial_dims]} but {cfg.data} has "
                             f"{kind.get(len(splits.input_shape) - 1, list(splits.input_shape))}; use --model auto")
        if splits.input_shape[0] != spec.in_channels:
            raise ValueError(f"--model {cfg.model} takes {spec.in_channels}-channel images but {cfg.data} has "
                             f"{splits.input_shape[0]}; use --model auto")
        net = spec.build(act=act)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    elif device.type == "cpu" and sum(p.numel() for p in net.parameters()) < 1_000_000:
        # small nets: one thread is faster (thread start-up dominates the tiny kernels) and leaves
        # the other cores alone; --threads overrides
        torch.set_num_threads(1)
    net = net.to(device)
    train_ds = splits.train
    generator = torch.Generator().manual_seed(cfg.seed)

    # (an explicit --noise-seed warns here, InsecureSeedWarning: deliberately left visible)
    method = methods_mod.build_method(cfg, net, train_ds, generator,
                                      sigma=state["sigma"] if state is not None else None)
    history, start_epoch, elapsed_before = [], 1, 0.0
    # the clipping thresholds after every step (our engine's methods; None for the others) and the
    # wall time of every step: both carried on through a checkpoint
    thresholds, step_times = ([] if method.thresholds() is not None else None), []
    if state is not None:
        method.load_model_state_dict(state["model"])
        method.load_state_dict(state["method"])
        history, start_epoch, elapsed_before = list(state["history"]), state["epoch"] + 1, state["elapsed_s"]
        step_times = list(state.get("step_times", []))
        if thresholds is not None:
            thresholds = list(state.get("thresholds") or [])
    if thresholds is not None:
        # where this process starts: step 0, or after a resume the thresholds the checkpoint restored
        # (marked, so that run.json shows they carry on from the entry before)
        entry = {"step": history[-1]["steps"] if history else 0, "values": method.thresholds()}
        thresholds.append({**entry, "resumed": True} if state is not None else entry)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)

    model = method.model
    model.train()
    t_train = time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs + 1):
        torch.manual_seed(_epoch_seed(cfg.seed, epoch))  # Opacus' sampling and noise (non-secure mode)
        generator.manual_seed(_epoch_seed(cfg.seed, epoch))  # the shuffle of non-private loaders
        bar = _Bar(method.loader, len(method.loader), f"epoch {epoch}/{cfg.epochs}", cfg.progress)
        loss_sum, correct, seen = 0.0, 0, 0
        steps_done = history[-1]["steps"] if history else 0
        # ε spent before this epoch (evaluated once per epoch: a PLD evaluation can take a second)
        eps_so_far = {"eps": f"{history[-1]['epsilon'] if history else 0.0:.2f}"} if method.private else {}
        for x, y in bar:
            steps_done += 1
            x, y = x.to(device), y.to(device)
            sync(device)
            t0 = time.perf_counter()
            ls, c = method.train_step(x, y)
            sync(device)  # the step's kernels, not only their launch
            step_times.append(time.perf_counter() - t0)
            if thresholds is not None:
                thresholds.append({"step": steps_done, "values": method.thresholds()})
            loss_sum, correct, seen = loss_sum + ls, correct + c, seen + len(y)
            bar.postfix(loss=f"{loss_sum / max(seen, 1):.3f}", acc=f"{correct / max(seen, 1):.3f}", **eps_so_far)
        val = evaluate(method.eval_model, splits.val, device)
        eps = method.epsilon(cfg.delta) if method.private else None
        record = {"epoch": epoch, "train_loss": loss_sum / max(seen, 1), "train_accuracy": correct / max(seen, 1),
                  "val_accuracy": val["accuracy"], "val_loss": val["loss"], "epsilon": eps,
                  "steps": method.privacy()["steps"] if method.private else steps_done,
                  "time_s": elapsed_before + time.perf_counter() - t_train}
        history.append(record)
        post = {"loss": f"{record['train_loss']:.3f}", "acc": f"{record['train_accuracy']:.3f}",
                "val": f"{val['accuracy']:.3f}"}
        if eps is not None:
            post["eps"] = f"{eps:.2f}"
        bar.close(**post)
        if cfg.checkpoint:
            _save_checkpoint(cfg.checkpoint, cfg, method, epoch, history,
                             elapsed_before + time.perf_counter() - t_train, thresholds, step_times)

    test = evaluate(method.eval_model, splits.test, device)
    val = evaluate(method.eval_model, splits.val, device)
    result = {"config": dataclasses.asdict(cfg), "data": {"name": splits.name, **splits.sizes(),
                                                          "input_shape": list(splits.input_shape)},
              "model_parameters": sum(p.numel() for p in model.parameters()),
              "history": history, "val_accuracy": val["accuracy"], "val_ece": val["ece"],
              "test_accuracy": test["accuracy"], "test_loss": test["loss"], "ece": test["ece"],
              "thresholds": thresholds, **step_time_summary(step_times)}
    if cfg.pca is not None:
        proj = net[0]
        result["pca"] = {"components": proj.out_features, "in_features": proj.in_features,
                         "noise_multiplier": proj.noise_multiplier, "rows": proj.num_rows,
                         "hidden": cfg.pca_hidden, "private": proj.private}
    if method.private:
        priv = method.privacy()
        result["epsilon"] = method.epsilon(cfg.delta)
        result["delta"] = cfg.delta
        result["accountant"] = cfg.accountant
        result["epsilons"] = methods_mod.epsilon_report(priv["accountant_state"], cfg.sampling, cfg.delta)
        if cfg.method == "dpsgd":
            ops = method.opacus_epsilon(cfg.delta)
            if ops is not None:
                result["epsilons"]["opacus_rdp"] = ops
        result["sigma"] = priv["noise_multiplier"]
        result["effective_sigma"] = priv["effective_noise_multiplier"]
        result["steps"] = priv["steps"]
        result["privacy"] = {k: v for k, v in priv.items() if k != "accountant_state"}
        result["privacy"]["accountant_history"] = [list(h) for h in priv["accountant_state"]["history"]]
        # one-off events (a private PCA, [σ_p, 1.0]): composed into every epsilon above
        result["privacy"]["accountant_events"] = [list(e) for e in priv["accountant_state"].get("events", [])]
        result["target_epsilon"] = cfg.epsilon
    else:
        result.update({"epsilon": None, "delta": None, "accountant": None, "epsilons": {}, "sigma": None,
                       "effective_sigma": None, "target_epsilon": None,
                       "steps": history[-1]["steps"] if history else 0})
    result["wall_time_s"] = elapsed_before + time.perf_counter() - t_start
    result.update(environment(device))

    if cfg.out:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "run.json"), "w") as f:
            f.write(_run_json_text(_jsonable(result)))
        try:
            from .report import plot_curves

            plot_curves(result, os.path.join(cfg.out, "curves.png"))
        except ImportError as exc:  # matplotlib missing: run.json is still written
            warnings.warn(f"curves.png not written ({exc}); pip install matplotlib", stacklevel=2)
    return _jsonable(result)


def step_time_summary(step_times) -> dict:
    """The median and 90th percentile of the steps' wall times (seconds; None without steps): each
    ``train_step`` alone (forward, backward, clipping, noise, optimizer), not data loading or evaluation."""
    if not step_times:
        return {"step_time_median_s": None, "step_time_p90_s": None, "step_time_n": 0}
    t = np.asarray(step_times, dtype=float)
    return {"step_time_median_s": float(np.median(t)), "step_time_p90_s": float(np.percentile(t, 90)),
            "step_time_n": len(t)}


def summary_line(result: dict) -> str:
    c = result["config"]
    parts = [f"{c['method']} on {c['data']}: test accuracy {result['test_accuracy']:.4f}"]
    if result.get("epsilon") is not None:
        parts.append(f"epsilon {result['epsilon']:.3f} at delta {result['delta']:g} ({result['accountant']}, "
                     f"sigma {result['sigma']:.3f}, {result['steps']} steps)")
    else:
        parts.append("epsilon inf (no noise: not private)")
    parts.append(f"ECE {result['ece']:.3f}")
    parts.append(f"wall time {result['wall_time_s']:.1f} s")
    return " | ".join(parts)


def _run_json_text(result: dict) -> str:
    """``run.json``: indented, except that each entry of the per-step ``thresholds`` takes one line."""
    entries = result.get("thresholds") or []
    marks = [f"@thresholds-entry-{i}@" for i in range(len(entries))]
    text = json.dumps({**result, "thresholds": marks} if entries else result, indent=2)
    for mark, entry in zip(marks, entries):
        text = text.replace(json.dumps(mark), json.dumps(entry), 1)
    return text + "\n"


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x
