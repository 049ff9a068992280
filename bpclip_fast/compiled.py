"""Exact clipping under ``torch.compile``: the private layers as opaque custom ops (issue 25).

The eager path (:mod:`bpclip_fast.exact`) keeps a step's bookkeeping — the graph-task id of the
backward pass, its rows and draw (``boundary.LayerStep.begin_backward``), flat clipping's book
entries, the records of what each backward returned — in Python inside ``autograd.Function``
backwards. Dynamo would trace into those backwards and AOTAutograd would run their Python *once, at
trace time*: every later step would reuse one graph-task id, one noise key, one row count. So when
``torch.compiler.is_compiling()``, each exact layer's forward is instead one custom op (pure math)
whose registered backward is another custom op; the backward op's *runtime* implementation is the
eager backward's own code (``exact.clip_params``, ``exact._clip``, ``autograd._backward``), run inside the compiled
backward node, so the graph-task id, draws and records are those of the real pass.

Python objects cannot be op arguments, so the ops name them by integer handles:

* a layer by ``layer._bp_handle`` and a flat group by ``group.handle``, integers given when they are
  made (:mod:`bpclip_fast.handles`), and a flat layer's place in its group by ``layer._bp_flat_position``:
  plain attributes, which dynamo reads as constants of the trace;
* a flat book by its serial, carried as the *value* of the collector's tokens (float64 on the
  CPU, exact below 2^53): the collector op creates the book at run time and the layers' backward
  ops read the serial from the token they saved (a host read, never a device sync).

Order in the compiled backward follows data dependencies only: under ``flat`` each layer's backward
op returns a (zero) gradient for its token, and the collector's release op consumes the sum of
them, so it runs after every layer's entry is in the book, as autograd's dependency count makes the
eager collector do.

What the forward reads from Python becomes a dynamo guard. The compiled forward reads only
configuration fixed at make_private (the mode, the layer's geometry, which parameters train);
values that move between steps are read at run time inside the ops: the bounds' version of the
forward (returned by the forward op as a CPU tensor and checked by the backward op, as
``_ExactLayer`` checks ``ctx.bounds_version``), the clipping thresholds and noise bound, the step's
draw. The engine's forward pre-hook (``guards.OutsideCheck``) traces to an op that checks at run time,
on every grad-enabled call (``guards.outside_at_run_time``): dynamo does not always guard the
parameters' ``requires_grad`` (review 25).
"""

from __future__ import annotations

import collections
import math
import warnings

import torch
import torch.nn.functional as F

from . import exact, exact_examples, handles
from .amp import autocast_off
from .graph_nodes import current_python_node, forward_origin

# Every op below does its work in Python (the step's draw and rows, the flat book, the budget and
# bounds checks), which the replay of a CUDA graph (mode="reduce-overhead") never runs: a replayed step
# would add the draw of the captured one again. Inductor runs ops with this tag outside its graphs
# (graph partition) or does not capture the graph at all.
_NOT_IN_CUDA_GRAPHS = (torch.Tag.cudagraph_unsafe,)

# Books of compiled flat forwards, by serial, until their release. A forward whose backward never
# runs leaves its (empty) book here; the oldest are dropped past _MAX_BOOKS, and a backward reaching
# a dropped book is refused (its norms could not be paired with the others').
_BOOKS: "collections.OrderedDict[int, exact._Book]" = collections.OrderedDict()
_MAX_BOOKS = 4096
# Serials of the books already released (bounded like _BOOKS): a second backward reaching one is a
# second pass over a retained graph, refused as eager refuses it.
_RELEASED: "collections.OrderedDict[int, None]" = collections.OrderedDict()


def require_parameter_guards() -> None:
    """Turns dynamo's ``skip_tensor_guards_with_matching_dict_tags`` off on a torch before 2.14, once,
    with a warning (the setting is global). With it on, torch 2.11 does not guard the parameters of a
    module whose attributes did not change, ``requires_grad`` included, so a compiled private model
    kept the graph traced before a layer was frozen or unfrozen (review 28; plain torch shows it: a
    Linear unfrozen after compiling gets no gradient). Torch 2.14 guards ``requires_grad`` with it
    on. Called by ``make_private``; ``guards._check_traced_for`` refuses a stale graph whatever the
    setting."""
    config = torch._dynamo.config
    if (torch.torch_version.TorchVersion(torch.__version__) < (2, 14)
            and getattr(config, "skip_tensor_guards_with_matching_dict_tags", False)):
        config.skip_tensor_guards_with_matching_dict_tags = False
        warnings.warn(f"bpclip_fast: set torch._dynamo.config.skip_tensor_guards_with_matching_dict_tags = False "
                      f"(torch {torch.__version__} skips the requires_grad guards of a compiled model's parameters, "
                      "and a private model compiled before a layer was frozen or unfrozen would not be re-traced)",
                      stacklevel=3)


@torch._dynamo.assume_constant_result
def _recomputation() -> str:
    """The AOTAutograd setting that would let the partitioner recompute our forward ops in the
    backward, or ``""``. Those ops have run-time effects (a new flat book, the non-finite count, the
    budget check) and read what must be the forward's (the bounds' version), and the partitioner
    recomputes any op outside its allowlist under these settings (tags do not stop it)."""
    from torch._functorch import config

    if config.aggressive_recomputation:
        return "torch._functorch.config.aggressive_recomputation=True"
    if config.activation_memory_budget < 1.0:
        return f"torch._functorch.config.activation_memory_budget={config.activation_memory_budget}"
    return ""


def _refuse_recomputation():
    setting = _recomputation()
    if setting:  # a constant of the trace: no call, no break, in the default settings
        _raise_recomputation(setting)


@torch._dynamo.disable  # run for real: a raise in traced code would just fall back to eager
def _raise_recomputation(setting):
    raise RuntimeError(f"bpclip_fast: torch.compile of a private model with {setting}: the partitioner could "
                           "run the private layers' forward ops again in the backward, redoing their step "
                           "bookkeeping; compile it with the default recomputation settings")


def _forward_meta(lay, values: list, dtype: torch.dtype) -> torch.Tensor:
    """The CPU tensor a forward op of ``lay`` returns for its backward: ``values`` and, last, the handle
    of the node that recomputes this forward when it runs inside a backward pass
    (``graph_nodes.forward_origin``: reentrant checkpointing around a compiled model, or non-reentrant
    under ``torch.compile``), else 0. Carried as data, not as an attribute of the tensor: the graph
    may hand the backward a copy (an unpack, a saved output, aot_eager's detach).

    Data that a ``saved_tensors_hooks`` unpack can rewrite, and under reentrant checkpointing around
    a compiled body it is the only mark that lasts from one pass to the next (the compiled node is
    made afresh each pass, the tensor copied): an unpack writing 0 there released half a batch twice
    (review 22). So a forward recomputed inside a backward pass under a loop's saved-tensor hooks is
    refused; ``torch.utils.checkpoint``'s own recomputation hooks pass what they packed."""
    origin = forward_origin()
    if origin is not None:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is not None and getattr(hooks[0], "__module__", None) != "torch.utils.checkpoint":
            exact._refuse_release([lay], "a compiled layer's forward was recomputed inside a backward pass (reentrant "
                                  "checkpointing around a compiled model) under torch.autograd.graph."
                                  "saved_tensors_hooks, which could hide a second pass over its examples",
                                  "run that backward outside the hooks, or checkpoint inside the compiled model "
                                  "(use_reentrant=False)")
        return torch.tensor([*values, handles.register(origin)], dtype=dtype)
    return torch.tensor([*values, 0], dtype=dtype)


def _seal(*layers):
    """Fingerprints what the layers' backward just produced (``LayerStep.seal_produced``): the graph
    that receives it may add a plain use's gradient into its buffer in place, unseen by autograd."""
    for lay in layers:
        if lay._bp_step is not None:
            lay._bp_step.seal_produced()


def _geometry(stride, padding, dilation, groups):
    return None if stride is None else (list(stride), list(padding), list(dilation), groups)


class _ForwardMark:
    """What ``boundary.LayerStep.first_landing`` marks for a compiled layer's forward, whose backward op
    has no autograd context of its own: the tensor the forward op returned for its backward (as the
    context; an unpack that copies it, or a detach the graph adds, makes a new one each pass), the
    node that recomputed the forward inside a backward (named by the tensor's last value,
    ``_forward_meta``), and ``_bp_node``, the compiled graph's own node (``CompiledFunctionBackward``) that runs
    the backward op: made by the forward call and the same object in every pass over the retained
    graph, whatever an unpack returns, but made afresh where reentrant checkpointing recomputes the
    compiled forward itself (the origin holds there). ``None`` where no Python node runs it."""

    __slots__ = ("_tensor", "_bp_origin", "_bp_node")

    def __init__(self, tensor, origin):
        """``origin``: the tensor's last value (read with the rest of it by the caller)."""
        self._tensor = tensor
        self._bp_origin = handles.get(int(origin)) if origin else None
        self._bp_node = current_python_node()

    @property
    def _bp_landed(self):
        return getattr(self._tensor, "_bp_landed", None)

    @_bp_landed.setter
    def _bp_landed(self, marks):
        self._tensor._bp_landed = marks


# ------------------------------------------------------------------------------ Linear / Conv2d

@torch.library.custom_op("bpclip_fast_compiled::exact_forward", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def exact_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, token: torch.Tensor | None,
                  layer: int, stride: list[int] | None, padding: list[int] | None, dilation: list[int] | None,
                  groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, version)``: the layer's output and ``[bounds' version, origin]`` of this forward (CPU int64,
    :func:`_forward_meta`)."""
    lay = handles.lookup(layer, torch.nn.Module, "layer")
    version = _forward_meta(lay, [lay._bp_bounds_version], torch.int64)
    weight = exact.kernel_weight(lay, weight)
    if stride is None:
        return F.linear(x, weight, bias), version
    return F.conv2d(x, weight, bias, stride, padding, dilation, groups), version


@exact_forward.register_fake
def _(x, weight, bias, token, layer, stride, padding, dilation, groups):
    weight = exact.kernel_weight(handles.lookup(layer, torch.nn.Module, "layer"), weight)
    if stride is None:
        out = F.linear(x, weight, bias)
    else:
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return out, torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.custom_op("bpclip_fast_compiled::exact_backward", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
@autocast_off  # as the eager backward (bpclip_fast.amp)
def exact_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, token: torch.Tensor | None,
                   version: torch.Tensor, layer: int, mask: list[bool], stride: list[int] | None,
                   padding: list[int] | None, dilation: list[int] | None,
                   groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(∇x, ∇W, ∇b, ∇token)`` — ``_ExactLayer.backward`` at run time. ``mask``: [input, weight,
    bias] gradients wanted (fixed at trace time). Empty tensors stand for gradients not returned
    (flat: the collector releases W and b; the token's gradient is a zero that orders the release)."""
    lay = handles.lookup(layer, torch.nn.Module, "layer")
    bounds_version, origin = version.tolist()
    lay._bp_check_forward(_ForwardMark(version, origin), bounds_version)
    geometry = _geometry(stride, padding, dilation, groups)
    g = grad_out.contiguous()
    gx = exact._input_grad(lay, x, g, weight, geometry) if mask[0] else x.new_empty(0)
    if _lands_nowhere(token, lay):
        # flat, a pass that lands on no layer of the group (flat_release releases nothing in it): no
        # entry, and no lookup of a book the training pass may have released already (review 28, S2)
        return gx, weight.new_empty(0), weight.new_empty(0), token.new_zeros(())
    book = _layer_book(token, lay)
    pmask = exact._trainable(lay) if book is not None else list(mask[1:])
    def none():  # a fresh empty tensor each time: an op's outputs may not alias each other
        return weight.new_empty(0)
    gtoken = token.new_zeros(()) if token is not None else none()
    if not any(pmask):
        return gx, none(), none(), gtoken
    # own_inputs: the compiled graph owns x's and g's buffers and reuses them once this op returns
    # (inductor's memory planning), so a flat book holds copies of its own.
    out = exact.clip_params(lay, x, g, geometry, pmask, book, lay._bp_noise_bound, own_inputs=True)
    if out is None:
        return gx, none(), none(), gtoken
    _seal(lay)
    gw, gb = out
    return gx, (gw if gw is not None else none()), (gb if gb is not None else none()), gtoken


@exact_backward.register_fake
def _(grad_out, x, weight, token, version, layer, mask, stride, padding, dilation, groups):
    gx = torch.empty_like(x) if mask[0] else x.new_empty(0)
    flat = token is not None
    gw = weight.new_empty(weight.shape) if mask[1] and not flat else weight.new_empty(0)  # the parameter's layout
    out_features = exact.kernel_weight(handles.lookup(layer, torch.nn.Module, "layer"), weight).shape[0]  # HF Conv1D: [in, out]
    gb = weight.new_empty(out_features) if mask[2] and not flat else weight.new_empty(0)
    gtoken = token.new_empty(()) if flat else weight.new_empty(0)
    return gx, gw, gb, gtoken


def _forward_setup(ctx, inputs, output):
    x, weight, bias, token, layer, stride, padding, dilation, groups = inputs
    ctx.save_for_backward(x, weight, token, output[1])
    ctx.args = (layer, stride, padding, dilation, groups)
    ctx.flat = token is not None
    ctx.has_bias = bias is not None


def _forward_backward(ctx, grad_out, _grad_version):
    x, weight, token, version = ctx.saved_tensors
    layer, stride, padding, dilation, groups = ctx.args
    need = ctx.needs_input_grad
    mask = [need[0], need[1], need[2] and ctx.has_bias]
    gx, gw, gb, gtoken = exact_backward(grad_out, x, weight, token, version, layer, mask, stride, padding, dilation,
                                        groups)
    return (gx if mask[0] else None, gw if mask[1] and not ctx.flat else None,
            gb if mask[2] and not ctx.flat else None, gtoken if ctx.flat else None,
            None, None, None, None, None)


exact_forward.register_autograd(_forward_backward, setup_context=_forward_setup)


def exact_layer(x, layer, geometry=None):
    """The compiled counterpart of :func:`bpclip_fast.exact.exact_layer`."""
    _refuse_recomputation()
    weight, bias = layer.weight, layer.bias
    needs = torch.is_grad_enabled() and any(exact._trainable(layer))
    token = None
    if layer._bp_clipping == "flat" and needs:
        token = _flat_token(layer)
        weight, bias = weight.detach(), bias.detach() if bias is not None else None
    stride, padding, dilation, groups = geometry if geometry is not None else (None, None, None, 1)
    return exact_forward(x, weight, bias, token, layer._bp_handle, stride, padding, dilation, groups)[0]


# ------------------------------------------------------------------------------ flat: collector and release

def _book(serial: int, layers=None) -> "exact._Book":
    book = _BOOKS.get(serial)
    if book is None and serial in _RELEASED and layers:
        # Eager flat refuses a second pass over a retained graph by its row count ('rows'); here the
        # book is gone with its release, so the same refusal is made by name.
        exact._refuse_release(layers, "a second backward pass reached a compiled flat forward whose release was "
                              "already made (backward(retain_graph=True) run twice)", "run one backward per forward")
    if book is None:
        details = ("a compiled flat backward reached a forward whose book is gone (more than "
                   f"{_MAX_BOOKS} compiled forwards ran without their backward, or a saved_tensors_hooks unpack "
                   "changed its token)")
        instead = "run the backward of each forward, or the forward under torch.no_grad(), and unpack what was packed"
        if layers:  # refused through the layers' step, as every other refusal of a backward
            exact._refuse_release(layers, details, instead)
        raise RuntimeError(f"bpclip_fast.compiled: {details}; {instead}")
    return book


def _serial(value: float, layers) -> int:
    """A token's value as a book serial: a whole number ``>= 0`` (flat_collect writes serials below
    2^53, exact in float64); anything else was written by an unpack hook, refused before ``int()``."""
    if not (math.isfinite(value) and value >= 0 and value == math.floor(value)):
        exact._refuse_release(layers, f"a compiled flat token holds {value!r}, not a book's serial (a "
                              "saved_tensors_hooks unpack changed it)", "unpack what was packed")
    return int(value)


def _layer_book(token, lay):
    """The book a flat layer's backward op adds its entry to: the one its saved token names (``None``
    for a layer that is not flat), refused unless the layer is one of that book's."""
    if token is None:
        return None
    book = _book(_serial(token.item(), [lay]), [lay])
    if not any(m is lay for m in book.group.layers):
        # The serial is data (a saved token): one changed by an unpack hook can name another group's book.
        exact._refuse_release([lay], "a compiled flat layer's backward received a token naming a forward of "
                              "another model's flat clipping (a saved_tensors_hooks unpack changed it)",
                              "unpack what was packed")
    return book


@torch.library.custom_op("bpclip_fast_compiled::flat_collect", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def flat_collect(params: list[torch.Tensor], group: int) -> torch.Tensor:
    """A new book of ``group`` for this forward; one token per flat layer whose value is its serial."""
    grp = handles.lookup(group, exact.FlatClipping, "flat clipping")
    book = exact._Book(grp, ())
    # the parameters themselves, by position: the backward's ``params`` are what the graph saved, and
    # an unpack (save_on_cpu) returns copies, which no release is keyed by (an IndexError, review 18)
    book.compiled_params = list(params)
    _BOOKS[book.serial] = book
    while len(_BOOKS) > _MAX_BOOKS:
        _BOOKS.popitem(last=False)
    return torch.full((len(grp.layers),), float(book.serial), dtype=torch.float64)


@flat_collect.register_fake
def _(params, group):
    n = len(handles.lookup(group, exact.FlatClipping, "flat clipping").layers)
    return torch.empty(n, dtype=torch.float64, device="cpu")


def _lands_nowhere(token, lay) -> bool:
    """Whether a flat layer's backward op runs in a pass that lands on no layer of its group."""
    return token is not None and getattr(lay, "_bp_flat", None) is not None and not _lands_on_group(lay._bp_flat)


# The last pass's answer per flat group (by handle): every layer's backward op and the release ask it,
# and a pass's answer does not change within the pass.
_GROUP_LANDS: dict = {}


def _lands_on_group(grp) -> bool:
    """Whether this backward pass accumulates into some layer of flat group ``grp`` (True where its
    layers are not an engine's: nothing to ask). A pass that lands on none (``torch.autograd.grad`` of
    the input, ``backward(inputs=[x])``), before or after the training backward, still runs the
    compiled backward, one node that computes every gradient, where eager's collector does not run;
    its release consumed the book, and the training pass was refused as a second release and charged
    (review 28, S2). A pass that lands on some layers only (a backward split by layer groups) releases
    as before, and the later pass is refused by the book's serial."""
    task = torch._C._current_graph_task_id()
    known = _GROUP_LANDS.get(grp.handle)
    if known is not None and known[0] == task:
        return known[1]
    steps = [layer._bp_step for layer in grp.layers if layer._bp_step is not None]
    lands = not steps or any(st.lands_now() for st in steps)
    _GROUP_LANDS[grp.handle] = (task, lands)
    return lands


@torch.library.custom_op("bpclip_fast_compiled::flat_release", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
@autocast_off  # as the eager backward (bpclip_fast.amp)
def flat_release(token_grad: torch.Tensor, tokens: torch.Tensor, params: list[torch.Tensor],
                 group: int) -> list[torch.Tensor]:
    """``FlatClipping.release`` at run time: the clipped, noised gradients of ``params``."""
    grp = handles.lookup(group, exact.FlatClipping, "flat clipping")
    if not _lands_on_group(grp):
        # Nothing is drawn or released; what is returned lands nowhere (a capture by
        # torch.autograd.grad of a parameter is refused by the parameter's tensor hook).
        return [torch.zeros_like(p) for p in params]
    serials = {_serial(v, grp.layers) for v in tokens.tolist()}
    if len(serials) != 1:  # one forward's tokens all carry its book's serial (flat_collect)
        exact._refuse_release(grp.layers, "a compiled flat release received tokens of several forwards (a "
                              "saved_tensors_hooks unpack changed them)", "unpack what was packed")
    book = _book(serials.pop(), grp.layers)
    if book.group is not grp:  # checked before the book is consumed: it is another model's, still open
        exact._refuse_release(grp.layers, "a compiled flat release received tokens naming a forward of another "
                              "model's flat clipping (a saved_tensors_hooks unpack changed them)",
                              "unpack what was packed")
    task = torch._C._current_graph_task_id()
    if not any(e.task == task for e in book.entries):
        # The release runs after the layers' backward ops (it consumes their token gradients), so an
        # honest one finds their entries; tokens naming an older open book of this model find none.
        exact._refuse_release(grp.layers, "a compiled flat release received tokens naming a forward whose book has "
                              "no entry of this pass: no layer of that forward ran its backward in this pass (a "
                              "saved_tensors_hooks unpack changed them)", "unpack what was packed")
    del _BOOKS[book.serial]
    _RELEASED[book.serial] = None
    while len(_RELEASED) > _MAX_BOOKS:
        _RELEASED.popitem(last=False)
    own = book.compiled_params
    if len(own) != len(params) or any(o.shape != p.shape for o, p in zip(own, params)):
        raise RuntimeError("bpclip_fast.compiled: a flat release received other parameters than its forward "
                           "collected (a saved_tensors_hooks unpack changed them); unpack what was packed")
    params = own
    grads = grp.release(book)
    missing = [p for p in params if id(p) not in grads]
    if missing:
        # A traced graph returns a tensor for every parameter; eager flat returns None for a layer
        # whose output never reached the loss. Zeros would land as a gradient without a draw.
        names = [layer.layer_name for layer in grp.layers
                 if any(q is p for p in missing for q in (layer.weight, layer.bias))]
        exact._refuse_release([layer for layer in grp.layers if layer.layer_name in names] or grp.layers,
                              "under torch.compile every flat layer's output must reach the loss (no gradient "
                              "can be left out of a compiled backward)", "run that layer eagerly or freeze it")
    _seal(*grp.layers)
    return [grads[id(p)] for p in params]


@flat_release.register_fake
def _(token_grad, tokens, params, group):
    return [torch.empty_like(p) for p in params]


def _collect_setup(ctx, inputs, output):
    params, group = inputs
    ctx.save_for_backward(output, *params)
    ctx.group = group


def _collect_backward(ctx, token_grad):
    tokens, *params = ctx.saved_tensors
    return flat_release(token_grad, tokens, params, ctx.group), None


flat_collect.register_autograd(_collect_backward, setup_context=_collect_setup)


class CompiledBook:
    """What ``FlatClipping``'s stack holds for a compiled forward: the collector's tokens."""

    def __init__(self, tokens):
        self.tokens = tokens


def begin_flat(group, params) -> CompiledBook:
    _refuse_recomputation()
    return CompiledBook(flat_collect(params, group.handle))


def _flat_token(layer):
    group = layer._bp_flat
    book = group.current() if group is not None else None
    if not isinstance(book, CompiledBook):
        exact._flat_book(layer)  # its refusal (no book: the layer ran outside its model's forward)
        raise RuntimeError(f"{layer.layer_name}: a flat layer traced by torch.compile inside a forward that was not "
                           "(the model's forward pre-hook ran eagerly); compile the whole model")
    return book.tokens[layer._bp_flat_position]


# ------------------------------------------------------------------------------ layers with instantiated
# per-example gradients (LayerNorm, GroupNorm, Embedding, PositionalEmbedding, ClassToken)
# The layer's own forward (parameters detached) is traced as plain ops, so autograd takes the input
# gradient from the unclipped upstream gradient; the tap op passes the output on and its backward op
# clips the parameters' gradients (``exact_examples._Tap``). An op may not return an alias of its input, so the
# tap copies the output: one copy per layer, the price of an opaque node on this path.

@torch.library.custom_op("bpclip_fast_compiled::example_tap", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def example_tap(out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, token: torch.Tensor | None,
                saved: list[torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, version)``: a copy of the layer's output and the bounds' version of this forward."""
    lay = handles.lookup(layer, torch.nn.Module, "layer")
    version = _forward_meta(lay, [lay._bp_bounds_version], torch.int64)
    return out.clone(), version


@example_tap.register_fake
def _(out, weight, bias, token, saved, layer):
    return torch.empty_like(out), torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.custom_op("bpclip_fast_compiled::example_backward", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
@autocast_off  # as the eager backward (bpclip_fast.amp)
def example_backward(grad_out: torch.Tensor, weight: torch.Tensor, saved: list[torch.Tensor],
                     token: torch.Tensor | None, version: torch.Tensor, layer: int,
                     mask: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(∇W, ∇b, ∇token)`` — ``exact_examples._Tap.backward`` at run time; empty tensors where not returned."""
    lay = handles.lookup(layer, torch.nn.Module, "layer")
    bounds_version, origin = version.tolist()
    lay._bp_check_forward(_ForwardMark(version, origin), bounds_version)

    def none():
        return weight.new_empty(0)

    if _lands_nowhere(token, lay):
        return none(), none(), token.new_zeros(())  # as exact_backward: no entry in a pass that lands nowhere
    book = _layer_book(token, lay)
    pmask = exact._trainable(lay) if book is not None else list(mask)
    gtoken = token.new_zeros(()) if token is not None else none()
    if not any(pmask):
        return none(), none(), gtoken
    g = grad_out.contiguous()
    if book is not None:  # the book may hold these until the release (see exact_backward)
        g, saved = g.clone(), [t.clone() for t in saved]
    step_args = exact._step_args(lay, g.shape[0], lay._bp_noise_bound, book)
    examples = lay._examples(tuple(saved), g, pmask)
    bound = exact_examples.example_bound(lay, examples, pmask, book)
    out = exact._clip(lay, book, bound, (None, None), examples, step_args, exact.EXAMPLES, grad_out.dtype)
    if out is None:
        return none(), none(), gtoken
    _seal(lay)
    gw, gb = out
    return (gw if gw is not None else none()), (gb if gb is not None else none()), gtoken


@example_backward.register_fake
def _(grad_out, weight, saved, token, version, layer, mask):
    flat = token is not None
    gw = weight.new_empty(weight.shape) if mask[0] and not flat else weight.new_empty(0)
    gb = weight.new_empty(weight.shape) if mask[1] and not flat else weight.new_empty(0)
    return gw, gb, (token.new_empty(()) if flat else weight.new_empty(0))


def _tap_setup(ctx, inputs, output):
    out, weight, bias, token, saved, layer = inputs
    ctx.save_for_backward(weight, token, output[1], *saved)
    ctx.layer, ctx.flat, ctx.has_bias = layer, token is not None, bias is not None


def _tap_backward(ctx, grad_out, _grad_version):
    weight, token, version, *saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [need[1], need[2] and ctx.has_bias]
    gw, gb, gtoken = example_backward(grad_out, weight, saved, token, version, ctx.layer, mask)
    return (grad_out, gw if mask[0] and not ctx.flat else None, gb if mask[1] and not ctx.flat else None,
            gtoken if ctx.flat else None, [None] * len(saved), None)


example_tap.register_autograd(_tap_backward, setup_context=_tap_setup)


def example_layer(layer, x):
    """The compiled counterpart of :func:`bpclip_fast.exact_examples.example_layer`."""
    _refuse_recomputation()
    needs = torch.is_grad_enabled() and any(exact._trainable(layer))
    weight, bias = layer.weight, layer.bias
    detached = (weight.detach(), bias.detach() if bias is not None else None)
    if not needs:
        return layer._forward(x, *detached, False)[0]
    token = _flat_token(layer) if layer._bp_clipping == "flat" else None
    if token is not None:
        weight, bias = detached
    out, saved = layer._forward(x, *detached, True)
    return example_tap(out, weight, bias, token, list(saved), layer._bp_handle)[0]
