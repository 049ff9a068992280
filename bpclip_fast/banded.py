"""Correlated noise across steps: the banded matrix-factorization mechanism (amplified BandMF).

**The mechanism** (Choquette-Choo et al., "Amplified Banded Matrix Factorization", NeurIPS 2023;
Denisov et al. 2022). Training releases gradients ``Ĝ_t``; the optimizer (SGD) needs their prefix
sums, the workload ``A`` (lower-triangular ones). Factor ``A = B·C`` with ``C`` lower-triangular
Toeplitz and *b-banded*: ``C_{t,t−j} = c_j`` for ``0 ≤ j < b``, zero beyond. The mechanism releases
``y = C·G + σΔ·z`` (``z`` i.i.d. N(0, 1) per step and coordinate) and the model sees
``Ĝ = C⁻¹y = G + w`` with the correlated noise ``w = σΔ·C⁻¹z``, i.e. the recursion

    c_0·w_t = σΔ·z_t − Σ_{1 ≤ j < b} c_j·w_{t−j}.

Everything the training loop sees is computed from ``Ĝ``, hence from ``y`` (post-processing).

**Why this is private with the accountant of** :mod:`bpclip_fast.accounting` (``bands=b``): under
*b-min-separated participation* (an example is in at most one of every ``b`` consecutive batches:
the cyclic Poisson loader, :class:`bpclip_fast.data.CyclicPoissonBatchSampler`), one example that
participates at steps ``s_1 < s_2 < …`` with ``s_{k+1} − s_k ≥ b`` moves ``y`` by
``Σ_k (C e_{s_k}) ⊗ g_k`` with ``‖g_k‖ ≤ Δ``. Column ``C e_s`` is supported on rows ``s … s+b−1``
(banded), so the columns of different participations have disjoint supports: the mechanism is a
composition of one Gaussian mechanism per participation, each of sensitivity
``‖C e_s‖·Δ ≤ ‖c‖₂·Δ = Δ`` (we normalise ``‖c‖₂ = 1``; the last ``b−1`` columns are truncated and
shorter) with noise ``σΔ``, i.e. noise multiplier ``σ`` — and each participation is Poisson
sampled within its group. So the run is DP-SGD over the example's group: ``ceil(T/b)`` Poisson
subsampled Gaussians at the group's rate (Theorem 4 of Choquette-Choo et al. 2023; jax_privacy's
cyclic-Poisson accountant does the same reduction). ``b = 1`` is DP-SGD exactly.

**Restarting the band is sound.** A run that starts the recursion afresh at some step (a resumed
checkpoint without its secret rows) uses the block-diagonal
strategy ``diag(C_1, C_2)``: still lower-triangular, b-banded, with columns of norm ≤ 1, so the
argument above holds unchanged; only the noise at the boundary is not cancelled. A resume that
loads the rows (``PrivacyEngine.noise_state_dict``) continues the band instead: the same ``C``, the
next rows' ``z`` from a fresh seed.

**The strategy** (chosen): the banded square root of the workload (BSR; Kalinin & Lampert,
"Banded Square Root Matrix Factorization for Differentially Private Model Training", NeurIPS 2024):
``c_j`` are the first ``b`` coefficients of ``a(x)^{1/2}`` where ``a(x)`` is the workload's
generating function — ``1/(1−x)`` for SGD (``c_j = binom(2j, j)/4^j``), ``1/((1−x)(1−βx))`` for SGD
with momentum ``β`` — normalised to ``‖c‖₂ = 1``. Closed form, no optimisation, within a small
factor of the optimal banded strategy in their analysis. All its coefficients are positive and,
for ``β = 0``, decreasing, so ``c(x)`` has no zero inside the unit disc (Eneström–Kakeya) and the
recursion does not blow up. Why ``C`` banded rather than ``C⁻¹`` banded (noise ``Σ_j m_j z_{t−j}``,
regenerable from the Philox keys with no stored rows): with a banded inverse, ``C`` is dense, an
example's participations overlap in ``y``, and Poisson amplification no longer reduces to
independent mechanisms (it needs the MMCC analysis of Choquette-Choo et al. 2024). We keep the
exact, simple accounting and pay ``b−1`` stored noise rows per parameter (secret state, never in
any ``state_dict``). Measured against the zero-buffer alternative without amplification (BISR on
fixed batches): ``docs/design.md`` §1e, ``python -m bench.mf_compare``.

**Where the noise is added.** At the release point, as the independent draw is
(:class:`bpclip_fast.boundary.LayerStep`): the layer's backward releases its clipped sum without
noise and ``LayerStep.produced`` makes ``w_t`` straight into the returned gradients (one
``banded_row_`` launch: the row, its store into the ring, the add) before they leave the
backward, so no un-noised or partly-noised gradient is ever visible. Row ``t`` of the noise is
the index of the step's batch (``BatchCounter.last_t``), as the loader's group is: a batch claimed
and never used (prefetched when a loop stopped) is a row with no release, whose noise row is
still made (from its own draw) and charged. Every draw of a layer and row is ``z_t`` from the
Philox key (noise seed, row, layer), one flat vector over the layer's parameters (all of them, in
``LayerStep.params`` order, so freezing a parameter does not move any other's numbers).
"""

from __future__ import annotations

import math

import torch

from . import _ops  # noqa: F401  (loads the extension: torch.ops.bpclip_fast)

#: the largest number of bands: each stores one noise row per parameter
MAX_BANDS = 64


def bsr_coefficients(bands: int, momentum: float = 0.0) -> tuple:
    """``(c_0, …, c_{b−1})``: the banded square root of the SGD (``momentum = 0``) or momentum
    workload, normalised to unit 2-norm (module docstring). Computed in float64 as the power-series
    product of ``(1−x)^{-1/2}`` and ``(1−βx)^{-1/2}``, whose coefficients are ``binom(2j, j)/4^j``
    and ``binom(2j, j)/4^j·β^j``."""
    b = check_bands(bands)
    beta = float(momentum)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"bsr_coefficients: momentum must be in [0, 1), got {momentum!r}")
    half = [1.0]
    for j in range(1, b):
        half.append(half[-1] * (2 * j - 1) / (2 * j))  # binom(2j, j)/4^j by its ratio
    c = [sum(half[i] * half[j - i] * beta ** (j - i) for i in range(j + 1)) for j in range(b)]
    norm = math.sqrt(sum(v * v for v in c))
    return tuple(v / norm for v in c)


def check_bands(bands) -> int:
    """The accountants' check (an integer ≥ 1), and at most :data:`MAX_BANDS` (memory)."""
    from .accounting.cyclic import check_bands as accounting_check

    b = accounting_check(bands)
    if b > MAX_BANDS:
        raise ValueError(f"bands must be at most {MAX_BANDS} (each band stores one noise row per parameter), "
                         f"got {bands!r}")
    return b


class BandedNoise:
    """The engine's correlated-noise state: the coefficients and each layer's rows."""

    def __init__(self, coefficients):
        self.c = tuple(float(v) for v in coefficients)
        if not self.c or self.c[0] <= 0:
            raise ValueError("BandedNoise: c_0 must be > 0")
        if len(self.c) < 2:
            raise ValueError("BandedNoise: needs bands >= 2 (one band is independent noise: no rows to keep)")
        self.bands = len(self.c)
        # the recursion's weights for _ops.banded_row_: weights[a − 1] = −c_a/c_0 multiplies w_{t−a}
        self.weights = [-v / self.c[0] for v in self.c[1:]]

    def layer(self, key_of_row) -> "LayerBand":
        return LayerBand(self, key_of_row)


class LayerBand:
    """One layer's noise rows: the last ``b−1`` made ``w`` in a ring ``[b−1, P]``.

    ``key_of_row(t)`` is the Philox ``(seed, offset)`` of row ``t`` for this layer. Rows are made in
    increasing order; a row already made is never made again (its noise may have been seen), and a
    request for it after its gradient was discarded is refused by the caller.

    **The slots.** A row is made IN PLACE: one :func:`bpclip_fast._ops.banded_row_` launch reads the
    ``b−1`` slots, writes ``w_t`` over the oldest one (``w_{t−b+1}``, read first, element by element)
    and, given ``outs``, adds ``w_t`` to the gradients in the same pass. Then ``newest`` (the slot
    of the newest made row) advances and ``next_row = t + 1``. So the ring always holds the
    ``b−1`` newest MADE rows (``ring[newest]`` = ``w_{next_row−1}``, the slot of age ``a`` is
    ``(newest − a + 1) mod (b−1)``, zeros for rows before the block began); there is no separate
    current row and no copy at commit: a made row is history at once, which is what it becomes
    anyway when its step is charged (:meth:`commit_through` only makes, each from its own draw,
    the rows never made). ``next_row is None``: nothing made since the start or a restart (the
    block begins at the next row made; the ring is zeros, or ``None`` before first use).
    """

    __slots__ = ("noise", "key_of_row", "ring", "newest", "next_row")

    def __init__(self, noise: BandedNoise, key_of_row):
        self.noise = noise
        self.key_of_row = key_of_row
        self.ring = None         # [b−1, P] the newest made rows (zeros before the block began), allocated at first use
        self.newest = 0          # the ring slot of the newest made row
        self.next_row = None     # the first row not yet made (None: none made since the start/restart)

    def made(self, row: int) -> bool:
        """Whether row ``row`` (or a later one) was already made."""
        return self.next_row is not None and row < self.next_row

    def newest_row(self) -> torch.Tensor:
        """The newest made row (``w_t`` once the step of batch ``t`` was charged)."""
        return self.ring[self.newest]

    def row(self, row: int, std: float, like: torch.Tensor, numel: int, outs=(), starts=()) -> torch.Tensor:
        """Makes ``w_row`` (rows skipped since the last one first, each from its own draw), adds it to
        ``outs`` (tensors covering the flat elements from ``starts``; see ``_ops.banded_row_`` for what
        they must be) in the same launch, and returns its ring slot: the flat ``numel`` values, dtype
        and device of ``like`` (a view: valid until ``b−1`` more rows are made)."""
        if self.made(row):
            raise RuntimeError(f"banded noise: row {row} was already made")
        self._catch_up(row, std, like, numel)
        return self._make(row, std, like, numel, outs, starts)

    def commit_through(self, row: int, std: float, like: torch.Tensor, numel: int) -> None:
        """Rows up to ``row`` are history (the step charged for batch ``row`` ended): any row not made
        (a layer no backward reached in a refused step, a pass that never returned its gradient, a
        skipped batch) is made now from its own draw."""
        self._catch_up(row + 1, std, like, numel)

    def _catch_up(self, row, std, like, numel):
        """Makes every row before ``row`` not made yet (none before the block began)."""
        if self.next_row is None:  # nothing made since the start or a restart: the block begins at `row`
            return
        for r in range(self.next_row, row):
            self._make(r, std, like, numel)

    def fits(self, like, numel) -> bool:
        """Whether rows of ``numel`` values in ``like``'s dtype and device continue this ring (no ring yet:
        any); not after a model converted or moved since the first row (the 'converted' refusal)."""
        r = self.ring
        return r is None or (r.shape[1] == numel and r.dtype == like.dtype and r.device == like.device)

    def _ring(self, like, numel):
        if self.ring is None:
            b1 = self.noise.bands - 1
            self.ring = torch.zeros(b1, numel, dtype=like.dtype, device=like.device)
            self.newest = b1 - 1
        elif not self.fits(like, numel):
            raise RuntimeError("banded noise: a layer's parameters changed size, dtype or device during the run")
        return self.ring

    def _make(self, row, std, like, numel, outs=(), starts=()) -> torch.Tensor:
        """``w_row = (std·z_row − Σ_j c_j w_{row−j}) / c_0`` into the oldest slot, which becomes the
        newest (rows before the start or a restart are the ring's zeros: the block-diagonal strategy,
        module docstring). _catch_up has made every row before ``row`` since the block began, so the
        slot of age j holds ``w_{row−j}``."""
        ring = self._ring(like, numel)
        seed, offset = self.key_of_row(row)
        # The op itself, not _ops' checking wrapper: the ring and weights are this object's, the caller
        # chose the outs with _ops.banded_row_outs_problem, and the C++ op checks every argument again
        # (csrc/band_args.h); the wrapper's Python checks cost 8 µs a layer and step.
        torch.ops.bpclip_fast.banded_row_(ring, list(outs), list(starts), self.newest, self.noise.weights, int(seed),
                                          int(offset), std / self.noise.c[0])
        self.newest = (self.newest + 1) % ring.shape[0]
        self.next_row = row + 1
        return ring[self.newest]

    def restart(self) -> None:
        """Forget every row (a resumed run: the strategy's next block)."""
        if self.ring is not None:
            self.ring.zero_()
        self.next_row = None

    def export_rows(self):
        """``(rows, next_row)``: the committed rows oldest first (``[b−1, P]``, a copy; zeros for rows
        before the block began), ``None`` if none was ever made, and the first row not yet made."""
        if self.ring is None:
            return None, self.next_row
        b1 = self.ring.shape[0]
        order = [(self.newest + 1 + k) % b1 for k in range(b1)]
        return self.ring[order], self.next_row  # indexing by a list copies

    def import_rows(self, rows, next_row, like, numel) -> None:
        """Continues the block of :meth:`export_rows` (the caller checked sizes, dtype and pairing)."""
        self.restart()
        self.next_row = next_row
        if rows is None:
            return
        ring = self._ring(like, numel)
        ring.copy_(rows)
        self.newest = ring.shape[0] - 1
