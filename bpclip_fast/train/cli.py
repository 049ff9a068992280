"""``bpclip-train``: train one model with backpropagation clipping, exact per-example clipping (ours or
Opacus' DP-SGD) or no privacy, and report.

Also ``python -m bpclip_fast.train``. ``bpclip-train --help`` lists every option.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from .. import models
from . import data as data_mod
from . import methods as methods_mod
from .trainer import MODELS, Config, run, summary_line

_D = Config()

DESCRIPTION = """\
Train an image classifier with differential privacy and report its test accuracy and epsilon.

Methods (--method):
  bpclip      backpropagation clipping (this library): every Linear/Conv2d layer clips each
              example's input (--input-clip) and upstream gradient (--grad-clip), and Gaussian
              noise scaled to the resulting bound is added once per step.
  flat        exact per-example clipping of each example's whole gradient to --max-grad-norm
              (DP-SGD) by this library's engine.
  per-layer   exact per-example clipping of each layer's gradient, --max-grad-norm split as
              C/sqrt(L) over the L layers, by this library's engine.
  dpsgd       DP-SGD with per-example gradient clipping (--max-grad-norm), run by Opacus.
  clip-only   bpclip's clipping without noise (not private; shows what clipping alone costs).
  nonprivate  ordinary training (not private).

--adaptive (bpclip, flat, per-layer): the clipping thresholds follow the --target-quantile of the
per-example norms (Andrew et al. 2021), learnt from noisy counts that are part of the privacy
accounting; the bounds given are the initial thresholds, and run.json records them every step.

Privacy: give --epsilon (the noise multiplier sigma is then calibrated so that the whole run
spends at most epsilon at --delta) or --sigma (epsilon is then reported). Without either,
--epsilon 3. Poisson sampling goes with the rdp (default) or pld accountant; shuffled disjoint
batches (--sampling shuffle) with zcdp.

Data (--data): digits (default: scikit-learn's 8x8 digits resized to 28x28, no download),
mnist1d / mnist1d-large (MNIST-1D, 5,000 / 20,000 length-40 signals generated offline by the mnist1d
package with its fixed seed 42), mnist, fmnist, cifar10 (standard files under --data-dir; the error
message says which).
Tune hyperparameters on the validation accuracy the run prints, never on the test accuracy."""

EXAMPLES = """\
examples:
  bpclip-train                                   # bpclip on digits at epsilon 3 (seconds on a CPU)
  bpclip-train --method dpsgd --activation tanh --epsilon 1 --out runs/dpsgd
  bpclip-train --method flat --max-grad-norm 1 --adaptive --epsilon 3
  bpclip-train --method bpclip --sigma 2 --epochs 5 --checkpoint ck.pt        # then add --resume
  bpclip-train --data mnist --data-dir ~/data --accountant pld --epsilon 2 --epochs 30
  bpclip-sweep --help                            # grids of runs, plots and tables"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bpclip-train", description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data", choices=data_mod.DATASETS, default=_D.data, help="data set (default: %(default)s)")
    g.add_argument("--data-dir", default=_D.data_dir,
                   help="folder with the mnist/fmnist/cifar10 files (default: %(default)s)")
    g.add_argument("--download", action="store_true",
                   help="fetch missing mnist/fmnist/cifar10 files with torchvision (needs torchvision and network)")
    g.add_argument("--val-size", type=int, default=_D.val_size,
                   help="mnist/fmnist/cifar10: training examples held out for validation (default: %(default)s; "
                        "digits has a fixed 1167/270/360 split, mnist1d 3500/500/1000, mnist1d-large "
                        "14000/2000/4000)")
    g.add_argument("--limit", type=int, default=None, help="use only the first N examples of each split (quick tries)")

    g = p.add_argument_group("model")
    g.add_argument("--model", choices=("auto",) + tuple(MODELS), default=_D.model,
                   help="mnist: the paper's MNIST net; cifar10: the paper's CIFAR-10 net (29.6M parameters); "
                        "papernot-mnist / papernot-cifar10: the nets of Papernot et al. 2021; "
                        "resnet20-gn: ResNet-20 with GroupNorm, vit: a small vision transformer (1-channel "
                        "28x28 images; --method flat/per-layer/dpsgd/nonprivate only, their norm layers and "
                        "embeddings are not bpclip's Linear/Conv2d); "
                        "mnist1d: MNIST-1D's Conv1d baseline (5.2k, [1, 40] signals); "
                        "auto: mnist for digits/mnist/fmnist, mnist1d for mnist1d/mnist1d-large, cifar10 for "
                        "cifar10 (default: %(default)s)")
    g.add_argument("--activation", choices=models.ACTIVATIONS, default=_D.activation,
                   help="activation of every hidden layer (default: %(default)s)")
    g.add_argument("--pca", type=int, default=None, metavar="K",
                   help="Abadi et al. 2016: a frozen private PCA projection of the training inputs to K dimensions, "
                        "then one hidden layer of --pca-hidden units (the model; --model auto). Private methods "
                        "of this library charge it to epsilon (--pca-noise); nonprivate/clip-only use the exact "
                        "PCA; refused with dpsgd")
    g.add_argument("--pca-noise", type=float, default=None, metavar="SIGMA_P",
                   help="--pca: noise multiplier of the PCA's covariance release (Abadi et al.: 16, 7, 4)")
    g.add_argument("--pca-hidden", type=int, default=_D.pca_hidden,
                   help="--pca: hidden units of the MLP on the projection (Abadi et al.: 1000; default: %(default)s)")
    g.add_argument("--tempered", default=_D.tempered, metavar="s,T,o",
                   help="tempered sigmoid s*sigmoid(T*x)-o for --activation tempered (default: %(default)s = tanh)")

    g = p.add_argument_group("method and privacy")
    g.add_argument("--method", choices=methods_mod.METHODS, default=_D.method, help="(default: %(default)s)")
    e = g.add_mutually_exclusive_group()
    e.add_argument("--epsilon", type=float, default=None,
                   help="privacy budget of the whole run; sigma is calibrated to it (default: 3 unless --sigma)")
    e.add_argument("--sigma", type=float, default=None,
                   help="noise multiplier: noise std = sigma x clipping bound (bpclip: of every layer); with "
                        "--adaptive the accountant's, the gradient's is slightly larger")
    g.add_argument("--delta", type=float, default=_D.delta, help="delta of (epsilon, delta)-DP (default: %(default)g)")
    g.add_argument("--accountant", choices=("rdp", "pld", "zcdp"), default=None,
                   help="rdp or pld with Poisson sampling, zcdp with shuffled batches "
                        "(default: rdp, or zcdp with --sampling shuffle)")
    g.add_argument("--sampling", choices=("poisson", "shuffle"), default=None,
                   help="poisson: every example joins each batch with probability batch/N; shuffle: disjoint "
                        "batches of a fresh shuffle every epoch (default: poisson, or shuffle with --accountant zcdp)")
    g.add_argument("--input-clip", type=float, default=_D.input_clip,
                   help="bpclip/clip-only: per-example L2 bound of every layer's input; with --adaptive the "
                        "initial one (default: %(default)g)")
    g.add_argument("--grad-clip", type=float, default=_D.grad_clip,
                   help="bpclip/clip-only: per-example bound of every layer's upstream gradient of that "
                        "example's loss; with --adaptive the initial one (default: %(default)g)")
    g.add_argument("--clip-fn", choices=("clip", "global", "normalize"), default=_D.clip_fn,
                   help="bpclip/clip-only: clip (scale down to the bound), global (drop examples over it) or "
                        "normalize (automatic clipping) (default: %(default)s)")
    g.add_argument("--conv-norm", choices=("l15", "l2"), default=_D.conv_norm,
                   help="bpclip/clip-only: the norm Conv2d layers clip upstream gradients in (default: %(default)s)")
    g.add_argument("--max-grad-norm", type=float, default=_D.max_grad_norm,
                   help="dpsgd/flat/per-layer: per-example gradient clipping bound (per-layer: of all layers "
                        "together, C/sqrt(L) each); with --adaptive the initial one (default: %(default)g)")
    g.add_argument("--adaptive", action="store_true",
                   help="bpclip/flat/per-layer: adapt the clipping thresholds to a quantile of the per-example "
                        "norms during training (Andrew et al. 2021); private, and accounted for")
    g.add_argument("--target-quantile", type=float, default=_D.target_quantile,
                   help="--adaptive: the fraction of examples each threshold should leave unclipped "
                        "(default: %(default)g)")
    g.add_argument("--clip-lr", type=float, default=_D.clip_lr,
                   help="--adaptive: the thresholds' (geometric) learning rate (default: %(default)g)")
    g.add_argument("--count-noise", type=float, default=_D.count_noise, metavar="SIGMA_B",
                   help="--adaptive: std of the noise on the unclipped-example counts, in examples "
                        "(default: the engine's)")
    g.add_argument("--noise", choices=("independent", "banded"), default=_D.noise,
                   help="independent noise each step, or banded: correlated across --bands steps (amplified "
                        "BandMF; cyclic Poisson batches; default: %(default)s)")
    g.add_argument("--bands", type=int, default=_D.bands,
                   help="bands of the correlated noise (--noise banded; default: %(default)s)")
    g.add_argument("--integer-noise", action="store_true",
                   help="release the gradients through integers (exact discrete Gaussian noise on a randomly "
                        "rounded grid; closes the floating-point attack; slower on a CPU)")
    g.add_argument("--noise-seed", type=int, default=None,
                   help="bpclip/flat/per-layer: explicit noise/sampling seed for reproducibility; INSECURE "
                        "(default: OS entropy)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=int, default=_D.batch_size,
                   help="(expected, with Poisson sampling) batch size (default: %(default)s)")
    g.add_argument("--epochs", type=int, default=_D.epochs, help="(default: %(default)s)")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default=_D.optimizer, help="(default: %(default)s)")
    g.add_argument("--lr", type=float, default=_D.lr, help="learning rate (default: %(default)g)")
    g.add_argument("--momentum", type=float, default=_D.momentum, help="sgd momentum (default: %(default)g)")
    g.add_argument("--seed", type=int, default=_D.seed,
                   help="model initialisation and shuffling; dpsgd: also Opacus' noise (default: %(default)s)")
    g.add_argument("--device", default=_D.device, help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")

    g = p.add_argument_group("output and checkpoints")
    g.add_argument("--out", default=None, metavar="DIR", help="write DIR/run.json and DIR/curves.png")
    g.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="save model, optimizer and privacy state to PATH after every epoch; it holds the secret "
                        "noise seed (with --noise-seed) or noise rows (--noise banded), so keep it as private as "
                        "the data")
    g.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint (same settings; --epochs may be larger): spent epsilon, noise "
                        "and batch counters carry on, and banded noise continues its band")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def config_from_args(args) -> Config:
    return Config(data=args.data, data_dir=args.data_dir, download=args.download, val_size=args.val_size,
                  limit=args.limit, model=args.model, activation=args.activation, tempered=args.tempered,
                  method=args.method, epsilon=args.epsilon, sigma=args.sigma, delta=args.delta,
                  accountant=args.accountant, sampling=args.sampling, clip_fn=args.clip_fn,
                  conv_norm=args.conv_norm, input_clip=args.input_clip, grad_clip=args.grad_clip,
                  max_grad_norm=args.max_grad_norm, adaptive=args.adaptive, target_quantile=args.target_quantile,
                  clip_lr=args.clip_lr, count_noise=args.count_noise, noise=args.noise, bands=args.bands,
                  integer_noise=args.integer_noise, pca=args.pca, pca_noise=args.pca_noise, pca_hidden=args.pca_hidden,
                  batch_size=args.batch_size, epochs=args.epochs,
                  optimizer=args.optimizer, lr=args.lr, momentum=args.momentum, seed=args.seed,
                  noise_seed=args.noise_seed, device=args.device, threads=args.threads, out=args.out,
                  checkpoint=args.checkpoint, resume=args.resume, progress=not args.quiet)


def main(argv=None) -> int:
    """The console script: trains, prints the summary line; exit status 0 (the result is in --out)."""
    cli_run(argv)
    return 0


def cli_run(argv=None) -> dict:
    """``bpclip-train`` with ``argv``; returns the run.json dictionary."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    try:
        cfg.resolved()
    except ValueError as exc:
        parser.error(str(exc))
    try:
        result = run(cfg)
    except data_mod.DatasetNotFound as exc:
        print(textwrap.fill(f"bpclip-train: {exc}", 100), file=sys.stderr)
        raise SystemExit(2) from None
    print(summary_line(result))
    if args.out:
        print(f"wrote {args.out}/run.json and {args.out}/curves.png")
    return result


if __name__ == "__main__":
    main()
