"""The sensitivity audit: each example's exact contribution to the release, against the declared bound.

``sensitivity(model, (x, y), engine=engine)`` measures, through the model's own clipped layers and
kernels with the noise off, how far each example of a batch moves each clipped layer's released
gradient, and compares it with the bound the noise is scaled to (DESIGN.md §5): backprop, each
layer's ``Δ_l = layer.sensitivity``; per_layer, each layer's ``C_l = layer.max_grad_norm`` and the
whole ``C = layer.noise_bound = (Σ_l C_l²)^½``; flat, one ``C = layer.noise_bound`` for the
concatenation of all layers. With ``adversarial_steps > 0`` it also searches for inputs that push
one example's contribution up.

Why removal
-----------
The accountant assumes add/remove neighbours: the release of a step is ``R(S) + N(0, σ²Δ²)`` and
the sensitivity is ``sup ‖R(S) − R(S∖{i})‖`` over batches ``S`` and members ``i``. The audit
computes exactly that difference, ``R(S) − R(S∖{i})`` for every ``i`` (B + 1 backward passes, each
the release of its batch: the sum of the clipped layers' parameter gradients, noise off), and the
contribution ``R(S ∪ {z}) − R(S)`` of each adversarial input ``z``. Nothing is assumed about how the
layers compute: an example that moved another example's clipped gradient (a batch-dependent clip,
batch statistics, a loss that is not a sum of per-example terms) shows up in the difference as it
would in the released gradient.

Units
-----
Under ``loss_reduction="sum"`` the release is ``Σ_i c_i + N(0, σ²Δ²)``: the difference is in the
units of Δ. Under ``"mean"`` the engine's layers compute ``(1/B̄)(Σ_i c_i + N(0, σ²Δ²))`` (the
proof in :mod:`bpclip_fast.engine`): the copy's layers get the engine's own step state,
``boundary.LayerStep(enforce=False, mean_loss_batch=B̄)`` with no key armed, so ``begin_backward``
draws no noise but clips at ``C/d`` with the backward's own ``d`` and scales by ``d/B̄``, exactly as
in training; the difference is then multiplied by ``B̄``, the factor between the noise std in the
release (``σΔ/B̄``) and ``σΔ``. Either way a ratio ``‖contribution‖/Δ`` above 1 means the noise is
too small for that example.

Arithmetic and tolerance
------------------------
The audit runs on a deep copy of the model (clipped layers drop their engine step when copied; the
engine's forward pre-hook pickles as a no-op; flat clipping's book-keeping is copied with the
model and checked to belong to the copy), cast to float64 by default, in eval mode (dropout's
random masks would otherwise differ between the B + 1 passes; no clipped layer depends on the
mode). The kernels are the same as in training, in double. Each coordinate of a release is a sum
of at most ``N = (B + 1)·T`` products (``T``: the most positions one example has at a clipped
layer, its output size over its channels); with unit roundoff ``u`` its error is at most
``γ_N ≈ N·u`` times the sum of the absolute terms, which the triangle inequalities of the bounds
keep within ``(B + 1)·Δ`` (up to the cancellation inside one example's gradient, and the
``O(depth·u)`` relative error of each example's own activations). The difference of two releases
therefore errs by at most about ``2·N·(B + 1)·u·Δ``; the audit uses
``tol = max(1e-9, 64·N·(B + 1)·u)`` (a factor 32 of margin for depth and cancellation): about
``1e-9`` in float64 for the models here, so a ratio ``≤ 1 + tol`` is an honest pass. The report
also gives the rounding actually observed (the release of the batch minus that of the same batch
in reverse order, in bound units). In float32 (``dtype=None`` on a float32 model) the same formula
gives a tolerance near 1: only gross violations are resolved.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import nn

from .. import nn as bnn, registry
from ..boundary import LayerStep

__all__ = ["sensitivity", "SensitivityReport", "SensitivityRow"]

_CAP = math.log(4.0)  # the surrogate stops pushing a quantity once it is 4x its bound


@dataclass
class SensitivityRow:
    """One checked unit (a layer, or all layers together), in units of its bound."""

    name: str
    bound: float            # the declared bound the noise is scaled to (Δ_l, C_l or C)
    symbol: str             # "Δ", "C_l" or "C"
    largest: float          # the largest contribution norm over the batch
    ratio: float            # largest / bound
    examples: list          # batch indices attaining the largest (within tol)
    saturated: int          # examples whose contribution is at the bound (within tol)
    status: str             # "ok", "exceeded", "info" (not checked: flat's per-layer rows), "frozen"
    adversarial: float | None = None  # the best ratio the adversarial search found
    adversarial_from: str | None = None

    @property
    def checked(self) -> bool:
        return self.status in ("ok", "exceeded")


@dataclass
class SensitivityReport:
    """What :func:`sensitivity` found; ``.ok``, ``.line()``, ``.to_dict()``."""

    mode: str
    examples: int
    loss_reduction: str
    mean_batch_size: float | None
    dtype: str
    tol: float
    rounding: float           # the largest observed rounding of a release, in bound units
    rows: list
    adversarial: dict
    notes: list
    seconds: float
    contributions: dict = field(default=None, repr=False)  # keep_contributions: {unit: [B, P] tensor}

    @property
    def ok(self) -> bool:
        return all(r.status != "exceeded" for r in self.rows)

    def line(self) -> str:
        head = f"sensitivity: {self.mode}, {self.examples} examples"
        checked = [r for r in self.rows if r.checked]
        if not checked:
            return f"{head}, no trainable clipped layer; OK"
        top = max(checked, key=lambda r: r.ratio)
        where = "" if top.name == "flat" else "total, " if top.name == "total" else f"layer {top.name}, "
        at = ", ".join(map(str, top.examples[:3])) + (", ..." if len(top.examples) > 3 else "")
        text = (f"{head}, largest contribution {top.ratio:.5f} of {top.symbol}={top.bound:.4g} "
                f"({where}example{'s' if len(top.examples) > 1 else ''} {at})")
        if "skipped" in self.adversarial:
            text += f", adversarial skipped ({self.adversarial['skipped']})"
        elif self.adversarial:
            text += f", adversarial {self.adversarial['best']:.4f}"
        bad = [r.name for r in checked if r.status == "exceeded"]
        return text + (f"; EXCEEDED ({', '.join(bad)})" if bad else "; OK")

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("rows", "contributions")}
        out["rows"] = [asdict(r) for r in self.rows]
        out["ok"] = self.ok
        out["line"] = self.line()
        return out


# ------------------------------------------------------------------------------ arguments


def _unwrap(model):
    if not isinstance(model, nn.Module):
        raise TypeError(f"sensitivity: model must be a torch.nn.Module, got {type(model).__name__}")
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _check_layers(inner, engine):
    layers = bnn.clipped_layers(inner)
    if not layers:
        raise ValueError("sensitivity: model has no bpclip_fast clipped layer; pass the model returned by "
                         "PrivacyEngine.make_private (or one converted with bpclip_fast.nn.convert_model)")
    modes = {layer.clipping for _, layer in layers}
    if len(modes) > 1:
        raise ValueError(f"sensitivity: model mixes clipping modes {sorted(modes)}; one model is private in one mode")
    if engine is not None:
        if not getattr(engine, "_made_private", False):
            raise ValueError("sensitivity: engine has not made a model private (call make_private first)")
        if {id(m) for _, m in layers} != {id(m) for m in engine._layers}:
            raise ValueError("sensitivity: engine is not the PrivacyEngine of model (their clipped layers differ)")
    return layers, modes.pop()


def _reduction(engine, loss_reduction, mean_batch_size):
    if engine is not None:
        if loss_reduction not in (None, engine.loss_reduction):
            raise ValueError(f"sensitivity: loss_reduction={loss_reduction!r}, but engine was made private with "
                             f"loss_reduction={engine.loss_reduction!r}")
        loss_reduction = engine.loss_reduction
        if loss_reduction == "mean":
            mean_batch_size = float(engine.expected_batch_size)
    loss_reduction = loss_reduction or "sum"
    if loss_reduction not in ("sum", "mean"):
        raise ValueError(f"sensitivity: loss_reduction must be 'sum' or 'mean', got {loss_reduction!r}")
    if loss_reduction == "mean" and not (mean_batch_size and mean_batch_size > 0):
        raise ValueError("sensitivity: loss_reduction='mean' without engine needs mean_batch_size (the B̄ the "
                         "layers scale by)")
    return loss_reduction, (float(mean_batch_size) if loss_reduction == "mean" else None)


def _check_batch(batch):
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError("sensitivity: batch must be a pair (inputs, targets), got "
                        f"{type(batch).__name__}{'' if not hasattr(batch, '__len__') else f' of length {len(batch)}'}")
    x, y = batch
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        raise TypeError(f"sensitivity: batch must hold two tensors (inputs, targets), got ({type(x).__name__}, "
                        f"{type(y).__name__})")
    if x.dim() < 1 or y.dim() < 1 or x.shape[0] != y.shape[0] or x.shape[0] < 1:
        raise ValueError(f"sensitivity: batch's inputs {tuple(x.shape)} and targets {tuple(y.shape)} must share a "
                         "first (example) dimension of size >= 1")
    return x, y


def _copy(inner, name="model"):
    try:
        return copy.deepcopy(inner)
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"sensitivity: {name} cannot be copied ({exc}); it holds state of a forward or backward "
                           "in progress (a graph tensor kept on a module). Audit it between training steps, after "
                           "optimizer.step() or zero_grad()") from exc


# ------------------------------------------------------------------------------ the release, noise off


class NoiseFree:
    """A float64 (or ``dtype``) copy of a private model whose releases are measured, noise off (module
    docstring: arithmetic and units). Also the empirical audit's measure of its canaries."""

    def __init__(self, inner, mode, reduction, mean_batch, loss_fn, dtype):
        self.model = _copy(inner)
        if dtype is not None:
            self.model.to(dtype)
        self.model.eval()
        self.layers = [layer for _, layer in bnn.clipped_layers(self.model)]
        self.names = [name for name, _ in bnn.clipped_layers(inner)]
        self.mode, self.loss_fn = mode, loss_fn
        self.unit = mean_batch or 1.0  # release -> bound units
        for name, layer in zip(self.names, self.layers):
            layer.noise_multiplier = 0.0
            layer._step = LayerStep(layer, name, enforce=False, mean_loss_batch=mean_batch)  # key None: no draw
        for p in self.model.parameters():
            p.grad = None
        if mode == "flat":
            self._check_flat()
        self._positions = positions = [1]

        def record(module, args, out):  # a closure, not a bound method: copies of the model stay apart
            if isinstance(out, torch.Tensor) and out.dim() > 1 and out.shape[0] > 0:
                features = out.shape[1] if isinstance(module, (nn.Conv2d, nn.GroupNorm)) else out.shape[-1]
                positions[0] = max(positions[0], out[0].numel() // max(features, 1))

        for layer in self.layers:
            layer.register_forward_hook(record)

    def _check_flat(self):
        groups = {id(layer._flat): layer._flat for layer in self.layers if layer._flat is not None}
        mine = {id(m) for m in self.layers}
        hooked = {id(getattr(h, "__self__", None)) for m in self.model.modules() for h in m._forward_pre_hooks.values()}
        if (len(groups) != 1 or any(layer._flat is None for layer in self.layers)
                or any(id(m) not in mine for g in groups.values() for m in g.layers) or set(groups) - hooked):
            raise RuntimeError("sensitivity: flat clipping's book-keeping did not survive the copy of model (its "
                               "layers would clip without the other layers' norms); audit a model made private "
                               "as a whole by PrivacyEngine.make_private or convert_model")

    @property
    def positions(self) -> int:
        """An upper bound on the positions one example adds to a gradient coordinate (module docstring)."""
        return self._positions[0]

    def trainable(self, layer):
        return [p for p in (layer.weight, layer.bias) if p is not None and p.requires_grad]

    def release(self, x, y):
        """Per layer, the flattened ``[∇W, ∇b]`` of the batch ``(x, y)`` (noise off), in bound units."""
        for p in self.model.parameters():
            p.grad = None
        if x.shape[0] > 0:
            loss = self.loss_fn(self.model(x), y)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise ValueError(f"sensitivity: loss_fn must return a scalar tensor, got "
                                 f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
            loss.backward()
        out = []
        for layer in self.layers:
            parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.trainable(layer)]
            out.append(torch.cat(parts).detach() * self.unit if parts else None)
        for p in self.model.parameters():
            p.grad = None
        return out


def _units(audit, mode):
    """``(name, layer indices, bound, symbol, checked)`` of every unit, from the layers themselves."""
    layers, names = audit.layers, audit.names
    live = [k for k, layer in enumerate(layers) if audit.trainable(layer)]
    units = []
    if mode == "backprop":
        for k, layer in enumerate(layers):
            units.append((names[k], [k], _delta(layer, audit), "Δ", True))
        return units
    noise = {layer.noise_bound for layer in layers}
    if len(noise) > 1:
        raise ValueError(f"sensitivity: the layers of model scale their noise to different C {sorted(noise)}")
    c = noise.pop()
    if mode == "flat":
        units.append(("flat", live, c, "C", True))
        units += [(names[k], [k], c, "C", False) for k in range(len(layers))]
    else:
        units += [(names[k], [k], layers[k].max_grad_norm, "C_l", True) for k in range(len(layers))]
        units.append(("total", live, c, "C", True))
    return units


def _delta(layer, audit):
    try:
        return float(layer.sensitivity)
    except RuntimeError:  # a shape-dependent Δ never fixed: the noise follows the batch's shape
        return float(layer.sensitivity_for(tuple(audit.shapes[id(layer)])))


def _norms(units, full, other):
    """``[unit] -> ‖full − other‖`` over each unit's layers."""
    sq = [None if f is None else (f - o).square().sum() for f, o in zip(full, other)]
    return [math.sqrt(float(sum((sq[k] for k in ks if sq[k] is not None), 0.0))) for _, ks, *_ in units]


# ------------------------------------------------------------------------------ the audit


def sensitivity(model: nn.Module, batch, loss_fn=None, *, engine=None, loss_reduction: str | None = None,
                mean_batch_size: float | None = None, adversarial_steps: int = 0, starts: int = 2,
                scales=(10.0, 100.0), step_size: float = 0.5, dtype=torch.float64,
                keep_contributions: bool = False) -> SensitivityReport:
    """Audits each example's contribution to the release of ``model`` on ``batch`` (module docstring).

    ``model``: made private by :class:`bpclip_fast.PrivacyEngine` (possibly DDP-wrapped), or any
    module whose trainable layers are clipped layers; it and ``engine`` are not changed (the audit
    runs on a copy: no gradient, step state, noise draw or accountant charge). ``engine``: gives the
    loss reduction and ``B̄``; without it ``loss_reduction`` (default ``"sum"``) and, for ``"mean"``,
    ``mean_batch_size``. ``batch``: ``(inputs, targets)``. ``loss_fn(outputs, targets)``: the
    training criterion (default cross-entropy with the reduction in use).
    ``adversarial_steps``: gradient-ascent steps on the input of one example from each start: the
    ``starts`` examples of largest ratio and their copies scaled by ``scales``; the direction comes
    from a plain-torch surrogate of the model, every iterate is evaluated through the real layers.
    ``dtype``: of the copy (float64 default; ``None`` keeps the model's). ``keep_contributions``:
    also return every contribution vector, ``report.contributions[unit name]`` (``[B, P]``).
    """
    start = time.perf_counter()
    inner = _unwrap(model)
    _, mode = _check_layers(inner, engine)
    reduction, mean_batch = _reduction(engine, loss_reduction, mean_batch_size)
    x, y = _check_batch(batch)
    if loss_fn is None:
        loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    elif not callable(loss_fn):
        raise TypeError(f"sensitivity: loss_fn must be callable, got {type(loss_fn).__name__}")
    if int(adversarial_steps) < 0:
        raise ValueError(f"sensitivity: adversarial_steps must be >= 0, got {adversarial_steps}")
    audit = NoiseFree(inner, mode, reduction, mean_batch, loss_fn, dtype)
    p0 = audit.layers[0].weight
    x = x.to(p0.device, p0.dtype) if x.is_floating_point() else x.to(p0.device)
    y = y.to(p0.device)
    audit.shapes = {}

    def shape(module, args):  # each layer's input shape: the Δ of a layer whose Δ was never fixed
        audit.shapes.setdefault(id(module), tuple(args[0].shape))

    hooks = [m.register_forward_pre_hook(shape) for m in audit.layers]
    full = audit.release(x, y)
    for h in hooks:
        h.remove()
    units = _units(audit, mode)
    b = x.shape[0]
    rev = audit.release(x.flip(0), y.flip(0))
    rounding = max((n / u[2] for n, u in zip(_norms(units, full, rev), units)), default=0.0)
    u_round = torch.finfo(p0.dtype).eps / 2
    tol = max(1e-9, 64 * (b + 1) * audit.positions * (b + 1) * u_round)
    norms = torch.zeros(len(units), b, dtype=torch.float64)
    kept = {name: [] for name, *_ in units} if keep_contributions else None
    keep = torch.ones(b, dtype=torch.bool, device=x.device)
    for i in range(b):
        keep[i] = False
        other = audit.release(x[keep], y[keep]) if b > 1 else [None if f is None else torch.zeros_like(f) for f in full]
        keep[i] = True
        norms[:, i] = torch.tensor(_norms(units, full, other), dtype=torch.float64)
        if kept is not None:
            for name, ks, *_ in units:
                parts = [full[k] - other[k] for k in ks if full[k] is not None]
                kept[name].append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64))
    rows = []
    for u, (name, ks, bound, symbol, checked) in enumerate(units):
        frozen = all(full[k] is None for k in ks)
        ratios = norms[u] / bound
        top = float(ratios.max())
        rows.append(SensitivityRow(
            name=name, bound=float(bound), symbol=symbol, largest=float(norms[u].max()), ratio=top,
            examples=[int(i) for i in torch.nonzero(ratios >= top - tol).reshape(-1)] if not frozen else [],
            saturated=int(((ratios - 1).abs() <= tol).sum()),
            status="frozen" if frozen else ("exceeded" if top > 1 + tol else "ok") if checked else "info"))
    notes = ["the copy ran in eval mode (dropout off); clipping does not depend on the mode"]
    if mode == "flat" and audit.layers[0]._flat.max_grad_norm != units[0][2]:
        notes.append(f"flat clipping clips at {audit.layers[0]._flat.max_grad_norm:g}, the noise is scaled to "
                     f"{units[0][2]:g}")
    adversarial = {}
    if adversarial_steps:
        adversarial = _adversarial(audit, units, rows, norms, full, x, y, int(adversarial_steps), int(starts),
                                   tuple(scales), float(step_size), tol)
    return SensitivityReport(
        mode=mode, examples=b, loss_reduction=reduction, mean_batch_size=mean_batch, dtype=str(p0.dtype),
        tol=tol, rounding=rounding, rows=rows, adversarial=adversarial, notes=notes,
        seconds=time.perf_counter() - start,
        contributions={k: torch.stack(v) for k, v in kept.items()} if kept is not None else None)


# ------------------------------------------------------------------------------ adversarial search


class _Plain(nn.Module):
    """A clipped layer computed as its torch type (``registry.LayerType.plain``), double-differentiable;
    records its input and output for the surrogate."""

    def __init__(self, layer, log):
        super().__init__()
        self._layer, self._log = [layer], log
        self.weight, self.bias = layer.weight, layer.bias

    def forward(self, x):
        layer = self._layer[0]
        out = registry.layer_type(layer).plain(layer, x, {"weight": self.weight, "bias": self.bias})
        self._log.append((layer, x, out))
        return out


class _Surrogate:
    """The ascent direction: a plain-torch copy of the audited copy (no clipping), and an objective
    that grows with what saturates each checked unit: backprop, each layer's input norm over ``C_x``
    and upstream-gradient norm over ``C_g``; exact modes, each unit's per-example gradient norm over
    its bound (each term capped at ``log 4``: a saturated quantity stops pulling)."""

    def __init__(self, audit, units):
        self.model = copy.deepcopy(audit.model)
        self.log = []
        layers = [layer for _, layer in bnn.clipped_layers(self.model)]
        if layers and layers[0]._flat is not None:
            layers[0]._flat.remove()
        plain = {id(layer): _Plain(layer, self.log) for layer in layers}
        for parent in list(self.model.modules()):
            for child_name, child in list(parent.named_children()):
                if id(child) in plain:
                    setattr(parent, child_name, plain[id(child)])
        if id(self.model) in plain:
            self.model = plain[id(self.model)]
        self.layers, self.units, self.mode, self.loss_fn = layers, units, audit.mode, audit.loss_fn

    def direction(self, z, yi):
        z = z.detach().clone().requires_grad_(True)
        self.log.clear()
        with torch.enable_grad():
            loss = self.loss_fn(self.model(z.unsqueeze(0)), yi.unsqueeze(0))
            terms = self._terms(loss)
            if not terms:
                return None
            (grad,) = torch.autograd.grad(torch.stack(terms).sum(), z, allow_unused=True)
        return grad

    def _terms(self, loss):
        def log_ratio(sq, bound):
            return torch.clamp(0.5 * torch.log(sq + 1e-300) - math.log(bound), max=_CAP)

        seen = [(layer, x, out) for layer, x, out in self.log if out.requires_grad]
        if self.mode == "backprop":
            gs = torch.autograd.grad(loss, [out for *_, out in seen], create_graph=True, allow_unused=True)
            terms = []
            for (layer, x, _), g in zip(seen, gs):
                if g is None or not any(p.requires_grad for p in (layer.weight, layer.bias) if p is not None):
                    continue
                g_sq = (g.abs().sum((2, 3)).square().sum() if getattr(layer, "norm", "l2") == "l15" and g.dim() == 4
                        else g.square().sum())
                terms += [log_ratio(g_sq, layer.grad_clip)]
                if x.is_floating_point():
                    terms += [log_ratio(x.square().sum(), layer.input_clip)]
            return terms
        params = {id(layer): [p for p in (layer.weight, layer.bias) if p is not None and p.requires_grad]
                  for layer in self.layers}
        flat = [p for layer in self.layers for p in params[id(layer)]]
        grads = dict(zip(map(id, flat), torch.autograd.grad(loss, flat, create_graph=True, allow_unused=True)))
        sq = [sum((grads[id(p)].square().sum() for p in params[id(layer)] if grads[id(p)] is not None),
                  loss.new_zeros(())) for layer in self.layers]
        return [log_ratio(sum(sq[k] for k in ks), bound)
                for _, ks, bound, _, checked in self.units if checked and ks]


def _adversarial(audit, units, rows, norms, full, x, y, steps, starts, scales, step_size, tol):
    """Gradient ascent on one example's input; every iterate's contribution ``R(S ∪ {z}) − R(S)``
    (the add neighbour) is measured through the real layers. A step moves ``z`` by ``step_size``
    times ``max(‖z‖, median input norm)`` along the surrogate's gradient; a start ends after
    ``steps`` steps or when the surrogate has no direction left (every quantity at 4x its bound:
    saturated). Updates ``rows`` in place."""
    if not x.is_floating_point():
        return {"skipped": f"integer inputs ({x.dtype}, e.g. token ids) cannot be moved by gradient ascent"}
    surrogate = _Surrogate(audit, units)
    checked = [u for u, unit in enumerate(units) if unit[4] and rows[u].status != "frozen"]
    if not checked:
        return {"skipped": "no trainable clipped layer"}
    bounds = torch.tensor([units[u][2] for u in checked], dtype=torch.float64)
    per_example = (norms[checked] / bounds.unsqueeze(1)).max(0).values
    order = torch.argsort(per_example, descending=True)[:max(starts, 1)].tolist()
    ref = float(x.reshape(x.shape[0], -1).norm(dim=1).median()) or 1.0
    best = {u: (0.0, None) for u in checked}
    evaluations = 0
    for i in order:
        for scale in (1.0, *scales):
            z, label = x[i] * scale, f"example {i}" + (f" x{scale:g}" if scale != 1.0 else "")
            for k in range(steps + 1):
                added = audit.release(torch.cat([x, z.unsqueeze(0)]), torch.cat([y, y[i:i + 1]]))
                evaluations += 1
                values = _norms(units, added, full)
                for u in checked:
                    r = values[u] / units[u][2]
                    if r > best[u][0]:
                        best[u] = (r, f"{label}, step {k}")
                if k == steps:
                    break
                g = surrogate.direction(z, y[i])
                if g is None or not bool(torch.isfinite(g).all()) or float(g.norm()) == 0.0:
                    break
                z = (z + step_size * max(float(z.norm()), ref) * g / g.norm()).detach()
    for u in checked:
        row = rows[u]
        row.adversarial, row.adversarial_from = best[u]
        if row.adversarial > 1 + tol:
            row.status = "exceeded"
    top = max(checked, key=lambda u: best[u][0])
    return {"best": best[top][0], "unit": units[top][0], "found": best[top][1], "steps": steps,
            "starts": [f"example {i}" for i in order], "scales": list(scales), "evaluations": evaluations}
