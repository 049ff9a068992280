"""What :meth:`bpclip_fast.PrivacyEngine.validate` checks, and the probe forward it can run.

Every check names the module (its qualified name and type) and says what to do. The checks are
static, except "a layer reached twice per forward", which needs an input: ``validate(model,
example_input)`` runs one forward pass under ``torch.no_grad()`` (buffers and the random number
generators restored afterwards) and counts the calls of every module that owns trainable
parameters. Without an input that check is left to training time, where our layers refuse a
second grad-enabled forward while the step's noise is armed (``bpclip_fast.nn``): the engine arms
every step, so a shared layer is refused before its gradient can be released either way.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import nn as bnn

_CONVERTIBLE = (nn.Linear, nn.Conv2d)


def _label(name: str, module: nn.Module, root: nn.Module) -> str:
    return f"{name or type(root).__name__} ({type(module).__name__})"


def _batch_mixing_reason(module: nn.Module) -> str | None:
    """Why ``module`` lets one example influence another's gradient (or leaks through buffers), if it does.

    BatchNorm and InstanceNorm with running statistics are refused in eval mode too: ``model.train()``
    (which most training loops call every epoch) would switch them back to batch statistics after
    this check, and ``convert_model`` refuses BatchNorm in any mode for the same reason.
    """
    mode = "in training mode" if module.training else "(in eval mode now, but model.train() switches it back)"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):  # BatchNorm1d/2d/3d, SyncBatchNorm, lazy ones
        return (f"BatchNorm {mode} normalises each example with statistics of the whole batch, so one example "
                "moves every other example's gradient (and its running statistics are released without noise); "
                "use GroupNorm/LayerNorm without affine parameters instead, or fold it into the preceding layer")
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        return (f"InstanceNorm with track_running_stats=True {mode} averages running statistics over the batch, "
                "released without noise; use track_running_stats=False")
    return None


def static_problems(model: nn.Module) -> list[str]:
    """Every problem that can be found without running the model (see module docstring)."""
    problems = []
    for name, m in model.named_modules():
        label = _label(name, m, model)
        why = _batch_mixing_reason(m)
        if why is not None:
            problems.append(f"{label}: {why}")
        if isinstance(m, nn.Conv2d) and m.padding_mode != "zeros":
            problems.append(f"{label}: padding_mode={m.padding_mode!r}; only 'zeros' keeps the sensitivity bound "
                            "(pad explicitly with torch.nn.functional.pad before the layer instead)")
            continue
        own = [(pname, p) for pname, p in m.named_parameters(recurse=False) if p.requires_grad]
        if not own or type(m) in _CONVERTIBLE or isinstance(m, bnn._Clipped):
            continue
        if why is not None:
            continue  # already reported; its affine parameters are one more reason
        names = ", ".join(f"{name + '.' if name else ''}{pname}" for pname, p in own)
        suggestion = "freeze them (requires_grad_(False))"
        if isinstance(m, (nn.LayerNorm, nn.GroupNorm)):
            suggestion += " or build the layer with elementwise_affine=False / affine=False"
        elif isinstance(m, _CONVERTIBLE):
            suggestion += (f" or use a plain nn.{'Linear' if isinstance(m, nn.Linear) else 'Conv2d'} "
                           f"(subclasses such as {type(m).__name__} are not converted)")
        else:
            suggestion += " or replace the layer by nn.Linear/nn.Conv2d (which are converted to clipped layers)"
        problems.append(f"{label}: trainable parameters outside bpclip_fast's clipped layers ({names}) would be "
                        f"trained without clipping or noise; {suggestion}")
    if not any(p.requires_grad for p in model.parameters()):
        problems.append(f"{type(model).__name__}: no trainable parameters")
    return problems


@contextlib.contextmanager
def _preserved_state(model: nn.Module):
    """Restores the model's buffers and the random number generators after a probe forward."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({b.device.index for b in list(model.parameters()) + list(model.buffers())
                      if b.device.type == "cuda" and b.device.index is not None})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def probe(model: nn.Module, example_input) -> tuple[list[str], dict[str, tuple]]:
    """One forward pass of ``example_input``: (problems: modules with trainable parameters called more
    than once, {qualified name: input shape} of every Linear/Conv2d)."""
    calls: dict[str, int] = {}
    shapes: dict[str, tuple] = {}
    handles = []
    for name, m in model.named_modules():
        if not any(p.requires_grad for p in m.parameters(recurse=False)):
            continue

        def hook(mod, args, _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            if args and isinstance(args[0], torch.Tensor):
                shapes[_name] = tuple(args[0].shape)

        handles.append(m.register_forward_pre_hook(hook))
    try:
        with _preserved_state(model), torch.no_grad():
            if isinstance(example_input, (tuple, list)):
                model(*example_input)
            elif isinstance(example_input, dict):
                model(**example_input)
            else:
                model(example_input)
    finally:
        for h in handles:
            h.remove()
    modules = dict(model.named_modules())
    problems = [f"{_label(name, modules[name], model)}: reached {k} times in one forward pass; one example would "
                f"then move its gradient by {k}·Δ while the noise is scaled to Δ; use a separate layer per use"
                for name, k in calls.items() if k > 1]
    return problems, shapes


def validate(model: nn.Module, example_input=None) -> list[str]:
    """Static problems, plus (with ``example_input``) layers reached more than once in a forward pass."""
    problems = static_problems(model)
    if example_input is not None:
        problems += probe(model, example_input)[0]
    return problems
