"""The one-run and many-run audits' score: each canary's log-likelihood ratio over the steps of a run
(:mod:`bpclip_fast.audit.empirical`'s "The score reads every step"), under independent or banded noise."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Scorer:
    """Accumulates each canary's log-likelihood-ratio score over the steps (:mod:`bpclip_fast.audit.empirical`).

    Correlated noise (``coefficients`` ``c`` of ``b > 1`` bands, :mod:`bpclip_fast.banded`): the
    release ``Ĝ = G + w`` is a bijection of ``y_t = Σ_{j<b} c_j Ĝ_{t−j} = Σ_j c_j G_{t−j} + σΔ z_t``
    (rows from the run's first, where the engine's block starts), in which the noise is i.i.d. and
    a canary sampled at step ``s`` adds ``c_j·g`` to ``y_{s+j}``, ``j < b`` (fewer at the run's end).
    So its statistic for step ``s`` is the projection of ``(y_s, …, y_{s+b−1})`` on ``(c_j·w)``:
    ``Y_s = Σ_j c_j p_{s+j} / n_s`` (``p_t``: the projection of whitened ``y_t``, ``n_s = (Σ_j c_j²)^½``),
    ``N(μ n_s·[sampled at s], 1)`` under the claim. Only the steps of the canary's group
    (``s mod b``) can sample it, ``b`` apart, so its windows are disjoint and independent: the score
    adds ``log(1 − q + q·e^{μ n_s Y_s − (μ n_s)²/2})`` over them (``q``: the group rate), the
    likelihood ratio of the whole run, and one Poisson Gaussian of sensitivity ``≤ ‖c‖Δ = Δ`` per
    window, as the accountant charges. ``b = 1``: ``Y_s = p_s``, every step, the independent score."""

    rows: torch.Tensor         # canary of each stored coordinate
    cols: torch.Tensor         # its coordinate in the flattened update
    unit: torch.Tensor         # the canary's unit whitened contribution there
    mu: torch.Tensor           # [m] the whitened contributions' norms
    scale: torch.Tensor        # [P] claimed noise std per coordinate of the update
    rate: float                # the chance a canary is in a step's batch (banded: its group's step's)
    coefficients: tuple = (1.0,)       # the claimed band c (engine.band_coefficients)
    group: torch.Tensor | None = None  # [m] each canary's group (banded; set per run: _train)
    scores: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.scores = torch.zeros(len(self.mu), dtype=torch.float64)
        self.new_run()

    def new_run(self) -> None:
        self.scores.zero_()
        self._past = []    # the last b−1 whitened updates at the canaries' coordinates, newest last
        self._open = []    # (row, p_row) of the rows whose windows are not complete, oldest first

    def add(self, update: torch.Tensor, row: int = 0) -> None:
        z = update[self.cols] / self.scale[self.cols]
        c = self.coefficients
        if len(c) == 1:
            self._score(row, torch.zeros_like(self.mu).index_add_(0, self.rows, self.unit * z), 1.0)
            return
        y = c[0] * z
        for j, past in enumerate(reversed(self._past), start=1):
            y = y + c[j] * past
        self._past = (self._past + [z])[-(len(c) - 1):]
        self._open.append((row, torch.zeros_like(self.mu).index_add_(0, self.rows, self.unit * y)))
        if len(self._open) == len(c):
            self._window()

    def finish(self) -> None:
        """The run ended: the windows of its last ``b − 1`` steps, truncated (their later rows were never released)."""
        while self._open:
            self._window()

    def _window(self) -> None:
        row = self._open[0][0]
        c = self.coefficients
        y = sum(c[j] * p for j, (_, p) in enumerate(self._open))
        n = math.sqrt(sum(c[j] ** 2 for j in range(len(self._open))))
        self._open.pop(0)
        self._score(row, y / n, n)

    def _score(self, row: int, y: torch.Tensor, n: float) -> None:
        mu = self.mu * n
        llr = mu * y - mu ** 2 / 2
        if self.rate < 1:
            llr = torch.logaddexp(torch.full_like(llr, math.log1p(-self.rate)), llr + math.log(self.rate))
        if self.group is not None:
            llr = torch.where(self.group == row % len(self.coefficients), llr, torch.zeros_like(llr))
        self.scores += llr


def groups(loader, m: int) -> torch.Tensor:
    """The group of each of the dataset's first ``m`` examples (the canaries) under the loader's cyclic
    Poisson sampler (public: the analysis gives the adversary every example's group)."""
    sampler = loader.batch_sampler
    group = torch.full((len(sampler.group(0)) * sampler.bands,), -1, dtype=torch.long)
    for g in range(sampler.bands):
        group[sampler.group(g)] = g
    return group[:m]
