"""What can be trained privately: the one registry of clipped layer types and of module checks.

Everything that decides which modules may hold trainable parameters, and what else a model may
contain, asks this module: :func:`bpclip_fast.nn.convert_model`, :func:`bpclip_fast.validate.
static_problems` and its probes, and :class:`bpclip_fast.PrivacyEngine`. Two kinds of entry, as
Opacus' ``register_grad_sampler`` / ``register_module_validator``:

*Layer types* (:func:`register_layer`): a torch module type whose trainable parameters a clipped
layer of ours can train, with that clipped type, the conversion, and the plain function of the
layer (what the gradient-ownership probe recomputes a layer's gradient from). Only the exact types
count, torch's and ours: a subclass may override ``forward`` or the sensitivity with code the bound
does not cover, so a trainable subclass is refused like any other module. A registered layer is
clipped through its ``weight`` and ``bias``; any other trainable parameter on it (a
reparametrisation's) is refused.

*Module checks* (:func:`register_module_check`): a function ``check(module) -> reason | None`` for
modules of some types, whose reason says why the module breaks the guarantee and what to do.
Modules no check reports are then held to the general rule: trainable parameters only in a layer
type of the registry. Checks flagged ``mixes_batch`` name modules that let one example move another
(batch statistics); the probes run those in eval mode so that the problem is reported once.

Which layers are clipped (:func:`clipped_by_conversion`): every clipped layer, and every module of a
registered torch type owning a trainable parameter; ``convert_model`` converts exactly the latter.
(``make_private_with_epsilon`` splits its noise multiplier over the layers the engine holds after
the conversion, not over a count taken before it.)
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Callable

from torch import nn

from .modes import EXACT as _EXACT_MODES, NAMES as _MODES

__all__ = ["LayerType", "register_layer", "register_module_check", "layer_type", "layer_types", "is_clipped",
           "owns_trainable",
           "clipped_by_conversion", "trained_layer", "unbounded", "mode_problems", "mixes_batch", "module_problems", "label"]


@dataclass(frozen=True)
class LayerType:
    """A torch layer type that a clipped layer of ours trains.

    ``convert(layer, **clipping)``: the clipped layer holding ``layer``'s ``Parameter`` objects.
    ``plain(layer, x, params, *args, **kwargs)``: the layer's output for input ``x`` with parameters
    ``params`` (a dict by parameter name), as the torch type computes it (no clipping); ``args`` and
    ``kwargs`` are the call's other arguments, if any (an EmbeddingBag's per_sample_weights).
    ``taps(layer)``: how many products of one input entry with one upstream gradient entry one
    parameter entry sums per output position (a convolution's kernel positions; 1 for Linear),
    which scales the probes' rounding tolerance.
    ``modes``: the clipping modes with a proved bound for the type (``convert_model`` refuses others).
    ``multiplier_norm(layer, x, *args, **kwargs)``: the norm of what the weight gradient multiplies the upstream
    gradient by, for the probes' tolerance (``None``: the input ``x`` itself, as Linear).
    ``not_fused(layer)``: why an instance of the type is left to the generic exact path instead (``None``:
    the clipped type trains it); such an instance is treated as of no registered type at all.
    """

    torch_type: type
    clipped_type: type
    convert: Callable
    plain: Callable
    taps: Callable
    modes: tuple = _MODES
    multiplier_norm: Callable | None = None
    not_fused: Callable | None = None


@dataclass(frozen=True)
class _Check:
    types: tuple
    check: Callable
    mixes_batch: bool


_LAYERS: dict[type, LayerType] = {}
_CHECKS: list[_Check] = []
# Layer types of optional libraries: {the library's module: ours that registers them}, imported by
# load_optional once the library's module is (a model holding such a layer has imported it), so
# bpclip_fast neither needs nor imports the library.
_OPTIONAL = {"transformers.pytorch_utils": "bpclip_fast.layers.hf_conv1d"}
_OPTIONAL_LOADED: list[str] = []  # the libraries' modules whose types are registered now


def load_optional() -> None:
    """Registers the layer types of the optional libraries imported so far (:data:`_OPTIONAL`)."""
    if _OPTIONAL and any(name in sys.modules for name in _OPTIONAL):
        for name in [n for n in _OPTIONAL if n in sys.modules]:
            importlib.import_module(_OPTIONAL.pop(name))
            _OPTIONAL_LOADED.append(name)


def register_layer(torch_type: type, clipped_type: type, *, convert: Callable, plain: Callable,
                   taps: Callable = lambda layer: 1, modes: tuple = _MODES,
                   multiplier_norm: Callable | None = None, not_fused: Callable | None = None) -> LayerType:
    """Registers ``clipped_type`` as the clipped form of ``torch_type`` (module docstring)."""
    entry = LayerType(torch_type, clipped_type, convert, plain, taps, tuple(modes), multiplier_norm, not_fused)
    _LAYERS[torch_type] = entry
    return entry


def register_module_check(*types: type, mixes_batch: bool = False):
    """Decorator: ``check(module) -> str | None`` runs on every module that is an instance of ``types``."""
    def decorator(check):
        _CHECKS.append(_Check(tuple(types), check, mixes_batch))
        return check
    return decorator


@dataclass(frozen=True)
class Composite:
    """A torch module type whose parameters registered layers train once ``unpack(module)`` (in
    place, same ``Parameter`` objects) has made them children of those types (``nn.MultiheadAttention``:
    two Linears, :mod:`bpclip_fast.layers.attention`). ``not_fused(module)``: why an instance stays a
    generic unit instead (``None``: it is unpacked). ``pack`` undoes ``unpack``. Exact modes only."""

    torch_type: type
    not_fused: Callable
    unpack: Callable
    pack: Callable
    modes: tuple = _EXACT_MODES


_COMPOSITES: dict[type, Composite] = {}


def register_composite(torch_type: type, *, not_fused: Callable, unpack: Callable, pack: Callable,
                       modes: tuple = _EXACT_MODES) -> Composite:
    entry = Composite(torch_type, not_fused, unpack, pack, tuple(modes))
    _COMPOSITES[torch_type] = entry
    return entry


def composite(module: nn.Module) -> Composite | None:
    """The composite entry of ``module`` if it is one to unpack: its exact registered type, accepted by
    ``not_fused``, with a trainable parameter (below it too)."""
    entry = _COMPOSITES.get(type(module))
    if entry is None or entry.not_fused(module) is not None:
        return None
    return entry if any(p.requires_grad for p in module.parameters()) else None


def composites(model: nn.Module, shared: bool = True) -> list[tuple[str, nn.Module, Composite]]:
    """``[(name, module, entry)]`` of the composites of ``model`` to unpack: not inside a generic unit
    (with ``shared`` as :func:`generic_units`: a unit trains everything below it)."""
    units = generic_units(model, shared)
    inside = {id(sub) for _, u in units for sub in u.modules()}
    return [(name, m, e) for name, m in model.named_modules() if id(m) not in inside and (e := composite(m)) is not None]


# ------------------------------------------------------------------------------ queries


def layer_types() -> tuple[LayerType, ...]:
    """Every registered layer type, in registration order (tests/test_registry_harness.py runs the
    same tests on each, so a type registered later is tested without being named there)."""
    load_optional()
    return tuple(_LAYERS.values())


def layer_type(module: nn.Module) -> LayerType | None:
    """The registry entry of ``module``'s exact type, a torch type or its clipped type. Never a
    subclass's: a subclass may override ``forward`` or the sensitivity with code the bound does not
    cover (and the probes run a clipped layer as its torch type, so they would not see it)."""
    load_optional()
    kind = type(module)
    entry = _LAYERS.get(kind)
    if entry is not None:
        return entry if entry.not_fused is None or entry.not_fused(module) is None else None
    return next((e for e in _LAYERS.values() if e.clipped_type is kind), None)


def is_clipped(module: nn.Module) -> bool:
    """Whether ``module`` is one of our clipped layers, of a registered clipped type exactly, or a
    generic unit (:mod:`bpclip_fast.generic`)."""
    load_optional()
    return is_generic(module) or any(type(module) is e.clipped_type for e in _LAYERS.values())


def is_generic(module: nn.Module) -> bool:
    """Whether ``module`` is a generic unit already (:mod:`bpclip_fast.generic`)."""
    return getattr(type(module), "_bp_generic", False)


def generic_candidate(module: nn.Module) -> bool:
    """A module the generic exact path would train (in ``flat``/``per_layer``): it owns a trainable
    parameter and no registered clipped layer covers it: not a registered torch type (whose extra
    parameters stay refused, module_problems), nor one of our clipped layers or a subclass of one
    (which clips in its own backward), nor a unit already."""
    load_optional()
    return (owns_trainable(module) and not _registered(module) and not is_generic(module)
            and composite(module) is None
            and not any(isinstance(module, e.clipped_type) for e in _LAYERS.values()))


def generic_units(model: nn.Module, shared: bool = True) -> list[tuple[str, nn.Module]]:
    """``[(name, module)]`` of the generic units ``convert_model`` makes in exact modes: the top-most
    generic candidates, with ``shared`` the closest common ancestor of the modules sharing a trainable
    parameter (tied input and output embeddings: one parameter, one per-example gradient summed over
    its uses; backpropagation clipping has no such unit, and the probes report the sharing there) or
    holding one module under names on both sides of a unit's boundary (:func:`_aliases`), each such
    ancestor raised to the closest one with a forward of its own (:func:`_with_forward`), and units
    already made; everything below one belongs to it."""
    roots = {_with_forward(model, r) for r in _sharing_ancestors(model)} if shared else set()
    units = _units(model, roots)
    if shared:  # a module held under names on both sides of a unit's boundary: their ancestor is one unit
        while True:
            unit_of = {id(m): u for u, m in units}
            more = {_with_forward(model, _common_ancestor(names)) for names in _aliases(model)
                    if len({_home(model, n, unit_of) for n in names}) > 1}
            if more <= roots:
                return units
            roots |= more
            units = _units(model, roots)
    return units


def _units(model: nn.Module, roots: set) -> list[tuple[str, nn.Module]]:
    units: list[tuple[str, nn.Module]] = []
    whole = []  # composites: what is below one is unpacked into registered layers, never a unit
    for name, m in model.named_modules():
        if any(name.startswith(u + ".") or u == "" for u in [u for u, _ in units] + whole):
            continue
        if is_generic(m) or name in roots or (generic_candidate(m) and not module_reasons(m)):
            units.append((name, m))
        elif composite(m) is not None:
            whole.append(name)
    return units


def _aliases(model: nn.Module) -> list[set]:
    """The names of each module held under more than one name (``self.b = self.a``, one child of
    two parents). Such a module is one layer wherever its names are; but where one name is inside a
    generic unit and another outside it (or inside another unit), the unit would train a module that
    is also used, converted or owned outside it (review 32): :func:`generic_units` then makes their
    closest common ancestor the unit, as for a parameter two modules share."""
    held: dict[int, set] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if any(p.requires_grad for p in m.parameters()):
            held.setdefault(id(m), set()).add(name)
    return [names for names in held.values() if len(names) > 1]


def _home(model: nn.Module, name: str, unit_of: dict) -> str | None:
    """The unit that trains the module held at ``name``: the outermost module on its path (the model,
    then each name's module) that is a unit, by identity (a path may pass through another name of a
    unit: ``c2.inner`` with ``c2 = c``); None for none."""
    m = model
    if id(m) in unit_of:
        return unit_of[id(m)]
    for part in name.split(".") if name else []:
        m = m._modules[part]
        if id(m) in unit_of:
            return unit_of[id(m)]
    return None


def _with_forward(model: nn.Module, name: str) -> str:
    """``name`` or its closest ancestor whose module has a forward of its own: a container
    (``nn.ModuleList``, ``nn.ModuleDict``) is never called, so as a unit its node would never run and
    its parameters would get plain gradients (review 33: every step refused and charged)."""
    while name and type(model.get_submodule(name)).forward is nn.Module.forward:
        name = name.rpartition(".")[0]
    return name


def _common_ancestor(names) -> str:
    parts = [n.split(".") if n else [] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def _sharing_ancestors(model: nn.Module) -> set:
    """Names of the closest common ancestors of the modules that register one trainable parameter
    under several names (a fused layer clips its own use only, so their sum is one unit's). Distinct
    modules only: one module held under two names (``self.b = self.a``) registers its parameters
    under both, and is one layer (review 31: the whole model was made a unit, refused every step)."""
    owners: dict[int, dict] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None and p.requires_grad:
                owners.setdefault(id(p), {}).setdefault(id(m), set()).add(name)
    return {_common_ancestor(set().union(*by_module.values())) for by_module in owners.values() if len(by_module) > 1}


def inside_units(model: nn.Module, shared: bool = True) -> set:
    """ids of the modules strictly below a generic unit (trained by it, never converted)."""
    return {id(sub) for _, u in generic_units(model, shared) for sub in u.modules() if sub is not u}


def owns_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def convertible(module: nn.Module) -> bool:
    """A module ``convert_model`` swaps for a clipped layer: a registered torch type (exact) owning a
    trainable parameter."""
    load_optional()
    return _registered(module) and owns_trainable(module)


def _registered(module: nn.Module) -> bool:
    """Of a registered torch type exactly, and not left to the generic path by its ``not_fused``."""
    entry = _LAYERS.get(type(module))
    return entry is not None and (entry.not_fused is None or entry.not_fused(module) is None)


def clipped_by_conversion(module: nn.Module) -> bool:
    """Whether ``module`` is one of the model's clipped layers once converted (module docstring)."""
    return is_clipped(module) or convertible(module)


def trained_layer(module: nn.Module) -> bool:
    """A clipped layer (now or once converted) with a trainable parameter: what the probes follow."""
    return clipped_by_conversion(module) and owns_trainable(module)


def unbounded(model: nn.Module, clipping: str) -> list[str]:
    """Labels of the modules ``convert_model`` would convert whose type has no proved bound under
    ``clipping`` (``LayerType.modes``; the generic units have one in the exact modes only): what that
    mode must refuse."""
    exact = clipping in _EXACT_MODES
    generic = [] if exact else [label(name, m, model) for name, m in generic_units(model, shared=False)]
    inside = inside_units(model, shared=exact)
    whole = [label(name, m, model) for name, m, e in composites(model, shared=exact) if clipping not in e.modes]
    covered = {id(sub) for _, c, _ in composites(model, shared=exact) for sub in c.modules()}
    return generic + whole + [label(name, m, model) for name, m in model.named_modules()
                              if convertible(m) and id(m) not in inside | covered
                              and clipping not in layer_type(m).modes]


def mode_problems(model: nn.Module, clipping: str) -> list[str]:
    """``"<label>: <reason>"`` for every module of :func:`unbounded`, and in the exact modes every
    generic unit that cannot be one (:func:`bpclip_fast.generic.unit_problems`); ``convert_model``
    and ``validate`` report these before anything is converted."""
    problems = [f"{where}: clipping={clipping!r} has no proved bound for its parameters; use clipping='flat' or "
                "'per_layer' (exact per-example clipping), or freeze it (requires_grad_(False))"
                for where in unbounded(model, clipping)]
    if clipping in _EXACT_MODES:
        from .generic import unit_problems  # here: bpclip_fast.generic is imported after the registry

        problems += [p for name, m in generic_units(model) if not is_generic(m)
                     for p in unit_problems(label(name, m, model), m)]
    return problems


def mixes_batch(module: nn.Module) -> bool:
    return any(c.mixes_batch and isinstance(module, c.types) and c.check(module) is not None for c in _CHECKS)


def label(name: str, module: nn.Module, root: nn.Module) -> str:
    """How every problem message names a module: qualified name (the root's type for the root) and type."""
    return f"{name or type(root).__name__} ({type(module).__name__})"


def module_problems(model: nn.Module) -> list[str]:
    """``"<label>: <reason>"`` for every module of ``model`` that a check reports, or that holds
    trainable parameters outside the registered layer types (a registered layer clips its ``weight``
    and ``bias`` only)."""
    problems = []
    units = generic_units(model, shared=False)
    inside = {id(sub) for _, u in units for sub in u.modules()}
    unpacked = {id(sub) for _, c, _ in composites(model, shared=False) for sub in c.modules()}
    for name, m in model.named_modules():
        reasons = module_reasons(m)
        own = [pname for pname, p in m.named_parameters(recurse=False) if p.requires_grad]
        if layer_type(m) is not None:
            own = [pname for pname in own if pname not in ("weight", "bias")]
        if not reasons and own and id(m) not in inside and id(m) not in unpacked:
            reasons.append(_untrained_reason(name, m, own))
        if id(m) in inside and m not in [u for _, u in units] and is_clipped(m):
            reasons.append("a clipped layer inside a module trained by the generic exact path (which computes the "
                           "gradients of every parameter below it); convert the model before making this layer, "
                           "or keep it outside modules that own parameters")
        problems += [f"{label(name, m, model)}: {why}" for why in reasons]
    return problems


def module_reasons(m: nn.Module) -> list[str]:
    """What the registered checks say of ``m`` (empty: nothing)."""
    return [why for c in _CHECKS if isinstance(m, c.types) and (why := c.check(m)) is not None]


def _type_name(kind: type) -> str:
    return f"nn.{kind.__name__}" if kind.__module__.startswith("torch.nn") else f"{kind.__module__}.{kind.__name__}"


def _untrained_reason(name: str, module: nn.Module, own: list[str]) -> str:
    names = ", ".join(f"{name + '.' if name else ''}{pname}" for pname in own)
    suggestion = "freeze them (requires_grad_(False))"
    base = next((t for t in _LAYERS if isinstance(module, t)), None)
    if layer_type(module) is not None:
        suggestion += (f"; a {type(module).__name__} is clipped through its weight and bias only (a "
                       "reparametrisation such as torch.nn.utils.weight_norm adds parameters the bound does not "
                       "cover): remove it")
    elif base is not None:
        suggestion += (f" or use a plain {_type_name(base)} (subclasses such as {type(module).__name__} are not "
                       "converted)")
    else:
        kinds = ", ".join(_type_name(t) for t in _LAYERS)
        suggestion += f" or replace the layer by {kinds} (which are converted to clipped layers)"
    return (f"trainable parameters outside bpclip_fast's clipped layers ({names}) would be trained without "
            f"clipping or noise; {suggestion}")


# ------------------------------------------------------------------------------ the built-in checks


def _mode(module: nn.Module) -> str:
    return "in training mode" if module.training else "(in eval mode now, but model.train() switches it back)"


# Refused in eval mode too: ``model.train()`` (which most training loops call every epoch) would
# switch them back to batch statistics after this check.
@register_module_check(nn.modules.batchnorm._BatchNorm, mixes_batch=True)  # 1d/2d/3d, SyncBatchNorm, lazy
def _batch_norm(module):
    return (f"BatchNorm {_mode(module)} normalises each example with statistics of the whole batch, so one example "
            "moves every other example's gradient (and its running statistics are released without noise); "
            "bpclip_fast.fix_model(model) replaces every BatchNorm by GroupNorm (statistics within each example), "
            "or fold it into the preceding layer")


@register_module_check(nn.modules.instancenorm._InstanceNorm, mixes_batch=True)
def _instance_norm_running_stats(module):
    if not module.track_running_stats:
        return None
    return (f"InstanceNorm with track_running_stats=True {_mode(module)} averages running statistics over the "
            "batch, released without noise; use track_running_stats=False")
