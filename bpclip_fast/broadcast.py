"""An index of one row shared by the batch (Hugging Face's positions, ``arange(T).unsqueeze(0)``):
the fused ``Embedding`` looks it up once per example.

Looked up as ``[1, T]`` and broadcast over the ``B`` examples afterwards, the broadcast's backward
sums the examples' gradients into the one row, and nothing per example is left to clip. Expanded
before the lookup to ``[B, T]`` (a view), row ``i`` of the output belongs to example ``i`` and its
gradient is example ``i``'s own, as for any index given per example; the output becomes ``[B, T, D]``
instead of ``[1, T, D]``, the same values wherever it is broadcast.

``B`` is the number of examples of the model's current call (:func:`bpclip_fast.batches.call_rows`,
a micro-batch's own rows too), set by :func:`install`'s hooks on the private model for each
grad-enabled call and reset when it returns or raises (a stack per context: nested and repeated
calls each see their own; each entry names the model whose call pushed it, and a call pops only its
own model's, so a pre-hook of the loop's that raises before the engine's pushed pops nothing; a
recursive call of the same model whose earlier pre-hook raises, caught by the loop, still pops the
enclosing call's entry: its layers then see no rows, and the row count refuses the step, review 25).
Nothing is expanded outside such a call (no engine, ``convert_model`` alone, ``torch.no_grad()``
inference, a ``torch.compile``'d forward: there the layer refuses the one row as before), nor where
``B`` is unknown or 1.

What makes the expansion safe is checked before training by ``make_private``'s probes
(:mod:`bpclip_fast.validate`): the model's output must not change (code that relies on the leading
1: ``.sum(0)``, ``torch.cat`` along dimension 0), and row ``i`` of the expanded output must reach
example ``i``'s outputs only (not ``e[0]``, ``e.mean(0)``), so that its gradient is example ``i``'s.
"""

from __future__ import annotations

import contextvars

import torch

__all__ = ["expand", "install", "current_rows"]

# The model calls in progress, innermost last, as (model, rows) (a tuple: each context has its own).
_ROWS: contextvars.ContextVar = contextvars.ContextVar("bpclip_call_rows", default=())


def current_rows() -> int | None:
    """The examples of the innermost private model call in progress; None outside one or unknown."""
    stack = _ROWS.get()
    return stack[-1][1] if stack else None


def expand(idx: torch.Tensor) -> torch.Tensor:
    """``idx`` (an index whose first dimension is the examples') with one row expanded to the
    current call's ``B`` rows; unchanged where it has another number of rows or ``B`` is unknown or 1."""
    rows = current_rows()
    if rows is None or rows <= 1 or idx.dim() < 1 or idx.shape[0] != 1:
        return idx
    return idx.expand(rows, *idx.shape[1:])


def _no_hook(*_):
    return None


def _no_hook_factory():
    return _no_hook


class _Enter:
    """The model's forward pre-hook: pushes the call's rows (None where gradients are off). Pickles
    (and deep-copies) as a no-op, as the engine's other hook: a saved model has no engine."""

    def __call__(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # a compiled forward expands nothing (nor pops): no graph break
            return
        from .batches import call_rows

        rows = call_rows(args, kwargs) if torch.is_grad_enabled() else None
        _ROWS.set(_ROWS.get() + ((module, rows),))

    def __reduce__(self):
        return (_no_hook_factory, ())


class _Leave:
    """The model's forward hook (``always_call``: also when the forward or a pre-hook raises): pops
    the call's rows, if its pre-hook pushed them (a pre-hook before it may have raised first)."""

    def __call__(self, module, args, output):
        if torch.compiler.is_compiling():
            return
        stack = _ROWS.get()
        if stack and stack[-1][0] is module:
            _ROWS.set(stack[:-1])

    def __reduce__(self):
        return (_no_hook_factory, ())


def install(model: torch.nn.Module) -> list:
    """Hooks giving ``model``'s calls their rows; returns their handles. Not prepended: dynamo 2.11
    reads a reordered hook dict's guards at the wrong keys (an ``AttributeError`` building them)."""
    return [model.register_forward_pre_hook(_Enter(), with_kwargs=True),
            model.register_forward_hook(_Leave(), always_call=True)]


class pushed:
    """``with pushed(rows):`` the calls inside see ``rows`` as their examples (the probes' passes,
    :mod:`bpclip_fast.validate`, as the engine's hooks set them in training); ``None``: none expand."""

    def __init__(self, rows: int | None):
        self._rows = rows

    def __enter__(self):
        self._token = _ROWS.set(_ROWS.get() + ((None, self._rows),))

    def __exit__(self, *exc):
        _ROWS.reset(self._token)
