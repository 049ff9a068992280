"""Integer handles for the Python objects a compiled op names (:mod:`bpclip_fast.compiled`).

A custom op takes tensors and numbers, not layers or flat groups, so each clipped layer and each
``exact.FlatClipping`` gets a handle when it is made, kept as a plain integer attribute: dynamo
reads it as a constant of the trace (and guards it) on every torch it supports, where an
``assume_constant_result`` function taking the object itself is refused by torch 2.11's dynamo.

Handles come from a counter and are never reused: a graph traced for an object that has since died
finds nothing (:func:`lookup` raises) rather than a newer object at the same address. The counter
starts at a random point below 2^51 in each process (a handle also travels as a float64 value,
exact below 2^53): a handle is a constant of the traced graph, and inductor's on-disk graph cache
keys on the graph, not on what the ops' fake kernels read through the handle (a flat group's
number of layers, a layer's weight layout). A counter from 1 gave two processes' different models
the same graph text, and the cached kernel of one, run on the other's tokens, corrupted the heap.

A copy (``copy.copy``, ``copy.deepcopy``, pickling) calls :func:`register` again from its
``__setstate__``: the attribute it copied names the original, whose state its compiled ops would
otherwise act on.
"""

from __future__ import annotations

import itertools
import secrets
import weakref

_NEXT = itertools.count(1 + secrets.randbelow(1 << 51))
_OBJECTS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register(obj) -> int:
    """A new handle naming ``obj`` (weakly)."""
    handle = next(_NEXT)
    _OBJECTS[handle] = obj
    return handle


def get(handle: int):
    """The live object ``handle`` names, or ``None``."""
    return _OBJECTS.get(int(handle))


def lookup(handle: int, kind: type, what: str):
    """The live object ``handle`` names; a clear error if it died or is not a ``kind``."""
    obj = _OBJECTS.get(int(handle))  # int(): a SymInt where the graph was traced with dynamic=True
    if not isinstance(obj, kind):
        raise RuntimeError(f"bpclip_fast.compiled: the {what} this compiled graph was traced for no longer exists; "
                           "compile the model again")
    return obj
