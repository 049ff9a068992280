"""``state_dict`` / ``load_state_dict`` of the engine and of ``DPOptimizer`` (module docstring of
:mod:`bpclip_fast.engine`, "Checkpoints"): the accountant's history, the step and batch counters and
the settings, never the noise seed unless asked for; a load checks every field before it assigns
anything, and continues with fresh seeds."""

from __future__ import annotations

import warnings

from . import correlated, distributed, seeds
from ._common import InsecureSeedWarning

STATE_FORMAT = "bpclip_fast.PrivacyEngine/2"
OPT_KEY = "bpclip_fast_privacy_engine"


def state_dict(engine, include_secrets: bool = False) -> dict:
    """The engine's state (``PrivacyEngine.state_dict``)."""
    if include_secrets and engine.bands != 1:
        # A resume that does not load the rows (noise_state_dict) restarts the band: with the same seed its
        # first row is σΔz_t/c_0 where the run that went on released (σΔz_t − Σ_j c_j w_{t−j})/c_0 on the
        # same batch, so the two differ by the past rows' secret noise.
        raise ValueError("PrivacyEngine.state_dict: include_secrets=True is not available with noise='banded': a "
                         "resume with the same seed that did not also load the noise rows would release this "
                         "seed's draws again with the band restarted (their difference is the past steps' noise). "
                         "Save without secrets, and noise_state_dict() apart (secret) to continue the band: the "
                         "resumed run draws fresh seeds")
    state = {"format": STATE_FORMAT, "accountant": engine.accountant_name,
             "accountant_state": engine.accountant.state_dict(), "steps": engine.steps, "secure": engine._secure,
             "batches_delivered": engine._counter.delivered,
             "batches_claimed": engine._counter.claimed, "noise_multiplier": engine.noise_multiplier,
             "sample_rate": engine.sample_rate, "poisson_sampling": engine.poisson_sampling,
             "loss_reduction": engine.loss_reduction, "world_size": engine.world_size,
             "integer_noise": engine.integer_noise}
    sampler = engine.data_loader.batch_sampler
    if engine.bands != 1:
        # The groups must stay the groups (b-min-separation across the resume); the partition is not
        # secret (the analysis gives the adversary every example's group). The noise rows are: they go
        # in noise_state_dict() apart; without them a resumed run starts a new band (bpclip_fast.banded:
        # the block-diagonal strategy is sound).
        state["bands"] = engine.bands
        state["partition_seed"] = sampler.partition_seed
        state["partition_size"] = sampler.num_samples  # the seed cuts other groups from another N
    if not engine.poisson_sampling:
        # Shuffled batches: the rest of the current epoch must come from the same permutation (an
        # example is in one batch per epoch). The zCDP analysis does not need it secret.
        state["shuffle_seed"] = sampler.seed
    if engine._thresholds is not None:  # where the adaptive thresholds are: a resume continues from them
        state["thresholds"] = dict(zip(engine._thresholds.names, engine._thresholds.values))
    if include_secrets:
        state["secrets"] = {"noise_seed": engine._seed, "sampler_seed": sampler.seed}
    return state


def load_state_dict(engine, state: dict) -> None:
    """``PrivacyEngine.load_state_dict``: every field read and checked, then assigned."""
    _check_settings(engine, state)
    saved = _check_thresholds(engine, state)
    loaded = _read(engine, state)
    if loaded["secrets"]:
        warnings.warn("PrivacyEngine.load_state_dict: the state holds the noise seed (include_secrets=True); "
                      "the resumed run is reproducible and insecure", InsecureSeedWarning, stacklevel=3)
    _assign(engine, state, saved, loaded)


def _check_settings(engine, state) -> None:
    """The checkpoint belongs to an engine set up as this one, which has taken no step yet."""
    if engine._taken_here:
        raise RuntimeError("PrivacyEngine.load_state_dict: this engine has already taken steps; loading a "
                           "checkpoint would rewind its accountant (the steps since would not be covered). "
                           "Resume into a fresh make_private set-up")
    if engine._counter.claimed != getattr(engine, "_claimed_at_load", 0):
        # A batch drawn here may have been used (its noised gradient in .grad): the checkpoint's accountant
        # would replace the one that must charge it, and under banded noise its rows and group are this
        # engine's. Checked before anything is assigned.
        raise RuntimeError("PrivacyEngine.load_state_dict: this engine's private loader has drawn batches since "
                           "make_private (or the last load); loading a checkpoint would drop their charge. Load the "
                           "checkpoint into a fresh make_private set-up before drawing from its loader")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"PrivacyEngine.load_state_dict: not a PrivacyEngine state (format "
                         f"{state.get('format')!r}, expected {STATE_FORMAT!r})")
    if state["accountant"] != engine.accountant_name:
        raise ValueError(f"PrivacyEngine.load_state_dict: the checkpoint was accounted with "
                         f"{state['accountant']!r}, this engine uses {engine.accountant_name!r}")
    if int(state.get("bands", 1)) != engine.bands:
        raise ValueError(f"PrivacyEngine.load_state_dict: the checkpoint was trained with bands={state.get('bands', 1)}, "
                         f"this engine has bands={engine.bands}: the loader's groups and the accountant's positions "
                         "would not continue; make_private with the checkpoint's noise and bands")
    size = state.get("partition_size")
    if engine.bands != 1 and size is not None and int(size) != engine.data_loader.batch_sampler.num_samples:
        raise ValueError(f"PrivacyEngine.load_state_dict: the checkpoint's groups partition a dataset of size {size}, "
                         f"this loader's has {engine.data_loader.batch_sampler.num_samples}: the same partition_seed "
                         "would cut other groups, and an example could change group at the resume (banded noise "
                         "needs each example in one group for the whole run); resume on the same dataset")
    if bool(state.get("integer_noise", False)) != engine.integer_noise:
        raise ValueError(f"PrivacyEngine.load_state_dict: the checkpoint was trained with integer_noise="
                         f"{bool(state.get('integer_noise', False))}, this engine has integer_noise={engine.integer_noise}: "
                         "its accountant is charged at other orders and factors; make_private with the checkpoint's "
                         "integer_noise")
    if state["poisson_sampling"] != engine.poisson_sampling:
        raise ValueError("PrivacyEngine.load_state_dict: the checkpoint used a different sampling "
                         "(poisson_sampling) than this engine")


def _check_thresholds(engine, state):
    """The checkpoint's adaptive thresholds (``None``: fixed), if this engine can take them."""
    saved = state.get("thresholds")
    if (saved is None) != (engine._thresholds is None):
        raise ValueError("PrivacyEngine.load_state_dict: the checkpoint was made with "
                         f"{'fixed' if saved is None else 'adaptive'} clipping thresholds, this engine has "
                         f"{'fixed' if engine._thresholds is None else 'adaptive'} ones (make_private(adaptive=...))")
    if saved is not None and list(saved) != engine._thresholds.names:
        raise ValueError(f"PrivacyEngine.load_state_dict: the checkpoint's adaptive thresholds {list(saved)} are not "
                         f"this model's {engine._thresholds.names}")
    if saved is not None and not engine._thresholds.within_range([float(v) for v in saved.values()]):
        raise ValueError("PrivacyEngine.load_state_dict: the checkpoint's adaptive thresholds lie outside the range "
                         "adaptation can reach from this engine's initial ones (within a factor 10⁶)")
    return saved


def _read(engine, state) -> dict:
    """The counters and seeds to continue with (fresh seeds unless the state holds secrets), and the
    accountant parsed and checked against the budget: nothing is assigned yet."""
    steps = int(state["steps"])
    delivered = int(state["batches_delivered"])
    claimed = int(state.get("batches_claimed", delivered))
    secrets_ = state.get("secrets")
    if secrets_ is not None:
        noise_seed, sampler_seed = int(secrets_["noise_seed"]), int(secrets_["sampler_seed"])
        secure = False
    else:
        noise_seed, sampler_seed = seeds.fresh(), seeds.fresh()
        secure = bool(state["secure"]) and engine._secure
    if not engine.poisson_sampling:
        sampler_seed = int(state["shuffle_seed"])
    if not (steps >= 0 and 0 <= delivered <= claimed and 0 <= noise_seed < 2 ** 63):
        raise ValueError("PrivacyEngine.load_state_dict: the checkpoint's counters or seeds are out of range")
    loaded = type(engine.accountant)(**engine._accountant_kwargs)
    loaded.load_state_dict(state["accountant_state"])  # parses
    if loaded.events != engine.accountant.events:
        # make_private charged this model's private PCA; a state without it (or with another) would drop
        # or misstate that charge when it replaces the accountant
        raise ValueError(f"PrivacyEngine.load_state_dict: the checkpoint's one-off events {loaded.events} are not "
                         f"those this engine charged at make_private {engine.accountant.events} (a private PCA "
                         "in the model): resume with the same model, projection included")
    if engine.max_epsilon is not None and len(loaded) and loaded.get_epsilon(engine.delta) > engine.max_epsilon:
        raise ValueError(f"PrivacyEngine.load_state_dict: the checkpoint has already spent "
                         f"ε={loaded.get_epsilon(engine.delta):.4g} at δ={engine.delta:g}, more than this engine's "
                         f"max_epsilon={engine.max_epsilon:g}; it cannot be continued within that budget")
    return dict(steps=steps, delivered=delivered, claimed=claimed, noise_seed=noise_seed, sampler_seed=sampler_seed,
                secure=secure, secrets=secrets_ is not None)


def _assign(engine, state, saved, loaded) -> None:
    """Continues from the checked checkpoint: accountant, counters, thresholds, seeds; re-arms."""
    from . import thresholds

    engine.accountant.load_state_dict(state["accountant_state"])
    engine._steps = loaded["steps"]
    engine._secure = loaded["secure"]
    if saved is not None:
        engine._thresholds.values = [float(v) for v in saved.values()]
        thresholds.apply(engine, engine._thresholds.values)
    noise_seed, sampler_seed = loaded["noise_seed"], loaded["sampler_seed"]
    if engine.distributed:
        noise_seed = distributed.broadcast_int(noise_seed)
        sampler_seed = distributed.broadcast_int(sampler_seed)
    seeds.set_noise_seed(engine, noise_seed)
    sampler = engine.data_loader.batch_sampler
    sampler.seed = sampler_seed
    if engine.bands != 1:
        sampler.partition_seed = int(state["partition_seed"])
    correlated.restart(engine)
    if hasattr(sampler, "_perm"):
        sampler._perm = (None, None)
    engine._counter.delivered = loaded["delivered"]
    engine._counter.claimed = loaded["claimed"]
    engine._claimed_at_load = loaded["claimed"]
    engine._delivered_at_step = engine._counter.delivered
    engine._budget_cache = None
    for st in engine._steps_of:
        st.discard()
    engine._arm()


def optimizer_state(optimizer) -> dict:
    """``DPOptimizer.state_dict``: the inner optimizer's state with the engine's inside."""
    sd = dict(optimizer.original_optimizer.state_dict())
    sd[OPT_KEY] = optimizer.engine.state_dict()
    return sd


def load_optimizer_state(optimizer, state_dict) -> None:
    """``DPOptimizer.load_state_dict``: refuses a state without the privacy state."""
    state_dict = dict(state_dict)
    privacy = state_dict.pop(OPT_KEY, None)
    if privacy is None:
        raise ValueError("DPOptimizer.load_state_dict: the state has no privacy state (it comes from a plain "
                         "optimizer); loading it would forget the budget already spent. Load a state saved from "
                         "a DPOptimizer, or load a non-private optimizer state into the optimizer before "
                         "make_private")
    optimizer.original_optimizer.load_state_dict(state_dict)
    optimizer.engine.load_state_dict(privacy)
