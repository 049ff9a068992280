"""``PrivacyEngine``: set-up by ``make_private`` (the proofs are in :mod:`bpclip_fast.engine`)."""


from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import banded, batches, broadcast, compiled, data, handles, integer_noise, modes, ranks as _ranks
from .. import pca as _pca
from .. import nn as bnn
from .. import validate as _validate
from ..boundary import LayerStep, PassGate, StepRefused  # noqa: F401  (StepRefused: re-exported)
from . import (accumulation, arguments, budget, checkpoint, correlated, distributed, guards, integer, model_checks, noise_range, refusal,
               seeds, thresholds)
from .optimizer import DPOptimizer
from ._common import NO_PICKLE, InsecureSeedWarning, accounting, positive

__all__ = ["PrivacyEngine", "DPOptimizer", "InsecureSeedWarning", "StepRefused"]

class PrivacyEngine:
    """Opacus-style entry point: ``make_private``, ``make_private_with_epsilon``, ``get_epsilon``.

    ``accountant``: ``"rdp"`` or ``"pld"`` (Poisson sampling, add/remove one example) or ``"zcdp"``
    (shuffled disjoint batches; ``adjacency="replace_one"`` or ``"add_remove"`` is passed to it).
    """

    def __init__(self, accountant: str = "rdp", *, adjacency: str | None = None):
        acc = accounting()
        kwargs = {} if adjacency is None else {"adjacency": adjacency}
        self.accountant = acc.make_accountant(accountant, **kwargs)
        self.accountant_name = accountant
        self._accountant_kwargs = kwargs
        self._made_private = False
        self.integer_noise = False

    def __getstate__(self):
        raise TypeError(NO_PICKLE.format("PrivacyEngine"))

    # ------------------------------------------------------------------ validation
    @staticmethod
    def validate(model: nn.Module, example_input=None, clipping: str = "backprop") -> list[str]:
        """Every problem that stops ``model`` from being trained privately with ``clipping`` (the mode
        to be passed to ``make_private``; its default), as a list of messages.

        The module checks of :mod:`bpclip_fast.registry` (trainable parameters outside the registered
        layer types, layers the mode has no bound for, batch-mixing layers: BatchNorm in any mode,
        InstanceNorm with running statistics; ``padding_mode`` other than zeros); with ``example_input``, the probes of
        :func:`bpclip_fast.validate.dynamic_problems` too (without it, the layers refuse reuse at
        training time). Empty list: nothing found.
        """
        if isinstance(model, distributed.ddp_class()):
            model = model.module
        return _validate.validate(model, example_input, clipping)

    # ------------------------------------------------------------------ make_private
    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                     noise_multiplier: float, input_clip: float | None = None, grad_clip: float | None = None,
                     conv_norm: str = "l15", clipping: str = "backprop", max_grad_norm=None,
                     norm_method: str = "auto", clip_fn: str = "clip", gamma: float = 0.01, loss_reduction: str = "mean",
                     poisson_sampling: bool = True, noise_seed: int | None = None,
                     max_epsilon: float | None = None, delta: float | None = None,
                     max_input_shape=None, nonfinite: str = "drop", probe: bool = True, adaptive=None,
                     criterion=None, batch_inputs: int | None = None, noise: str = "independent", bands: int = 1,
                     integer_noise: bool = False):
        """Returns ``(module, optimizer, data_loader)`` ready for private training (module docstring).

        ``clipping``: ``"backprop"`` (backpropagation clipping: ``input_clip``/``grad_clip``, per-example
        bounds of each layer's input and upstream gradient, ``grad_clip`` for the per-example loss
        whatever ``loss_reduction``; every layer adds ``N(0, σ²Δ_l²)`` and the accountant gets
        ``σ/√L``), or exact per-example clipping (:mod:`bpclip_fast.exact`) to ``max_grad_norm``:
        ``"flat"`` (DP-SGD, Opacus' default: ``C`` bounds each example's whole gradient) or
        ``"per_layer"`` (a list of ``C_l``, one per layer in ``named_modules`` order, or ``C`` split as
        ``C/√L``); every layer adds ``N(0, σ²C²)``, ``C = (Σ_l C_l²)^½`` for per_layer, and the
        accountant gets ``σ``. ``norm_method``: how exact modes compute per-example norms (``"auto"``:
        the cost rule; ``"ghost"``; ``"instantiate"``).
        ``max_epsilon`` (with ``delta``): ``step()`` refuses any step after which ε would exceed it.
        ``max_input_shape``: the largest per-example shape of the model's input tensor (no batch dim);
        a tuple of shapes for a model of several inputs (``((T,), (3, 32, 32))`` for ``model(tokens,
        image)``), a dict ``{key: shape}`` for a dict batch; every layer's Δ is fixed from a probe
        forward at that shape (zeros; integer inputs such as token indices keep their dtype). Required when some layer's Δ
        depends on its input shape (a biased Linear over ``[B, T, in]``, Conv2d with ``conv_norm="l2"``);
        otherwise Δ is fixed from the shapes of a probe forward of one example.
        ``nonfinite``: ``"drop"`` (an example with a NaN/Inf value gets clip factor 0 and the step goes on;
        ``nonfinite_counts()`` reports them) or ``"raise"`` (such a step is refused, and charged).
        ``probe``: run :func:`bpclip_fast.validate.dynamic_problems` on the loader's first batch.
        ``batch_inputs``: how many leading elements of a tuple batch are model inputs; by default all
        but the last (Opacus' ``for *inputs, y in loader: criterion(model(*inputs), y)``), so a batch
        ``(x, y1, y2)`` with ``criterion(model(x), y1, y2)`` needs ``batch_inputs=1``. A dict batch is
        ``model(**batch)``. Every probe splits the batch so (:mod:`bpclip_fast.batches`).
        ``criterion``: the loss function the loop will call as ``criterion(model(*batch[:k]), *batch[k:])``
        (Opacus' argument; optional, checked whenever given, also with ``probe=False``): refused if it
        couples the examples of a batch (InfoNCE with in-batch negatives, top-k hard-example mining, a
        class-weighted mean), or is not the sum (``loss_reduction="sum"``) or plain mean (``"mean"``)
        of its values on each example alone (:mod:`bpclip_fast.criterion`: a probe at random values,
        which cannot see a loss the loop computes otherwise). It is not wrapped or returned.
        ``adaptive``: :class:`bpclip_fast.Adaptive` (or ``True`` for its defaults): every clipping
        threshold of the mode (flat's ``C``, per_layer's ``C_l``, backprop's ``input_clip`` and
        ``grad_clip`` of every layer, starting from the values given) follows a target quantile of
        the norms it clips, from noisy counts released with each step (:mod:`bpclip_fast.adaptive`:
        the accountant keeps ``σ``, the gradient's noise is raised to pay for the counts).
        ``noise``: ``"independent"`` (a fresh draw each step) or ``"banded"`` (correlated across the
        steps, ``bands`` of them: amplified BandMF with the banded square root strategy,
        :mod:`bpclip_fast.banded`; the loader becomes cyclic Poisson over ``bands`` groups, each example
        in at most one of every ``bands`` consecutive batches, and the accountant composes
        ``ceil(T/bands)`` steps at the group's rate). Exact or backprop clipping, fixed thresholds, one
        process, float32/float64 parameters; a resumed run continues the band if it loads
        ``noise_state_dict()`` (secret) after the checkpoint, else starts a new one.
        ``integer_noise``: release each layer's gradient through integers (:mod:`bpclip_fast.integer_noise`:
        the clipped sum randomly rounded to a fine power-of-two grid plus exact discrete Gaussian noise,
        the float value a function of that integer), which closes the floating-point attack on the
        float noise (README, "Floating-point noise"); the accountant is charged ``σ/(1 + 2⁻¹²)`` at
        integer RDP orders (or zCDP). Independent noise, one process, float32/float64 parameters, the
        ``rdp`` or ``zcdp`` accountant; each draw costs ~100–250 ns a coordinate on a CPU core.

        In phases: arguments, then every problem of the model at once (nothing is changed before
        both have passed), then the model, the seeds, the loader, the optimizer and the budget.
        """
        return self._make_private(arguments.Request(**{k: v for k, v in locals().items() if k != "self"}))

    def _make_private(self, r: arguments.Request):
        """Checks everything (nothing is changed before all has passed), then composes the private
        set-up from what the ``_prepare_*`` steps return."""
        r, sigma, inner, plan, shapes = self._check_all(r)
        module, inner = self._prepare_model(r, inner, shapes, sigma, plan)
        self.nonfinite = r.nonfinite
        self.input_clip, self.grad_clip, self.conv_norm, self.clip_fn = r.input_clip, r.grad_clip, r.conv_norm, r.clip_fn
        self.clipping, self.max_grad_norm = r.clipping, r.max_grad_norm
        if r.bands != 1:  # the accountant composes the group's steps (nothing was charged yet)
            self._accountant_kwargs = {**self._accountant_kwargs, "bands": r.bands}
        if r.integer_noise:  # charged at integer RDP orders (bpclip_fast.integer_noise; nothing was charged yet)
            self._accountant_kwargs = integer.accountant_kwargs(self.accountant_name, self._accountant_kwargs)
        if r.bands != 1 or r.integer_noise:
            self.accountant = accounting().make_accountant(self.accountant_name, **self._accountant_kwargs)
        for event in _pca.events_of(inner, r.what):  # a private PCA of the inputs, released before training
            self.accountant.add_event(*event)
        correlated.prepare(self, r.bands, r.optimizer)
        sampler_seed = seeds.prepare(self, r.noise_seed)
        self.data_loader = self._prepare_loader(r.data_loader, plan, sampler_seed)
        self.module = distributed.wrapped(module, self.distributed)
        self.optimizer = DPOptimizer(r.optimizer, self)
        budget.init(self, r.max_epsilon, r.delta)
        if self.max_epsilon is None:  # nothing to cover (fixed for the engine's life): no per-layer call per forward
            for st in self._steps_of:
                st.budget = None
        self._made_private = True
        self._arm()
        return self.module, self.optimizer, self.data_loader

    def _check_all(self, r: arguments.Request):
        """Every check of ``make_private``: the arguments, the ranks' agreement, every problem of the
        model at once, the layers built by hand. Returns ``(r, σ, inner, plan, shapes)`` with ``r``'s
        ``adaptive`` and ``max_input_shape`` normalised."""
        with _ranks.failures_joined(distributed.world()[2], r.what, distributed.collective_device):  # no rank left waiting
            sigma = arguments.check(self._made_private, r.module, r.optimizer, r.data_loader,
                                    noise_multiplier=r.noise_multiplier, input_clip=r.input_clip,
                                    grad_clip=r.grad_clip, clipping=r.clipping, max_grad_norm=r.max_grad_norm,
                                    loss_reduction=r.loss_reduction, nonfinite=r.nonfinite,
                                    max_epsilon=r.max_epsilon, delta=r.delta, noise_seed=r.noise_seed)
            arguments.check_pairing(self.accountant, self.accountant_name, r.poisson_sampling)
            r = dataclasses.replace(r, adaptive=arguments.check_adaptive(r.adaptive),
                                    batch_inputs=arguments.check_batch_inputs(r.batch_inputs))
            self.rank, self.world_size, self.distributed = distributed.world()
            r = dataclasses.replace(r, bands=correlated.check(r, self.accountant_name, self.distributed))
            inner = distributed.unwrapped(r.module, self.distributed)
            plan = data.SamplingPlan.of_loader(r.data_loader, self.world_size, r.poisson_sampling, r.what,
                                               bands=r.bands)
            integer.check(r, self.accountant_name, self.distributed)
            if r.max_input_shape is not None:
                r = dataclasses.replace(r, max_input_shape=batches.normal_shapes(r.max_input_shape))
        if self.distributed:  # one global batch, one σ, one accountant: the same on every rank (bpclip_fast.ranks)
            self._check_ranks(r, sigma, inner, plan)
        shapes = model_checks.model_problems(inner, r.optimizer, r.data_loader, r.max_input_shape, r.probe, r.clipping,
                                             r.criterion, r.loss_reduction, plan.batch_size, r.batch_inputs)
        arguments.check_built_layers(inner, r.clipping, r.max_grad_norm)
        _pca.events_of(inner, r.what)  # refuses a projection computed without noise
        return r, sigma, inner, plan, shapes

    def _check_ranks(self, r: arguments.Request, sigma, inner, plan) -> None:
        """Every rank passed the same dataset and arguments (one collective, :mod:`bpclip_fast.ranks`)."""
        _ranks.check({"len(data_loader.dataset)": plan.num_samples, "data_loader.batch_size": plan.batch_size,
                      "sample rate": plan.sample_rate, "poisson_sampling": plan.poisson,
                      "noise_multiplier": sigma, "clipping": r.clipping, "input_clip": r.input_clip,
                      "grad_clip": r.grad_clip, "conv_norm": r.conv_norm, "max_grad_norm": r.max_grad_norm,
                      "norm_method": r.norm_method, "clip_fn": r.clip_fn, "gamma": r.gamma,
                      "loss_reduction": r.loss_reduction, "nonfinite": r.nonfinite, "max_input_shape": r.max_input_shape,
                      "adaptive": r.adaptive, "accountant": (self.accountant_name, self._accountant_kwargs),
                      "max_epsilon": r.max_epsilon, "delta": r.delta,
                      "clipped layers built by hand": _ranks.built_layers(inner),
                      # one release, charged once: every rank must hold the same components
                      "private PCA projections": _pca.fingerprints(inner)},
                     r.data_loader.dataset, plan.num_samples, distributed.collective_device(), r.what)

    def _prepare_model(self, r: arguments.Request, inner, shapes, sigma, plan):
        """Converts the model (same ``Parameter`` objects), fixes every layer's Δ and gives each its
        step state (``boundary.LayerStep``); returns ``(module, inner)``."""
        module = r.module
        # convert_model keeps the bounds of the mode (modes.Mode.conversion_settings) and ignores the others
        converted = bnn.convert_model(inner, clipping=r.clipping, clip_fn=r.clip_fn, gamma=r.gamma,
                                      input_clip=r.input_clip, grad_clip=r.grad_clip, norm=r.conv_norm,
                                      max_grad_norm=r.max_grad_norm, norm_method=r.norm_method)
        if converted is not inner:  # a bare nn.Linear / nn.Conv2d
            if isinstance(module, distributed.ddp_class()):
                raise ValueError("make_private: wrap a container module in DDP, not a bare layer")
            inner = module = converted
        layers = bnn.clipped_layers(inner)
        try:
            self._configure_layers(r, inner, layers, shapes, sigma, plan)
        except BaseException:
            # The layers were converted (and the mode's bounds set on them, the user's own included): a
            # retry on this model must not take those bounds for the user's (review 42 F1).
            refused = ("a make_private that was refused converted or configured this layer; build the model afresh, "
                       "or load its state_dict into a fresh one")
            for _, layer in bnn.clipped_layers(inner):
                nn.Module.__setattr__(layer, "_bp_refused_setup", refused)
            raise
        self._handle = handles.register(self)  # the name the compiled forward's check op finds it by
        inner.register_forward_pre_hook(guards.OutsideCheck(self))
        compiled.require_parameter_guards()
        broadcast.install(inner)  # each call's rows: an Embedding's shared index row is looked up per example
        self._inner = inner
        self.loss_reduction = r.loss_reduction
        self.max_input_shape = r.max_input_shape
        return module, inner

    def _configure_layers(self, r: arguments.Request, inner, layers, shapes, sigma, plan) -> None:
        """Fixes every converted layer's Δ, the mode's bounds and σ, checks the noise range and arms the
        layers with their step state."""
        if not layers:
            raise ValueError(_no_layer_message(r.clipping))
        model_checks.fix_sensitivities(layers, shapes, r.max_input_shape is not None)
        self._mode = modes.strategy(r.clipping)
        # What the mode sets over all the layers, those built by the user included: flat's one collector,
        # per_layer's noise bound (Σ_l C_l²)^½.
        self._mode.settle(inner, [layer for _, layer in layers], r.max_grad_norm, r.clip_fn, r.gamma)
        self.integer_noise = r.integer_noise  # before σ_eff is read (effective_noise_multiplier)
        if r.sigma_effective is not None:  # make_private_with_epsilon: σ_eff over the layers clipped
            sigma = r.sigma_effective * self._mode.sigma_factor(len(layers))
            if r.integer_noise:  # the charge is σ/EFFECTIVE_FACTOR (bpclip_fast.integer_noise)
                sigma *= integer_noise.EFFECTIVE_FACTOR
        self._layers = [layer for _, layer in layers]
        self._flat_group = self._mode.collector(self._layers)
        thresholds.prepare(self, r.adaptive, sigma, plan)
        span = noise_range.multipliers(r.loss_reduction == "mean", plan.num_samples, plan.batch_size, self.world_size,
                                       plan.poisson, len(self._mode.threshold_attrs), self._thresholds is not None)
        self._check_noise_range(span)
        self._prepare_steps(layers, float(plan.batch_size) if r.loss_reduction == "mean" else None)
        for st in self._steps_of:  # σ of the engine, the same on every rank (a layer's own is 0 but on rank 0)
            st.std_span = (self.gradient_noise_multiplier, span)
            st.checked_shape = st.layer.max_input_shape  # the shape whose Δ the range was checked at
        self._noise_multiplier = sigma
        correlated.check_row_std(self, r.bands, r.optimizer)
        if r.integer_noise:
            integer.prepare(self, len(self._mode.threshold_attrs), self._thresholds is not None)

    def _check_noise_range(self, span) -> None:
        """Every std a step of this run can draw within the kernels' range, whatever the batch
        (:mod:`bpclip_fast.engine.noise_range`)."""
        bad = []
        for layer in self._layers:
            try:
                delta = float(layer.sensitivity)
            except RuntimeError:  # a shape-dependent Δ never fixed: its noise is refused at the forward
                continue
            why = noise_range.problem(layer.layer_name, self.gradient_noise_multiplier, delta, span)
            if why is not None:
                bad.append(why)
        if bad:
            raise ValueError("make_private: the noise std would leave the range the kernels draw in:\n  - "
                             + "\n  - ".join(bad) + "\n(the model's layers were converted to clipped layers with these "
                             "settings and cannot be made private again: build the model afresh, or load its state_dict "
                             "into a fresh one, to make it private with others)")

    def _prepare_steps(self, layers, mean_batch) -> None:
        """Each layer's step state (``boundary.LayerStep``), wired to the engine's checks."""
        recorder = distributed.DistributedRecorder() if self.distributed else None
        self._pass_gate = PassGate()  # the backward pass guards.check_new_pass last ran in
        self._holder = accumulation.Holder()  # optimizer.accumulate()
        self._steps_of = []
        for name, layer in layers:
            layer._bp_name = name
            layer._bp_noise_multiplier = self.gradient_noise_multiplier if self.rank == 0 else 0.0
            st = LayerStep(layer, name, enforce=True, mean_loss_batch=mean_batch)
            st.counting = self._thresholds is not None
            st.on_refuse = functools.partial(refusal.refuse_in_forward, self)
            st.after_backward = recorder
            st.batch_rows = functools.partial(guards.batch_rows, self)
            st.on_new_pass = functools.partial(guards.check_new_pass, self)
            st._gate = self._pass_gate
            st.holder = self._holder
            st.budget = functools.partial(budget.require, self)
            layer._bp_step = st
            self._steps_of.append(st)

    def thresholds(self) -> dict:
        """``{name: value}`` of every clipping threshold as it is now (flat: ``"max_grad_norm"``;
        per_layer: ``"<layer>.max_grad_norm"``; backprop: ``"<layer>.input_clip"``, ``"<layer>.grad_clip"``),
        adaptive or fixed."""
        self._require_private("thresholds")
        return {name: float(getattr(layers[0], "_bp_" + attr)) for name, layers, attr in thresholds.slots(self)}

    @property
    def adaptive(self):
        """The :class:`bpclip_fast.Adaptive` options, or ``None`` for fixed thresholds."""
        return None if self._thresholds is None else self._thresholds.options

    @property
    def gradient_noise_multiplier(self) -> float:
        """The noise multiplier of each layer's gradient: ``noise_multiplier`` itself, or with adaptive
        thresholds ``σ_Δ`` (:func:`bpclip_fast.adaptive.noise_split`)."""
        return float(self._gradient_sigma)

    @property
    def count_noise(self):
        """The std ``σ_b`` of the noise on each adaptive count (``None`` for fixed thresholds)."""
        return None if self._thresholds is None else self._thresholds.sigma_b

    def _prepare_loader(self, data_loader, plan, sampler_seed) -> data.DPDataLoader:
        """The private loader: Poisson (rate ``q = W·batch_size/N``) or shuffled disjoint batches of
        ``W·batch_size`` (``data.SamplingPlan``), with the user loader's workers and collation."""
        self._counter = data.BatchCounter()
        self.plan = plan
        self.expected_batch_size = plan.batch_size
        self.sample_rate, self._accounting_rate = plan.sample_rate, plan.accounting_rate
        self.steps_per_epoch = plan.steps_per_epoch
        self.poisson_sampling = plan.poisson
        dl = data_loader
        loader = data.DPDataLoader(
            dl.dataset, plan.sampler(sampler_seed, self.rank, self._counter), collate_fn=dl.collate_fn,
            num_workers=dl.num_workers, pin_memory=dl.pin_memory, timeout=dl.timeout,
            worker_init_fn=dl.worker_init_fn, multiprocessing_context=dl.multiprocessing_context,
            persistent_workers=dl.persistent_workers, prefetch_factor=dl.prefetch_factor)
        loader.before_delivery = functools.partial(budget.before_delivery, self)
        return loader

    def make_private_with_epsilon(self, *, module, optimizer, data_loader, target_epsilon: float,
                                  target_delta: float, epochs: int, **kwargs):
        """``make_private`` with the smallest noise multiplier that keeps ε ≤ ``target_epsilon`` at
        ``target_delta`` after ``epochs`` passes (``epochs · len(private loader)`` steps).

        The accountant's ``get_noise_multiplier`` returns the *effective* σ of one step; every layer
        gets ``σ = σ_eff·√L``, with L the number of layers ``make_private`` clips, counted once they
        are converted (a count taken before the probe forward could miss a layer the model builds
        in it, and under-noise). ``kwargs`` as ``make_private``.
        """
        with _ranks.failures_joined(distributed.world()[2], "make_private_with_epsilon", distributed.collective_device):
            if "noise_multiplier" in kwargs:
                raise TypeError("make_private_with_epsilon: noise_multiplier is computed, do not pass it")
            positive(target_epsilon, "target_epsilon")
            if not 0 < float(target_delta) < 1:
                raise ValueError(f"make_private_with_epsilon: target_delta must be in (0, 1), got {target_delta}")
            if int(epochs) != epochs or epochs < 1:
                raise ValueError(f"make_private_with_epsilon: epochs must be a positive integer, got {epochs}")
            poisson = kwargs.get("poisson_sampling", True)
            arguments.check_pairing(self.accountant, self.accountant_name, poisson)
            bands = banded.check_bands(kwargs.get("bands", 1))
            plan = data.SamplingPlan.of_loader(data_loader, distributed.world()[1], poisson, "make_private_with_epsilon",
                                               bands=bands)
            extra = {"bands": bands} if bands != 1 else {}
            if kwargs.get("integer_noise") is True:  # calibrated at the orders it is charged at
                why = integer.accountant_problem(self.accountant_name)
                if why is not None:  # before a calibration make_private would refuse to use
                    raise ValueError(f"make_private_with_epsilon: integer_noise=True is not available here: {why}")
                extra = integer.accountant_kwargs(self.accountant_name, extra)
            # a private PCA in the model is charged by make_private: σ must leave room for it
            events = _pca.events_of(module, "make_private_with_epsilon")
            sigma_eff = accounting().get_noise_multiplier(
                target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=plan.accounting_rate,
                steps=int(epochs) * plan.steps_per_epoch, accountant=self.accountant_name, **self._accountant_kwargs,
                events=events, **extra)
        self.target_epsilon, self.target_delta, self.epochs = float(target_epsilon), float(target_delta), int(epochs)
        try:  # make_private's signature holds the defaults; its error for an unknown argument as a call would raise
            bound = inspect.signature(self.make_private).bind(module=module, optimizer=optimizer, data_loader=data_loader,
                                                              noise_multiplier=float(sigma_eff), **kwargs)
        except TypeError as exc:
            raise TypeError(f"PrivacyEngine.make_private() {exc}") from None
        bound.apply_defaults()
        return self._make_private(arguments.Request(**bound.arguments, sigma_effective=float(sigma_eff)))

    # ------------------------------------------------------------------ epsilon and budget
    @property
    def effective_noise_multiplier(self) -> float:
        """The noise multiplier of one step's single Gaussian on all layers: ``σ`` under exact clipping
        (sensitivity ``C``, noise ``σC`` on every coordinate), ``(Σ_l σ_l⁻²)^(-1/2) = σ/√L`` under
        backpropagation clipping; divided by ``integer_noise.EFFECTIVE_FACTOR`` under integer noise."""
        sigma = self._mode.effective_sigma(self._noise_multiplier, len(self._layers))
        return sigma / integer_noise.EFFECTIVE_FACTOR if self.integer_noise else sigma

    # σ and the step counter are read by the accountant and key the noise: an assignment would charge
    # one σ while the layers add another, or draw a step's noise twice.
    @property
    def noise_multiplier(self) -> float:
        """The σ of ``make_private`` (per layer under backprop clipping); fixed for the engine's life."""
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value):
        raise AttributeError("PrivacyEngine.noise_multiplier is fixed at make_private: the layers' noise and the "
                             "accountant both follow it; make a fresh model private for another σ")

    @property
    def steps(self) -> int:
        """Steps taken (including those before a loaded checkpoint); keys each step's noise."""
        return self._steps

    @steps.setter
    def steps(self, value):
        raise AttributeError("PrivacyEngine.steps is kept by the engine (it keys each step's noise draws); it "
                             "changes only by step() and load_state_dict")

    # The budget is what the loader's and the step's gates keep ε under: lowering it between a batch
    # drawn and its step would leave batches the budget no longer covers, charged or not.
    @property
    def max_epsilon(self):
        """The ε budget of ``make_private`` (None: no budget); fixed for the engine's life."""
        return self._max_epsilon

    @max_epsilon.setter
    def max_epsilon(self, value):
        raise AttributeError("PrivacyEngine.max_epsilon is fixed at make_private: the private loader and step() "
                             "keep every charge within it; make a fresh make_private set-up for another budget")

    @property
    def delta(self):
        """The δ at which ``max_epsilon`` is measured; fixed for the engine's life."""
        return self._delta

    @delta.setter
    def delta(self, value):
        raise AttributeError("PrivacyEngine.delta is fixed at make_private (the budget max_epsilon is measured at "
                             "it); make a fresh make_private set-up for another δ")

    @property
    def clipped_layers(self) -> list:
        """``(name, layer)`` of every clipped layer of the private module, in forward order."""
        return bnn.clipped_layers(self._inner)

    @property
    def accounting_sample_rate(self) -> float:
        """The rate the accountant is stepped with: ``q`` under Poisson sampling, ``1/steps_per_epoch``
        (one disjoint batch of the epoch) under shuffling."""
        return self._accounting_rate

    @property
    def secure_noise_seed(self) -> bool:
        """False when the noise seed was given explicitly (reproducible, not secret)."""
        return self._secure

    def get_epsilon(self, delta: float) -> float:
        """ε at ``delta`` of every step taken so far (including steps before a checkpoint was loaded) and of
        the one-off events charged at ``make_private`` (a private PCA in the model, :mod:`bpclip_fast.pca`)."""
        if len(self.accountant) == 0 and not self.accountant.events:
            return 0.0
        return float(self.accountant.get_epsilon(delta))

    # ------------------------------------------------------------------ set-up helpers
    # ------------------------------------------------------------------ non-finite values
    def nonfinite_counts(self) -> dict:
        """``{layer: (inputs, upstream gradients)}`` found non-finite (and dropped: clip factor 0)
        since the last call; resets the counts (one device sync). A data-dependent diagnostic: reading
        it is a release that the ε of this engine does not cover."""
        self._require_private("nonfinite_counts")
        counts = torch.stack([layer._bp_nonfinite for layer in self._layers])
        if self.distributed:
            counts = distributed.summed(counts)
        out = {st.name: tuple(int(v) for v in c) for st, c in zip(self._steps_of, counts.cpu())}
        for layer in self._layers:
            layer._bp_nonfinite.zero_()
        return out

    # ------------------------------------------------------------------ the step
    def _arm(self):
        """Arms every layer with the draw of step ``self.steps``."""
        self._stream.step = self.steps
        self._pass_gate.passes = 0
        for index, st in enumerate(self._steps_of):
            st.arm((self._stream.seed, self._stream.offset(index)))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, include_secrets: bool = False) -> dict:
        """The accountant, the step and batch counters and the settings (module docstring:
        Checkpoints). Never the noise seed, unless ``include_secrets=True``: an explicit, insecure
        opt-in for a bit-for-bit reproducible resume (whoever holds that state can subtract the noise
        of every step, past and future)."""
        self._require_private("state_dict")
        return checkpoint.state_dict(self, include_secrets)

    def load_state_dict(self, state: dict) -> None:
        """Restores a checkpoint into an engine that ``make_private`` has set up (same model and
        settings): the accountant and the batch counter continue; the noise (and Poisson sampling)
        seed is fresh from the OS unless the state holds secrets (``state_dict(include_secrets=True)``)."""
        self._require_private("load_state_dict")
        checkpoint.load_state_dict(self, state)

    def noise_state_dict(self) -> dict:
        """Under ``noise="banded"``: every layer's last ``bands − 1`` noise rows, so that a resume
        continues the correlation (:func:`bpclip_fast.engine.correlated.noise_state_dict`). SECRET: keep
        it apart from the checkpoint and private like the training data, and delete it when the run is
        done (with the released models it gives the un-noised gradients of the last steps). Never in
        ``state_dict``; no seed in it."""
        self._require_private("noise_state_dict")
        return correlated.noise_state_dict(self)

    def load_noise_state_dict(self, state: dict) -> None:
        """Continues the band of the run whose checkpoint was just loaded (``load_state_dict`` first,
        before any batch is drawn). Without it a resumed run starts a new band (sound, less accurate)."""
        self._require_private("load_noise_state_dict")
        correlated.load_noise_state_dict(self, state)

    def _require_private(self, what):
        if not self._made_private:
            raise RuntimeError(f"PrivacyEngine.{what}: call make_private first")


def _no_layer_message(clipping: str) -> str:
    """What make_private says of a model with nothing to clip, from the registry (one home per list)."""
    from .. import registry

    fused = [e.torch_type.__name__ for e in registry.layer_types() if clipping in e.modes]
    if modes.strategy(clipping, "make_private").exact:
        return ("make_private: the model has no trainable parameter to clip (all frozen?); under clipping="
                f"{clipping!r} every module owning one is trained: by a fused layer ({', '.join(fused)}, "
                "nn.MultiheadAttention, nn.LSTM/GRU/RNN) or by the generic exact path")
    return (f"make_private: the model has no trainable layer clipping={clipping!r} can clip (fused: "
            f"{', '.join(fused)}); clipping='flat' or 'per_layer' train any module")


