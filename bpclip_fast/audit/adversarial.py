"""The adversarial search (``sensitivity(..., adversarial_steps=k)``): gradient ascent on one example's input along a
plain-torch surrogate of the model (:class:`_Surrogate`, double-differentiable, no clipping), every iterate's
contribution ``R(S ∪ {z}) − R(S)`` measured through the real clipped layers.

Apart from the audit because it is a search, not a measurement: its surrogate only proposes inputs, nothing in it
bounds anything; what it finds is judged by the same noise-free release (:mod:`.noise_free`) as the batch.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from .. import nn as bnn, registry
from .noise_free import _norms

_CAP = math.log(4.0)  # the surrogate stops pushing a quantity once it is 4x its bound


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
        if layers and layers[0]._bp_flat is not None:
            layers[0]._bp_flat.remove()
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
                # l15 of a Conv2d's [1, O, H, W] or a Conv1d's [1, O, L] (the norms the layers clip)
                g_sq = (g.abs().sum(tuple(range(2, g.dim()))).square().sum()
                        if getattr(layer, "norm", "l2") == "l15" and g.dim() in (3, 4) else g.square().sum())
                terms += [log_ratio(g_sq, layer._bp_grad_clip)]
                if x.is_floating_point():
                    terms += [log_ratio(x.square().sum(), layer._bp_input_clip)]
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
            row.failed.append("adversarial")
    top = max(checked, key=lambda u: best[u][0])
    return {"best": best[top][0], "unit": units[top][0], "found": best[top][1], "steps": steps,
            "starts": [f"example {i}" for i in order], "scales": list(scales), "evaluations": evaluations}
