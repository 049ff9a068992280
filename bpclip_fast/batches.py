"""How a collated batch splits into the model's inputs and the loss's targets: the one rule that
``make_private``'s probe forward, the dynamic probes (:mod:`bpclip_fast.validate`) and the
criterion probe (:mod:`bpclip_fast.criterion`) share, so that each calls the model as the training
loop does. The convention is Opacus users' loop::

    for *inputs, y in loader:                  # a tuple batch (*inputs, label)
        loss = criterion(model(*inputs), y)
    for batch in loader:                       # a dict batch (Hugging Face): the labels inside
        loss = model(**batch)

- a tuple or list of ``n >= 2`` elements: ``model(*batch[:k])`` and ``criterion(output, *batch[k:])``,
  ``k = n - 1`` (the label last) unless ``make_private(..., batch_inputs=k)`` names another count:
  ``(x, y1, y2)`` with ``criterion(model(x), y1, y2)`` is ``batch_inputs=1``. One element: the
  input alone.
- a dict: ``model(**batch)``, no target (``batch_inputs`` has nothing to count and is refused).
- anything else (a lone tensor): ``model(batch)``.

A single model input that is itself a tuple or dict (``((tokens, image), y)``) is called
``model(*x)``/``model(**x)`` (:func:`bpclip_fast.validate._call`), as before this convention.

The split does not enter any bound: every layer's Δ is fixed from the shapes the probe forward
saw (a shape-dependent Δ only from a declared ``max_input_shape``) and each training forward
enforces it (rule *max-shape*). A wrong split makes the probes diagnose another call than the
loop's, so a split the model cannot take is an error naming ``batch_inputs``; a split it can take
but the loop does not make (an optional second argument absorbing a target) is the loop's
responsibility, as is every call the loop makes.
"""

from __future__ import annotations

from collections.abc import Mapping

import inspect
import numbers

import torch

__all__ = ["split_batch", "describe", "call_failed", "normal_shapes", "probe_input", "call_rows"]


def _elements(batch) -> int | None:
    """The number of elements of a tuple/list batch; None for a dict, a tensor or anything else."""
    if isinstance(batch, (tuple, list)) and not isinstance(batch, torch.Tensor) and batch:
        return len(batch)
    return None


def _count(n: int, batch_inputs: int | None) -> int:
    """How many leading elements of a batch of ``n`` are model inputs: all but the label by default."""
    return max(n - 1, 1) if batch_inputs is None else batch_inputs


def split_batch(batch, batch_inputs: int | None = None):
    """``(inputs, targets)`` of a collated ``batch`` (module docstring): ``inputs`` as
    :func:`bpclip_fast.validate._call` takes it (a tuple of several inputs is ``model(*inputs)``),
    ``targets`` a tuple. Raises ``ValueError`` where ``batch_inputs`` does not fit the batch."""
    n = _elements(batch)
    if n is None:
        if batch_inputs is not None and not (batch_inputs == 1 and not isinstance(batch, Mapping)):
            what = "a dict, called as model(**batch)" if isinstance(batch, Mapping) else \
                f"one {type(batch).__name__}, called as model(batch)"
            raise ValueError(f"batch_inputs={batch_inputs} counts the leading elements of a tuple batch, but the "
                             f"loader's batch is {what}; leave batch_inputs unset")
        return batch, ()
    k = _count(n, batch_inputs)
    if k > n:
        raise ValueError(f"batch_inputs={k}, but the loader's batch has {n} elements; batch_inputs counts the "
                         f"leading elements that are model inputs (at most {n})")
    return (batch[0] if k == 1 else tuple(batch[:k])), tuple(batch[k:])


def call_rows(args, kwargs=None) -> int | None:
    """The number of examples in one call of the model, ``model(*args, **kwargs)``: the first
    dimension its tensor inputs share, as the loader's batch holds its examples (module docstring),
    the whole batch or a micro-batch of it. A tensor of one row is a batch of one or a row shared
    by the batch (a position index broadcast over it), so it counts only where every tensor has
    one row. None where the tensors disagree or there is no batched tensor: the rows are unknown."""
    from torch.utils import _pytree as pytree

    sizes = {int(t.shape[0]) for t in pytree.tree_leaves((args, kwargs or {}))
             if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) > 1:
        sizes.discard(1)
    return sizes.pop() if len(sizes) == 1 else None


def describe(batch, batch_inputs: int | None = None) -> str:
    """How ``batch`` is split, in words, for error messages."""
    n = _elements(batch)
    if n is None:
        return ("the loader's batch is a dict, called as model(**batch)" if isinstance(batch, Mapping) else
                f"the loader's batch is one {type(batch).__name__}, called as model(batch)")
    k = min(_count(n, batch_inputs), n)
    call = "model(" + ", ".join(f"batch[{i}]" for i in range(k)) + ")"
    loss = "criterion(output" + "".join(f", batch[{i}]" for i in range(k, n)) + ")"
    how = ("the default: every element but the last is a model input" if batch_inputs is None
           else f"batch_inputs={batch_inputs}")
    return f"the loader's batch, a {type(batch).__name__} of {n} elements, was split as {call} and {loss} ({how})"


def _fitting_counts(model, n: int) -> tuple[str, list[int]]:
    """``model.forward``'s signature in words and the counts ``k`` in ``1..n`` for which it accepts
    ``k`` positional arguments (none where the signature cannot be read)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return "", []
    fitting = []
    for k in range(1, n + 1):
        try:
            signature.bind(*range(k))
        except TypeError:
            continue
        fitting.append(k)
    return f"forward{signature}", fitting


def call_failed(exc: BaseException, model, batch, batch_inputs: int | None, what: str) -> str:
    """The problem message for a probe whose call of the model raised ``TypeError`` (``what``
    names the probe): how the batch was split, and which ``batch_inputs`` the forward takes."""
    n = _elements(batch)
    message = f"make_private: {what} could not call the model ({exc!r}): {describe(batch, batch_inputs)}"
    if n is None:
        return message
    forward, fitting = _fitting_counts(model, n)
    fitting = [k for k in fitting if k != _count(n, batch_inputs)]
    if fitting:
        return (f"{message}; {forward} takes {' or '.join(map(str, fitting))} of them: pass make_private(..., "
                f"batch_inputs={fitting[0]}), the number of leading elements of the batch that are model inputs")
    return (f"{message}; pass make_private(..., batch_inputs=k), the number of leading elements of the batch that "
            "are model inputs (batch_inputs=1 for (input, target1, target2))")


def _shape(value, what: str) -> tuple:
    try:
        items = list(value)
    except TypeError:
        raise ValueError(what) from None
    if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in items):
        raise ValueError(what)
    return tuple(int(s) for s in items)


def normal_shapes(shapes):
    """``max_input_shape`` normalised: one shape (a tuple of ints: the model takes one input), a
    tuple of shapes (one per model input of a tuple batch) or a dict ``{key: shape}`` (a dict batch)."""
    what = ("make_private: max_input_shape must be the largest per-example shape of the model's input (a tuple "
            "of ints, without the batch dimension), a tuple of such shapes (one per model input: "
            f"((T,), (3, 32, 32)) for model(tokens, image)) or, for a dict batch, a dict {{key: shape}}; got {shapes!r}")
    if isinstance(shapes, Mapping):
        return {k: _shape(v, what) for k, v in shapes.items()}
    if isinstance(shapes, torch.Tensor) or isinstance(shapes, (str, bytes)):
        raise ValueError(what)
    try:
        items = list(shapes)
    except TypeError:
        raise ValueError(what) from None
    if all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in items):
        return tuple(int(s) for s in items)
    return tuple(_shape(s, what) for s in items)


def _several(shapes) -> bool:
    return isinstance(shapes, tuple) and any(isinstance(s, tuple) for s in shapes)


def probe_input(first, batch_inputs, shapes, like: torch.Tensor | None):
    """The model input of ``make_private``'s probe forward: the inputs of ``first`` (one example
    collated, or None where it could not be read) or, with ``shapes`` (normalised
    ``max_input_shape``), zeros of those shapes in their structure. A zero input takes the example's
    dtype where that is not floating point (token indices: index 0), else ``like``'s (the model's
    parameters), as :func:`bpclip_fast.engine._common.to_device` casts the floating tensors."""
    inputs = None if first is None else split_batch(first, batch_inputs)[0]
    if shapes is None:
        return inputs

    def zeros(shape, example):
        integer = isinstance(example, torch.Tensor) and not example.is_floating_point()
        dtype = example.dtype if integer else (like.dtype if like is not None else None)
        return torch.zeros((1, *shape), dtype=dtype, device=like.device if like is not None else None)

    where = "" if first is None else f" ({describe(first, batch_inputs)})"
    if isinstance(shapes, Mapping):
        if inputs is not None and not isinstance(inputs, Mapping):
            raise ValueError(f"make_private: max_input_shape is a dict of shapes, for a dict batch{where}")
        if inputs is not None and set(shapes) != set(inputs):
            missing, extra = sorted(set(inputs) - set(shapes), key=str), sorted(set(shapes) - set(inputs), key=str)
            raise ValueError(f"make_private: max_input_shape needs one shape per key of the dict batch, "
                             f"{sorted(inputs, key=str)}" + (f"; missing: {missing}" if missing else "")
                             + (f"; not in the batch: {extra}" if extra else ""))
        return {k: zeros(s, None if inputs is None else inputs[k]) for k, s in shapes.items()}
    if isinstance(inputs, Mapping):
        raise ValueError(f"make_private: the batch is a dict{where}; max_input_shape must be a dict {{key: shape}}")
    count = None if inputs is None else (len(inputs) if isinstance(inputs, (tuple, list)) else 1)
    if not _several(shapes):
        if count not in (None, 1):
            raise ValueError(f"make_private: max_input_shape={shapes} is one shape, but the model takes {count} "
                             f"inputs{where}; give one shape per input: max_input_shape=("
                             + ", ".join(f"shape of input {i}" for i in range(count)) + ")")
        return zeros(shapes, inputs)
    if count is not None and count != len(shapes):
        raise ValueError(f"make_private: max_input_shape has {len(shapes)} shapes, but the model takes "
                         f"{count} input{'s' if count > 1 else ''}{where}; give one shape per input")
    if count == 1:  # one shape for the single input, written as a tuple of one shape
        return zeros(shapes[0], inputs)
    examples = inputs if inputs is not None else [None] * len(shapes)
    return tuple(zeros(s, e) for s, e in zip(shapes, examples))
