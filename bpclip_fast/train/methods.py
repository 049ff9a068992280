"""The training methods the trainer compares, behind one small interface.

Ours, through :class:`bpclip_fast.PrivacyEngine` (one class, :class:`EngineMethod`, parameterised by
the engine's ``clipping`` mode; mean loss, Poisson sampling with ``rdp``/``pld`` or shuffled batches
with ``zcdp``, as the engine does):

* ``bpclip``: backpropagation clipping (``clipping="backprop"``: every layer's input to
  ``--input-clip`` and upstream gradient to ``--grad-clip``).
* ``flat``: exact per-example clipping of each example's whole gradient to ``--max-grad-norm``
  (``clipping="flat"``: DP-SGD as Opacus does it, computed by our layers).
* ``per-layer``: exact per-example clipping of each layer's gradient (``clipping="per_layer"``:
  ``--max-grad-norm`` split as ``C/√L`` over the L layers).

With ``--adaptive`` these three adapt their thresholds to a quantile of the per-example norms
(Andrew et al. 2021; :class:`bpclip_fast.Adaptive`): the configured bounds are then the initial
ones, and ``run.json`` records them after every step.

The others:

* ``dpsgd``: DP-SGD with per-example gradient clipping through Opacus' own ``PrivacyEngine``
  (Abadi et al.; the anchor of every comparison, not reimplemented here). Opacus runs in its
  default, non-secure mode (noise and Poisson sampling from torch's global generator, which the
  trainer seeds from ``--seed``): fine for experiments, not for releasing a model.
* ``clip-only``: our clipped layers without any noise (the paper's "non-private clipping"): what
  the clipping alone costs in accuracy. No ε.
* ``nonprivate``: plain training. No ε.

Every method is built by :func:`build_method` and offers ``train_step(x, y)``, ``epsilon(delta)``,
``privacy()`` (σ, sample rate, steps, the accountant history), ``thresholds()`` (the clipping
thresholds now: ``{name: value}``, None for the methods outside the engine) and ``state_dict()`` /
``load_state_dict()`` for checkpoints.

Accounting of ``dpsgd``. The noise multiplier for ``--epsilon`` is calibrated with the same
accountant as ``bpclip`` (:func:`bpclip_fast.accounting.get_noise_multiplier`, on the sample rate
and number of steps of Opacus' loader), and every step taken is recorded in one of our
accountants (``rdp``/``pld`` with Poisson sampling, ``zcdp`` with shuffled batches: a step of
DP-SGD with noise ``σ·C`` on per-example gradients clipped to ``C`` is one Gaussian mechanism
with noise multiplier ``σ``), so its ε and that of our methods come from the same code. Opacus' own RDP ε is
reported beside it (Poisson sampling only; it must agree).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from .. import accounting
from .. import nn as bnn
from ..data import SamplingPlan

__all__ = ["METHODS", "PRIVATE_METHODS", "ENGINE_METHODS", "ADAPTIVE_METHODS", "build_method", "make_optimizer"]

#: method name -> the engine's ``clipping`` mode, for the methods run by our PrivacyEngine
ENGINE_METHODS = {"bpclip": "backprop", "flat": "flat", "per-layer": "per_layer"}
METHODS = (*ENGINE_METHODS, "dpsgd", "clip-only", "nonprivate")
#: the methods with noise and an ε (the sweep runs them at every ε budget)
PRIVATE_METHODS = (*ENGINE_METHODS, "dpsgd")
#: the methods that take --adaptive
ADAPTIVE_METHODS = tuple(ENGINE_METHODS)


def adaptive_options(cfg):
    """The engine's :class:`bpclip_fast.Adaptive` for ``cfg`` (``--target-quantile``, ``--clip-lr``,
    ``--count-noise``); its ValueError names the options."""
    from ..adaptive import Adaptive

    try:
        return Adaptive(target_quantile=cfg.target_quantile, learning_rate=cfg.clip_lr, count_noise=cfg.count_noise)
    except ValueError as exc:
        text = str(exc).removeprefix("Adaptive: ")
        for field, option in (("target_quantile", "--target-quantile"), ("learning_rate", "--clip-lr"),
                              ("count_noise", "--count-noise")):
            text = text.replace(field, option)
        raise ValueError(f"--adaptive: {text}") from None


def make_optimizer(params, cfg):
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose adam or sgd")


class _Method:
    name = ""
    private = False

    def __init__(self, cfg, model, train_ds, generator):
        self.cfg = cfg
        self.model = model
        self.train_ds = train_ds
        self.generator = generator  # seeds the shuffle of non-private loaders (reseeded every epoch)

    # -- training
    def train_step(self, x, y):
        """One optimizer step on the batch; returns (summed loss, number correct)."""
        raise NotImplementedError

    def epsilon(self, delta):
        return None

    def privacy(self) -> dict:
        return {"private": False}

    def thresholds(self):
        """The clipping thresholds now (``{name: value}``); None where the engine does not clip."""
        return None

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    def model_state_dict(self):
        return self.model.state_dict()

    def load_model_state_dict(self, state):
        self.model.load_state_dict(state)

    @property
    def eval_model(self):
        return self.model


def _stats(out, y, loss_sum):
    return float(loss_sum), int((out.argmax(1) == y).sum()) if len(y) else 0


class NonPrivate(_Method):
    name = "nonprivate"

    def __init__(self, cfg, model, train_ds, generator):
        super().__init__(cfg, model, train_ds, generator)
        self.optimizer = make_optimizer(model.parameters(), cfg)
        self.loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, generator=generator)

    def train_step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        out = self.model(x)
        loss = F.cross_entropy(out, y, reduction="sum")
        (loss / len(y)).backward()
        self.optimizer.step()
        return _stats(out, y, loss.item())


class ClipOnly(NonPrivate):
    """Our clipped layers (``input_clip``, ``grad_clip`` per example's loss) and no noise."""

    name = "clip-only"

    def __init__(self, cfg, model, train_ds, generator):
        model = bnn.convert_model(model, input_clip=cfg.input_clip, grad_clip=cfg.grad_clip,
                                  norm=cfg.conv_norm, clip_fn=cfg.clip_fn)
        super().__init__(cfg, model, train_ds, generator)

    def train_step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        out = self.model(x)
        # A sum loss: each example's upstream gradient is then that of its own loss, which is what
        # grad_clip bounds (as under the engine); the mean is taken on the clipped gradients.
        loss = F.cross_entropy(out, y, reduction="sum")
        loss.backward()
        bnn.check_finite(self.model)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(len(y))
        self.optimizer.step()
        return _stats(out, y, loss.item())


class EngineMethod(_Method):
    """Our :class:`bpclip_fast.PrivacyEngine` in one ``clipping`` mode (``ENGINE_METHODS``): backprop
    takes ``input_clip``/``grad_clip``, flat and per_layer ``max_grad_norm`` (per_layer: split as
    ``C/√L``); ``cfg.adaptive`` adapts them (the configured values are the initial ones)."""

    private = True

    def __init__(self, cfg, model, train_ds, generator, sigma=None):
        super().__init__(cfg, model, train_ds, generator)
        from ..engine import PrivacyEngine

        self.name = cfg.method
        self.clipping = ENGINE_METHODS[cfg.method]
        self.engine = PrivacyEngine(accountant=cfg.accountant)
        optimizer = make_optimizer(model.parameters(), cfg)
        loader = DataLoader(train_ds, batch_size=cfg.batch_size)
        kwargs = dict(module=model, optimizer=optimizer, data_loader=loader, clipping=self.clipping,
                      clip_fn=cfg.clip_fn, poisson_sampling=cfg.sampling == "poisson", noise_seed=cfg.noise_seed,
                      noise=cfg.noise, bands=cfg.bands, integer_noise=cfg.integer_noise)
        if self.clipping == "backprop":
            kwargs.update(input_clip=cfg.input_clip, grad_clip=cfg.grad_clip, conv_norm=cfg.conv_norm)
        else:
            kwargs.update(max_grad_norm=cfg.max_grad_norm)
        if cfg.adaptive:
            kwargs["adaptive"] = adaptive_options(cfg)
        sigma = cfg.sigma if sigma is None else sigma
        if sigma is None:
            out = self.engine.make_private_with_epsilon(target_epsilon=cfg.epsilon, target_delta=cfg.delta,
                                                        epochs=cfg.epochs, **kwargs)
        else:
            out = self.engine.make_private(noise_multiplier=sigma, **kwargs)
        self.model, self.optimizer, self.loader = out

    def train_step(self, x, y):
        self.optimizer.zero_grad()
        if len(y):
            out = self.model(x)
            loss = F.cross_entropy(out, y)  # mean: the engine's loss_reduction="mean"
            loss.backward()
            stats = _stats(out, y, loss.item() * len(y))
        else:  # an empty Poisson batch: still a (noise-only) step, added by the engine in step()
            stats = (0.0, 0)
        self.optimizer.step()
        return stats

    def epsilon(self, delta):
        return self.engine.get_epsilon(delta)

    def privacy(self) -> dict:
        e = self.engine
        cfg = self.cfg
        return {"private": True, "clipping": self.clipping, "noise_multiplier": e.noise_multiplier,
                "effective_noise_multiplier": e.effective_noise_multiplier,
                # the σ the gradient's noise is drawn with: above the accountant's under adaptive
                # clipping (the noisy quantile counts take their share of the budget)
                "gradient_noise_multiplier": e.gradient_noise_multiplier, "count_noise": e.count_noise,
                "adaptive": None if e.adaptive is None else dataclasses.asdict(e.adaptive),
                "noise": cfg.noise, "bands": e.bands, "integer_noise": e.integer_noise,
                "n_layers": len(e.clipped_layers),
                "sample_rate": e.sample_rate, "accounting_sample_rate": e.accounting_sample_rate,
                "steps": e.steps, "steps_per_epoch": e.steps_per_epoch, "sampling": cfg.sampling,
                "accountant": e.accountant_name, "accountant_state": e.accountant.state_dict(),
                "secure_noise_seed": e.secure_noise_seed,
                "sensitivities": {name: layer.sensitivity for name, layer in e.clipped_layers}}

    def thresholds(self) -> dict:
        return self.engine.thresholds()

    # The engine's state travels inside the optimizer's state_dict, without the noise seed (a resume
    # draws a fresh one). A run given an explicit, insecure --noise-seed asked for reproducibility:
    # its checkpoint also holds the seeds, so that a resume is bit for bit the uninterrupted run (not
    # under banded noise: the engine refuses, checkpoint.state_dict). Under banded noise the checkpoint
    # holds the secret noise rows, so that a resume continues the band (the file is private: --checkpoint).
    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.cfg.noise_seed is not None and self.engine.bands == 1:
            state["insecure_engine_secrets"] = self.engine.state_dict(include_secrets=True)
        if self.engine.bands != 1:
            state["secret_noise_rows"] = self.engine.noise_state_dict()
        return state

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state)
        if "insecure_engine_secrets" in state:
            self.engine.load_state_dict(state["insecure_engine_secrets"])
        if "secret_noise_rows" in state:
            self.engine.load_noise_state_dict(state["secret_noise_rows"])


class DPSGD(_Method):
    """DP-SGD with per-example clipping: Opacus' ``PrivacyEngine`` (flat clipping, mean loss)."""

    name = "dpsgd"
    private = True

    def __init__(self, cfg, model, train_ds, generator, sigma=None):
        super().__init__(cfg, model, train_ds, generator)
        try:
            from opacus import PrivacyEngine as OpacusEngine
        except ImportError as exc:  # pragma: no cover - opacus is in the dev requirements
            raise ImportError("--method dpsgd needs Opacus: pip install opacus") from exc
        poisson = cfg.sampling == "poisson"
        n, B = len(train_ds), cfg.batch_size
        if poisson:
            # Opacus' own Poisson loader: sample rate 1/len(loader) = 1/ceil(N/B), len(loader) steps per epoch
            spe = math.ceil(n / B)
            rate = 1.0 / spe
        else:  # the shuffled batches of our plan (Opacus' loader below draws the same number per epoch)
            if B > n:
                raise ValueError(f"batch size {B} exceeds the training set ({n})")
            plan = SamplingPlan(n, B, 1, poisson=False)
            spe, rate = plan.steps_per_epoch, plan.accounting_rate
        self.rate, self.steps_per_epoch = rate, spe
        self.accountant = accounting.make_accountant(cfg.accountant)
        sigma = cfg.sigma if sigma is None else sigma
        if sigma is None:
            sigma = accounting.get_noise_multiplier(target_epsilon=cfg.epsilon, target_delta=cfg.delta,
                                                    sample_rate=rate, steps=cfg.epochs * spe,
                                                    accountant=cfg.accountant)
        self.sigma = float(sigma)
        optimizer = make_optimizer(model.parameters(), cfg)
        # shuffle: disjoint fixed-size batches of a fresh permutation each epoch (what zCDP analyses)
        loader = DataLoader(train_ds, batch_size=B, shuffle=not poisson, drop_last=not poisson,
                            generator=None if poisson else generator)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Ss]ecure.*")
            self.opacus = OpacusEngine(accountant="rdp", secure_mode=False)
            self.model, self.optimizer, self.loader = self.opacus.make_private(
                module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=self.sigma,
                max_grad_norm=cfg.max_grad_norm, poisson_sampling=poisson, loss_reduction="mean")
        self.steps = 0
        # Opacus' hooks on the first layer (whose input needs no gradient) make torch warn every step
        warnings.filterwarnings("ignore", message="Full backward hook is firing")

    def train_step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        out = self.model(x)
        loss_sum = F.cross_entropy(out, y, reduction="sum")
        # the mean (Opacus' loss_reduction="mean"); an empty Poisson batch gives 0, not NaN, and still
        # goes through backward so that Opacus adds the step's noise
        (loss_sum / max(len(y), 1)).backward()
        self.optimizer.step()
        if not self.optimizer._is_last_step_skipped:
            self.accountant.step(noise_multiplier=self.sigma, sample_rate=self.rate)
            self.steps += 1
        return _stats(out, y, loss_sum.item())

    def epsilon(self, delta):
        return float(self.accountant.get_epsilon(delta)) if len(self.accountant) else 0.0

    def opacus_epsilon(self, delta):
        if self.cfg.sampling != "poisson" or not len(self.opacus.accountant):
            return None
        return float(self.opacus.get_epsilon(delta))

    def privacy(self) -> dict:
        return {"private": True, "noise_multiplier": self.sigma, "effective_noise_multiplier": self.sigma,
                "gradient_noise_multiplier": self.sigma, "count_noise": None, "max_grad_norm": self.cfg.max_grad_norm, "sample_rate": self.rate,
                "accounting_sample_rate": self.rate, "steps": self.steps,
                "steps_per_epoch": self.steps_per_epoch, "sampling": self.cfg.sampling,
                "accountant": self.cfg.accountant, "accountant_state": self.accountant.state_dict()}

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "accountant": self.accountant.state_dict(),
                "opacus_accountant": self.opacus.accountant.state_dict(), "steps": self.steps}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        self.accountant.load_state_dict(state["accountant"])
        self.opacus.accountant.load_state_dict(state["opacus_accountant"])
        self.steps = int(state["steps"])

    def model_state_dict(self):
        return self.model._module.state_dict()

    def load_model_state_dict(self, state):
        self.model._module.load_state_dict(state)


_CLASSES = {**dict.fromkeys(ENGINE_METHODS, EngineMethod), "dpsgd": DPSGD, "clip-only": ClipOnly,
            "nonprivate": NonPrivate}


def build_method(cfg, model, train_ds, generator, sigma=None):
    """The method ``cfg.method`` set up on ``model`` and ``train_ds``.

    ``sigma``: a noise multiplier that overrides calibration (used when resuming a run whose σ was
    calibrated for its whole length at the start).
    """
    if cfg.method not in _CLASSES:
        raise ValueError(f"unknown method {cfg.method!r}; choose one of {', '.join(METHODS)}")
    cls = _CLASSES[cfg.method]
    if cls.private:
        return cls(cfg, model, train_ds, generator, sigma=sigma)
    return cls(cfg, model, train_ds, generator)


def epsilon_report(history_state: dict, sampling: str, delta: float) -> dict:
    """ε at ``delta`` of one run's step history under every accountant and conversion that applies.

    Poisson sampling (add/remove adjacency): RDP with the improved and the basic conversion, and
    PLD. Shuffled disjoint batches: zCDP (replace-one, the paper's relation) with the exact Gaussian,
    Canonne-Kamath-Steinke and Bun-Steinke conversions, zCDP under add/remove (zero-out) adjacency,
    and the figure the paper's code would have printed (labelled: not a sound bound for replace-one).
    """
    history = [tuple(h) for h in history_state["history"]]
    events = [tuple(e) for e in history_state.get("events", [])]  # a private PCA: charged in every figure
    if not history and not events:
        return {}
    out = {}
    if sampling == "poisson":
        config = dict(history_state.get("config") or {})  # bands: the steps' cyclic positions
        rdp = accounting.RDPAccountant(**config)
        rdp.load_state_dict({"mechanism": "rdp", "history": history, "events": events, "config": config})
        out["rdp"] = rdp.get_epsilon(delta, "improved")
        out["rdp_basic_conversion"] = rdp.get_epsilon(delta, "basic")
        pld = accounting.PLDAccountant(**config)
        pld.load_state_dict({"mechanism": "pld", "history": history, "events": events, "config": config})
        out["pld"] = pld.get_epsilon(delta)
    else:
        z = accounting.ZCDPAccountant(adjacency="replace_one")
        z.load_state_dict({"mechanism": "zcdp", "history": history, "events": events})
        for conv, e in z.epsilons(delta).items():
            out[f"zcdp_{conv}"] = e
        za = accounting.ZCDPAccountant(adjacency="add_remove")
        za.load_state_dict({"mechanism": "zcdp", "history": history, "events": events})
        out["zcdp_add_remove_gaussian"] = za.get_epsilon(delta, "gaussian")
        out["zcdp_rho"] = z.rho
        out["paper_convention_UNSOUND_for_replace_one"] = z.paper_epsilon(delta)
    return {k: float(v) for k, v in out.items()}
