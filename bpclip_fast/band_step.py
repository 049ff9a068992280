"""A layer step's correlated-noise row (``make_private(noise="banded")``; the mechanism and its proof:
:mod:`bpclip_fast.banded`): where :class:`bpclip_fast.boundary.LayerStep` records the row of a
backward pass, makes it into the gradients that pass returns, and refuses a second draw or a
converted model. A mixin of ``LayerStep`` (its state: ``band``, ``band_row``, ``band_std``,
``params``, ``_nodes``, ``refuse``), kept apart so that the boundary's own rules read on their own."""

from __future__ import annotations

import torch

from . import _ops

EPS64 = float(torch.finfo(torch.float64).eps)


class BandRelease:
    """The correlated-noise half of :class:`bpclip_fast.boundary.LayerStep`."""

    def _band_std(self, std: float) -> float:
        """The layer's one std for every row, ``band_std`` (set by the engine; rows made outside a
        backward use it too), once this path's own std is seen to be it to float64 rounding: rows of
        unequal scale would not be ``C⁻¹`` of i.i.d. draws, and a smaller one would leak through the
        band the data of the rows before it. The two are ``σ·Δ·(d/B̄)/d`` and ``σ·Δ/B̄`` in float64:
        six roundings of relative size ≤ ε₆₄/2, so they differ by ≤ 3ε₆₄ (4ε₆₄ allowed)."""
        if not abs(std - self.band_std) <= 4 * EPS64 * self.band_std:
            raise RuntimeError(f"{self.name}: this backward's noise std {std!r} is not the layer's correlated-noise "
                               f"std {self.band_std!r}; every row of a layer must have one scale (a bug: please "
                               "report it)")
        return self.band_std

    def _band_noise(self, std: float):
        """``(row, std)`` of this layer's correlated noise (``bpclip_fast.banded``) for the gradients this
        pass returns: :meth:`produced` makes the row straight into them. Made once: a second draw
        within the step (the gradient that held the first was discarded) is refused, since a fresh
        row would release the past rows' noise once more and the same row would be the same noise on
        other data. A pass that never returns its gradients leaves the row unmade (never seen): the
        charge's ``commit_through`` makes it from its own draw, as for a layer no backward reached."""
        row = self.band_row()
        if self.band.made(row):
            self._refuse_redraw(row)
        return row, std

    def _refuse_redraw(self, row: int) -> None:
        details = (f"{self.name}: the gradient that held this step's correlated noise (row {row}) was discarded "
                   "(zero_grad, or a backward pass whose gradient never landed) and a later backward pass needs "
                   "the noise again; banded noise draws each row once (a new row would release the noise of the "
                   "past steps again, the same row would be the same noise on other data). Take one backward per "
                   "step, or micro-batches without clearing the gradient between them")
        self.refuse("banded-redraw", details)
        raise RuntimeError(details)

    def _reaches_grad(self) -> bool:
        """Whether the gradients this pass returns can reach anyone. Not where autograd says that none of
        the layer's AccumulateGrad nodes will run (``torch.autograd.grad(loss, x)`` or
        ``backward(inputs=[x])``: an adversarial example's input gradient before the step's backward):
        autograd drops them unseen, so the row is left for the pass that lands. A capture of the
        parameters (``torch.autograd.grad(loss, params)``, where torch refuses the question) gets the
        row all the same, and the tensor hook refuses it (``captured``)."""
        if not self._nodes:
            return True
        try:
            return any(torch._C._will_engine_execute_node(node) for node in self._nodes)
        except RuntimeError:
            return True

    def make_band(self, row: int, std: float, grads) -> None:
        """Makes row ``row`` of the layer's noise and adds it to ``grads`` (one per parameter, in ``params``
        order, ``None`` where none): in the op's own pass where the gradients can take it (contiguous,
        the row's dtype and device, at most ``_ops.BAND_MAX_OUTS``), else made alone and added by
        :meth:`add_band` (a generic unit's odd gradient, a user's ``p.grad``)."""
        like, numel = self.band_layout()
        if not self.band.fits(like, numel):  # else the ring's own check raises, naming no layer and no fix
            ring = self.band.ring
            details = (f"{self.name}'s parameters are now {like.dtype} on {like.device} ({numel} values), its "
                       f"correlated-noise rows {ring.dtype} on {ring.device} ({ring.shape[1]}): the model was "
                       "converted or moved after make_private")
            self.refuse("converted", details)
            raise RuntimeError(details)
        outs, starts, at = [], [], 0
        for p, g in zip(self.params, grads):
            if g is not None:
                outs.append(g)
                starts.append(at)
            at += p.numel()
        if _ops.banded_row_outs_problem(like, numel, outs, starts) is None:
            self.band.row(row, std, like, numel, outs, starts)
        else:
            self.add_band(grads, self.band.row(row, std, like, numel))

    def band_layout(self):
        """``(like, numel)`` of the layer's flat noise row: all of its parameters, in ``params`` order."""
        params = self.params
        return params[0], sum(p.numel() for p in params)

    def add_band(self, grads, w) -> None:
        """Adds the flat row ``w`` (all of the layer's parameters, in ``params`` order) to ``grads``
        (one foreach launch for the weight and the bias)."""
        at, targets, pieces = 0, [], []
        for p, g in zip(self.params, grads):
            n = p.numel()
            if g is not None:
                targets.append(g)
                pieces.append(w[at:at + n].view(g.shape))
            at += n
        if targets:
            torch._foreach_add_(targets, pieces)
