"""What :meth:`bpclip_fast.PrivacyEngine.validate` checks: static checks, and probes that run the model.

The privacy argument (DESIGN.md section 5) assumes that each example reaches each clipped layer once
per step, that a layer's first dimension is the example dimension, that examples do not mix before
(or, through the gradient, after) a layer, that a clipped layer's parameter gradient is exactly its
own clipped contribution, and that nothing data-dependent is released through buffers. Every
problem message names the module (qualified name and type) and the rule, and says what to do.

``static_problems(model)``
    Found without running the model, by the checks of :mod:`bpclip_fast.registry` (the one home of
    what can be trained, which ``convert_model`` and the engine consult too): BatchNorm in any mode,
    InstanceNorm with running statistics, ``padding_mode`` other than zeros, trainable parameters
    outside the registered layer types (:mod:`bpclip_fast.registry`).

``probe(model, example_input)``
    What the engine runs on one example today: a ``torch.no_grad()`` forward (buffers and random
    number generators restored) that counts the calls of every module owning trainable parameters
    (rule *reuse*) and records each one's input shape.

``dynamic_problems(model, example_input)``
    Runs the model on a probe batch of ``B`` rows built from ``example_input`` (its rows repeated,
    floating-point values replaced by seeded random normals so that the outcome does not depend on
    the private data; integer tensors such as token indices are kept). Everything runs on a
    ``copy.deepcopy`` of the model in training mode, under a forked random number generator; if the
    model cannot be deep-copied it runs in place and the training modes, buffers and ``.grad`` are
    restored (Python attributes that ``forward`` itself changes are not). Gradients are taken with
    ``torch.autograd.grad`` of a fixed loss on the outputs (a random projection plus a square), so no
    ``.grad`` is ever written. The probes:

    1. *example rows*: every trainable layer's input has first dimension ``B``. ``B >= 3`` is chosen
       to differ from every dimension of the input and, after a first pass, of every layer input,
       so a ``[T, B, d]`` layout cannot pass by coincidence. Catches ``flatten(0, 1)`` and
       sequence-first layouts inside the model. A generic unit (:mod:`bpclip_fast.generic`) must hold
       the ``B`` examples in the batch dimension the path reads, of its first tensor input and of
       every output that gets a gradient (``B`` avoids their other sizes too): a position table
       returned on its own, a transposed or sequence-first output without ``batch_first=False``.
    2. *batch independence*: changing the first (then the last) example changes no other example's
       model output, trainable-layer input or trainable-layer output gradient. Catches
       ``h - h.mean(0)``, ``F.batch_norm`` with batch statistics, attention across the batch.
       The changed example's integer and boolean tensors (ids, masks, lengths) take the next
       example's values, rolled (:func:`_perturbed`): valid indices, and a new multiset of the batch's tokens.
    3. *buffers*: no buffer changes in one training-mode forward (an EMA, running statistics, a
       counter): it would be updated from the data and released without noise.
    4. *gradient ownership*: each trainable layer's parameter gradient equals the one the layer
       computes from its own inputs and output gradients. Catches a weight also used in plain code
       (a tied decoder ``F.linear(z, enc.weight.t())``), by another module, or by two layers. A
       generic unit's parameters: no differentiable use outside the unit's own forward
       (:mod:`bpclip_fast.validate.unit_uses`).
    5. *reuse*: no module owning trainable parameters is reached more than once per forward; the
       calls a generic unit's own forward makes to a module inside it count once (the unit's
       per-example gradient covers them), its calls from outside the unit each
       (:func:`bpclip_fast.validate.forward.count_hooks`).

    An Embedding's index of one row in the probe batch (a position index shared by the examples) is
    looked up once per example in every pass, as in private training (:mod:`bpclip_fast.broadcast`),
    after :mod:`bpclip_fast.validate.shared_index` checked that this keeps the model's output (else it is
    refused there and the passes look it up as one row) and before it checks that each looked-up row
    reaches its own example only.

    What they cannot see: only what this one probe batch exercises. A layer that sees a subset of
    the rows, mixes rows or is reused only for some data (data-dependent control flow, a branch taken
    for large batches only) passes; so does mixing through an example that is neither the first nor
    the last (``h + h[1]``), a weight used elsewhere with a contribution below rounding error, a
    buffer or Python attribute changed only in some steps or outside ``forward``, Python attributes
    of the model (never compared), and anything the training loop does outside the model (a
    sequence-first input built by the loop, a loss that mixes examples, two backward passes). Values
    that are not finite on the probe batch (a ``log`` of the random inputs) give no verdict.
    Modules already reported statically (BatchNorm, InstanceNorm with running statistics) are put in
    eval mode for the probes, so that their problem is reported once. Our own layers
    (``bpclip_fast.nn.Linear``/``Conv2d``) are probed as their registered torch type.

Without an input, reuse is left to training time, where our layers refuse a second grad-enabled
forward while the step's noise is armed (``bpclip_fast.nn``).

``fix_model(model)``
    Replaces every BatchNorm by a GroupNorm (statistics within each example), in place, and warns
    with the list of what it changed: the fix the BatchNorm problem message suggests.

The modules, one concern each: ``forward`` (how a model is called; :func:`probe`; rule *reuse*),
``probe_input`` (the probe batch), ``probe_pass`` (one recorded pass), ``probes`` (rules 1 to 4),
``unit_uses`` (rule 4 for the generic units: their parameters used outside their forward),
``isolation`` (the copy the probes run on) and ``fix`` (:func:`fix_model`); this file holds the
entry points.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import nn as _clipped_layers  # noqa: F401  (registers the clipped layer types in the registry)
from .. import registry
from . import shared_index
from .fix import fix_model
from .forward import _cuda_devices, _reuse_problems, probe
from .isolation import _as_torch_layers, _isolated, _unpacked
from .probe_input import _has_rows_to_perturb, _probe_batch, _probe_input, _rows_of  # noqa: F401  (_rows_of: criterion)
from .probe_pass import _SHARED_UNITS, _Pass, _run, _shared_index_layer, _trainable_layers
from .unit_uses import outside_use_problems
from .probes import _buffer_problems, _buffer_snapshot, _example_rows_problems, _mixing_problems, \
    _ownership_problems, _restore_buffers

# Private names that only a neighbour reads, through the package (bpclip_fast.criterion as
# ``_v.<name>``; batches.py's docs name ``validate._call``), so that they need
# not know the layout. A monkeypatch of one of them here reaches those readers, not this package's own
# modules, which import from each other.
from .forward import _call  # noqa: F401
from .probe_input import _SEED, _map_tensors, _perturbed, _random_like, _tensors  # noqa: F401
from .probe_pass import _seed  # noqa: F401
from .probes import _own_gradients  # noqa: F401

__all__ = ["static_problems", "probe", "dynamic_problems", "validate", "fix_model"]


def static_problems(model: nn.Module, clipping: str | None = None) -> list[str]:
    """Every problem that can be found without running the model: the registry's module checks
    (:func:`bpclip_fast.registry.module_problems`), with ``clipping`` the layers that mode has no
    bound for (:func:`bpclip_fast.registry.mode_problems`), and a model with nothing to train."""
    problems = registry.module_problems(model)
    if clipping is not None:
        problems += registry.mode_problems(model, clipping)
    if not any(p.requires_grad for p in model.parameters()):
        problems.append(f"{type(model).__name__}: no trainable parameters")
    return problems


def dynamic_problems(model: nn.Module, example_input, clipping: str | None = None) -> list[str]:
    """Problems found by running the model on a probe batch built from ``example_input`` (a tensor, or a
    tuple/list/dict of tensors as the model takes them; its first dimension is the examples'): rules
    *example rows*, *batch independence* (skipped when the input has no floating-point tensor),
    *buffers*, *gradient ownership* and *reuse*; see the module docstring.

    The model, its parameters, ``.grad``, buffers, training modes and the global random number
    generators are left as they were. Modules reported by :func:`static_problems` for batch
    statistics (BatchNorm, InstanceNorm with running statistics) run in eval mode here, so each
    problem is reported once. Raises whatever the model raises on the probe batch. ``clipping``: an
    exact mode trains modules that share a trainable parameter as one generic unit (their common
    ancestor), which the per-layer rules then skip; otherwise the sharing is reported.
    """
    if example_input is None:
        raise ValueError("dynamic_problems: needs an example input (one batch as the model takes it)")
    from ..modes import EXACT

    token = _SHARED_UNITS.set(clipping in EXACT)
    try:
        with _isolated(model) as work, _unpacked(work, model), _as_torch_layers(work), \
                torch.random.fork_rng(devices=_cuda_devices(work)):
            return _probe(work, example_input)
    finally:
        _SHARED_UNITS.reset(token)


def _probe(model: nn.Module, example_input) -> list[str]:
    labels = {name: registry.label(name, m, model) for name, m in model.named_modules()}
    model.train()  # private training runs in training mode: dropout active, buffers updated
    for m in model.modules():
        if registry.mixes_batch(m):
            m.eval()  # already a static problem; in eval mode it neither mixes examples nor updates buffers
    buffers = _buffer_snapshot(model)
    devices = _cuda_devices(model)

    expanding = [True]  # whether the passes expand a shared index row, unless a pass says (shared_index)

    def run(probe_input, batch: int, backward: bool = True, expand: bool | None = None) -> _Pass:
        _restore_buffers(buffers)  # every pass starts from the same buffers (an EMA used in forward)
        return _run(model, probe_input, batch, devices, backward, expanding[0] if expand is None else expand)

    batch = _probe_batch(example_input, run)
    probe_input = _probe_input(example_input, batch)
    shared = {name for name, m in _trainable_layers(model) if _shared_index_layer(m)}
    problems, refused = shared_index.equivalence_problems(model, probe_input, batch, run, labels, shared)
    expanding[0] = not refused  # a refused expansion is reported once; the other probes see the model as today
    reference = run(probe_input, batch)
    buffer_problems = _buffer_problems(buffers, labels)  # before the next pass restores them
    problems += _example_rows_problems(reference, batch, labels, refused)
    problems += shared_index.row_problems(model, probe_input, reference, batch, run, labels)
    if _has_rows_to_perturb(probe_input):
        problems += _mixing_problems(probe_input, reference, batch, run, labels)
    problems += buffer_problems
    problems += _ownership_problems(model, reference, labels)
    problems += outside_use_problems(model, reference.outside)
    problems += _reuse_problems(reference.counts, model)
    return problems


def validate(model: nn.Module, example_input=None, clipping: str | None = None) -> list[str]:
    """Static problems (for ``clipping``, if given), plus (with ``example_input``) the problems the
    probes find (module docstring)."""
    problems = static_problems(model, clipping)
    if example_input is not None:
        problems += dynamic_problems(model, example_input, clipping)
    return problems
