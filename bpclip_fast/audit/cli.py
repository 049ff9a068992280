"""``bpclip-audit``: check the guarantee of a set-up (``bpclip-audit --help``).

Subcommands: ``sensitivity`` (:func:`bpclip_fast.audit.sensitivity`, in :mod:`.contribution`), ``one-run`` and ``many-run`` (:mod:`.empirical`).
Each prints one line and, with ``--json PATH``, writes the full report as JSON.
"""

from __future__ import annotations

import argparse
import sys


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with ``(default: value)``; a help that already says its default in
    words (``(default: fresh entropy)``, for a ``None`` default) is left as it is."""

    def _get_help_string(self, action):
        if "(default: " in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bpclip-audit", description=__doc__.splitlines()[0],
                                formatter_class=_Formatter)
    sub = p.add_subparsers(dest="command", required=True)
    _sensitivity_parser(sub)
    _one_run_parser(sub)
    _many_run_parser(sub)
    return p


# ---------------------------------------------------------------------------------------- sensitivity
def _sensitivity_parser(sub) -> None:
    p = sub.add_parser("sensitivity", help="each example's exact contribution to the release, and the noise drawn, "
                       "against the bounds",
                       description="Makes a model private with a real PrivacyEngine on the embedded digits data and "
                       "audits one batch (bpclip_fast.audit.sensitivity()): the largest contribution of one example "
                       "to the released gradient, measured through the real layers in training mode with the noise "
                       "off (by removal in float64, and alone in the model's own dtype), against the bound the noise "
                       "is scaled to; and the std of the noise the layers draw against sigma times that bound. Exit "
                       "code 0 if every bound holds and no layer is under-noised, 1 otherwise, 2 if the model cannot "
                       "be made private in that mode. The report holds data-dependent values: do not publish it for "
                       "private data.", formatter_class=_Formatter)
    p.add_argument("--model", default="mlp", help="mlp (Flatten, Linear(784, 32), act, Linear(32, 10)) or a "
                   "bpclip-train model: mnist, papernot-mnist, resnet20-gn, vit (the last two: flat/per_layer only, and "
                   "slower: 10-80 s with the default search)")
    p.add_argument("--mode", default="backprop", choices=("backprop", "flat", "per_layer"), help="clipping mode")
    p.add_argument("--activation", default="tanh", help="relu, tanh, tempered, gelu")
    p.add_argument("--sigma", type=float, default=1.0,
                   help="noise multiplier (the audit measures the noise the layers draw, on a copy of the model)")
    p.add_argument("--input-clip", type=float, default=2.0, help="backprop: C_x")
    p.add_argument("--grad-clip", type=float, default=1.0, help="backprop: C_g")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="flat/per_layer: C (per_layer: split C/sqrt(L))")
    p.add_argument("--loss-reduction", default="mean", choices=("mean", "sum"),
                   help="the loss of the audited batch: its mean or its sum over the examples")
    p.add_argument("--batch-size", type=int, default=32, help="the audited batch and the loader's B̄")
    p.add_argument("--adversarial-steps", type=int, default=10, help="gradient-ascent steps per start (0: none)")
    p.add_argument("--starts", type=int, default=2, help="examples the adversarial search starts from")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and the batch drawn")
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON (default: none written)")
    p.set_defaults(run=_run_sensitivity)


def _run_sensitivity(args) -> int:
    import json
    import warnings

    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from .. import PrivacyEngine, models
    from ..train import data as data_mod
    from ..train.trainer import MODELS
    from .contribution import sensitivity

    torch.manual_seed(args.seed)
    act = models.activation(args.activation)
    if args.model == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), act(), nn.Linear(32, 10))
    elif args.model in MODELS and MODELS[args.model].in_channels == 1:
        model = MODELS[args.model].build(act=act)
    else:
        names = ", ".join(["mlp"] + [n for n, spec in MODELS.items() if spec.in_channels == 1])
        print(f"bpclip-audit sensitivity: --model must be one of {names} (the digits are 1-channel), got "
              f"{args.model!r}", file=sys.stderr)
        return 2
    train = data_mod.load_dataset("digits").train
    loader = DataLoader(train, batch_size=args.batch_size)
    bounds = (dict(input_clip=args.input_clip, grad_clip=args.grad_clip) if args.mode == "backprop"
              else dict(max_grad_norm=args.max_grad_norm))
    if sum(p.numel() for p in model.parameters()) < 1_000_000:
        torch.set_num_threads(1)  # as bpclip-train: thread start-up dominates the tiny kernels
    engine = PrivacyEngine(accountant="rdp")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. torch's notes on the probes; the audit reports for itself
            model, _, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                              data_loader=loader, noise_multiplier=args.sigma, clipping=args.mode,
                                              loss_reduction=args.loss_reduction, **bounds)
    except (ValueError, TypeError) as exc:
        print(f"bpclip-audit sensitivity: --model {args.model} --mode {args.mode}: {exc}", file=sys.stderr)
        return 2
    pick = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))[:args.batch_size]
    x, y = train[pick]
    report = sensitivity(model, (x, y), engine=engine, adversarial_steps=args.adversarial_steps,
                         starts=args.starts)
    print(report.line())
    if args.json:
        out = report.to_dict()
        out["config"] = {k: v for k, v in vars(args).items() if k not in ("run", "command")}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if report.ok else 1


# ---------------------------------------------------------------------------------------- empirical
def _settings_arguments(p, d) -> None:
    """The audited configuration (``empirical.Settings``), shared by one-run and many-run; ``d``: the
    audit's defaults (``empirical.ONE_RUN_DEFAULTS`` / ``MANY_RUN_DEFAULTS``)."""
    from .empirical import ACCOUNTANTS, LAYERS, LOOPS, MODES, NOISES

    g = p.add_argument_group("the audited configuration")
    g.add_argument("--mode", choices=MODES, default=d.mode, help="clipping mode")
    g.add_argument("--accountant", choices=ACCOUNTANTS, default=d.accountant,
                   help="rdp/pld: Poisson sampling; zcdp: shuffled disjoint batches")
    g.add_argument("--sigma", type=float, default=d.noise_multiplier,
                   help="noise multiplier")
    g.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per run")
    g.add_argument("--batch-size", type=int, default=None,
                   help="expected batch size (default: the whole dataset, sample rate 1)")
    g.add_argument("--heads", type=int, default=d.heads,
                   help="parallel layers of the audited model")
    g.add_argument("--layer", choices=LAYERS, default="linear",
                   help="the audited layers: linear, or conv (1x1 Conv2d on a 1x1 image)")
    g.add_argument("--bias", action="store_true", help="give the audited layers a bias")
    g.add_argument("--clip", type=float, default=d.clip,
                   help="flat/per_layer max_grad_norm, or backprop input_clip = grad_clip")
    g.add_argument("--loss-reduction", choices=("mean", "sum"), default=d.loss_reduction,
                   help="the training loss: the mean or the sum over the batch")
    g.add_argument("--loop", choices=LOOPS, default="plain",
                   help="training loop: plain; inplace-zero (zero_grad(set_to_none=False) before each step's "
                        "backward); micro-batches (two accumulated passes)")
    g.add_argument("--fillers", type=int, default=d.fillers,
                   help="ordinary examples beside the canaries")
    g.add_argument("--noise", choices=NOISES, default=d.noise,
                   help="independent (a fresh draw each step) or banded (correlated across --bands steps; the "
                        "residual check whitens by the engine's band coefficients, the score reads each canary's "
                        "steps through them). Banded needs rdp/pld, --batch-size <= examples/bands, examples a "
                        "multiple of bands and --steps >= bands")
    g.add_argument("--bands", type=int, default=d.bands, help="bands of the banded noise")
    a = p.add_argument_group("the statistics")
    a.add_argument("--delta", type=float, default=d.delta, help="δ of the tested (ε, δ) claim")
    a.add_argument("--confidence", type=float, default=d.confidence,
                   help="confidence of the lower bound")
    a.add_argument("--seed", type=int, default=None,
                   help="reproducible run (inclusion, fillers and noise) (default: fresh entropy)")
    a.add_argument("--json", metavar="PATH", help="write the full report as JSON (default: none written)")


def _settings(args, defaults):
    from dataclasses import replace

    return replace(defaults, mode=args.mode, accountant=args.accountant, noise_multiplier=args.sigma,
                   steps=args.steps, batch_size=args.batch_size, heads=args.heads, layer=args.layer, bias=args.bias,
                   clip=args.clip, loss_reduction=args.loss_reduction, loop=args.loop, fillers=args.fillers,
                   delta=args.delta, confidence=args.confidence, seed=args.seed, noise=args.noise, bands=args.bands)


def _finish(report: dict, args) -> int:
    """One line on stdout, the JSON report on request; exit status 1 when the bound exceeds the claim."""
    import json

    from .empirical import line

    print(line(report))
    if report["power"] <= report["claimed_epsilon"]:
        print(f"note: this audit could not detect a violation of the claimed ε = {report['claimed_epsilon']:.3f} "
              f"(its power is {report['power']:.3f}); use more canaries or runs, or a larger σ", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if report["violation"] else 0


def _one_run_parser(sub) -> None:
    p = sub.add_parser("one-run", help="ε lower bound from one training run with m canaries (Steinke et al. 2023)",
                       description="One training run of the real engine with --canaries white-box gradient "
                                   "canaries, each included with probability 1/2; guesses on the highest and "
                                   "lowest scores give an ε lower bound (Steinke, Nasr, Jagielski, NeurIPS 2023).",
                       formatter_class=_Formatter)
    p.add_argument("--canaries", type=int, default=1000, help="number of canaries m")
    from .empirical import ONE_RUN_DEFAULTS

    _settings_arguments(p, ONE_RUN_DEFAULTS)

    def run(args):
        from .empirical import one_run

        # Distinct canary directions: without bias width 64 x classes 16 gives 1024 (more canaries, more
        # classes); with bias every canary needs an output of its own (empirical._pairs).
        if args.bias:
            layout = dict(width=8, classes=args.canaries)
        else:
            layout = dict(width=64, classes=max(16, -(-args.canaries // 64)))
        return _finish(one_run(_settings(args, ONE_RUN_DEFAULTS), canaries=args.canaries, **layout), args)

    p.set_defaults(run=run)


def _many_run_parser(sub) -> None:
    p = sub.add_parser("many-run", help="ε lower bound from many short runs with and without one canary",
                       description="--runs independent runs of the real engine, half with one white-box "
                                   "canary and half without; a threshold chosen on a quarter of the runs (--split) "
                                   "and Clopper-Pearson bounds on the rest. The tight check of a single step.",
                       formatter_class=_Formatter)
    p.add_argument("--runs", type=int, default=4000, help="number of runs, half with the canary")
    p.add_argument("--split", type=float, default=0.25,
                   help="fraction of the runs that chooses the threshold; the rest bound ε")
    from .empirical import MANY_RUN_DEFAULTS

    _settings_arguments(p, MANY_RUN_DEFAULTS)

    def run(args):
        from .empirical import many_run

        return _finish(many_run(_settings(args, MANY_RUN_DEFAULTS), runs=args.runs, split=args.split), args)

    p.set_defaults(run=run)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
