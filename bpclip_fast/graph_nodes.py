"""What the step boundary reads of the autograd graph: a parameter's ``AccumulateGrad`` node, the
node whose backward recomputes a forward inside a backward pass (activation checkpointing), and the
Python nodes whose backward is running around it. The marks these carry, and what they refuse, are
:meth:`bpclip_fast.boundary.LayerStep.first_landing`'s."""

from __future__ import annotations

import sys
import threading

import torch

# What the autograd engine runs of ours (gradient hooks, Functions' backward, final callbacks) and the
# private optimizer's step never run under dynamo: a backward() called from a compiled function (a
# graph break there) has dynamo trace every Python frame the engine then runs, and a traced hook
# compared a weak reference's target as another tensor (an honest step refused, review 26). About
# 0.2 us a call.
untraced = torch._dynamo.disable

_AUTOGRAD_KEYS = tuple(getattr(torch._C.DispatchKey, k) for k in (
    "AutogradCPU", "AutogradCUDA", "AutogradOther", "ADInplaceOrView", "AutogradFunctionality"))


def accumulate_node(p):
    """``p``'s ``AccumulateGrad`` node (autograd keeps one per leaf while it lives). Also asked inside a
    backward pass, where grad mode is off, and inside a compiled layer's backward op, a custom op's
    kernel where the autograd dispatch keys are excluded and ``view_as`` records no ``grad_fn``: both
    are let back in for the lookup (a layer unfrozen between steps of a compiled model, review 22)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        return p.view_as(p).grad_fn.next_functions[0][0]


def forward_origin():
    """What identifies a forward run again inside a backward pass, or ``None`` for a forward run outside
    one. Activation checkpointing that recomputes the forward in each pass (reentrant
    ``torch.utils.checkpoint``, or non-reentrant under ``torch.compile``) makes a fresh autograd
    context every time, so the context cannot say that two passes released the same examples; the
    node whose backward recomputes them (``CheckpointFunctionBackward``, ``CompiledFunctionBackward``)
    is the same object in every pass over a retained graph. Only a Python node can carry the mark
    (:meth:`LayerStep.first_landing`); under any other (a C++ node's saved-tensor unpack, where
    eager non-reentrant checkpointing recomputes into contexts whose backward never runs) the
    context itself is marked, as for a forward run outside a backward.

    That node may itself be made afresh by each pass: checkpointing nested inside reentrant
    checkpointing (the inner ``CheckpointFunctionBackward``, or a compiled body's
    ``CompiledFunctionBackward``, is made when the outer node's backward recomputes its forward). The
    outer nodes, the same in every pass over the retained graph, are the Python nodes whose backward
    is running (:func:`_running_python_nodes`); they are kept on the node, ``_bp_outer``, and marked
    with it. An outer node is marked with the landing pass, not with its own backward's call: a
    loop of private steps run inside one call of a user Function's backward, through reentrant
    checkpointing, has its second step refused (review 23, F1; the same loop without checkpointing
    was refused already, its origin being that node)."""
    if torch._C._current_graph_task_id() == -1:
        return None
    node = current_python_node()
    if node is not None and "_bp_outer" not in node.__dict__:
        node._bp_outer = _running_python_nodes(node)
    return node


# The methods by which the engine runs a Python node (``BackwardCFunction.apply``, ``apply_boxed``):
# a frame of one of these is a node's backward running, the node its first argument.
_NODE_RUNNERS = frozenset(f.__code__ for f in vars(torch.autograd.function.BackwardCFunction).values()
                          if hasattr(f, "__code__") and f.__code__.co_argcount >= 1)
# What a thread runs while it waits for a backward pass it asked for (torch.autograd.backward and
# .grad both end there), the outer node's backward below it.
_ENGINE_CALL = torch.autograd.graph._engine_run_backward.__code__


def _running_python_nodes(inner) -> tuple:
    """The Python autograd nodes other than ``inner`` whose backward is running, innermost first
    (frames walked once per recomputing node, only inside a backward pass): on this thread, and
    on an engine device thread on every other thread too. The engine hands a reentrant pass's nodes
    of another device to that device's thread (an outer segment on the CPU around an inner one on a
    GPU, or model parallelism across GPUs), while the thread that asked is blocked inside the outer
    node's backward (review 23, F2). Only a thread waiting in the engine is read (its innermost
    frame the engine call): a thread running an unrelated Python backward across two of our steps
    had its node marked by the first and the second refused (review 24, F2)."""
    found = _nodes_in_stack(sys._getframe(1), inner)
    if _on_engine_thread():
        me = threading.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident != me and frame.f_code is _ENGINE_CALL:
                found += _nodes_in_stack(frame, inner)
    return tuple(dict.fromkeys(found))



def _nodes_in_stack(frame, inner) -> list:
    found = []
    while frame is not None:
        code = frame.f_code
        if code in _NODE_RUNNERS:
            node = frame.f_locals.get(code.co_varnames[0])
            if node is not None and node is not inner and hasattr(node, "__dict__"):
                found.append(node)
        frame = frame.f_back
    return found


def _on_engine_thread() -> bool:
    """Whether this thread was started outside Python: the autograd engine's device threads."""
    return isinstance(threading.current_thread(), threading._DummyThread)


def current_python_node():
    """The autograd node the engine is running now if it is a Python node (an ``autograd.Function``'s,
    which can carry a mark), else ``None``."""
    node = torch._C._current_autograd_node()
    return node if hasattr(node, "__dict__") else None
