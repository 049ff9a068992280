"""Amplified BandMF with cyclic Poisson sampling: which steps one example can take part in.

Choquette-Choo et al. 2023, "Amplified BandMF" (NeurIPS 2023, arXiv:2306.08153, §4 and Thm. 4):
the data set is split by a fixed, data-independent partition into ``b`` groups of
``m = N // b`` examples; batch ``t`` is a Poisson sample (rate ``q_g = B/m``) of group
``t mod b`` only, and the released noise is ``C⁻¹z`` for a ``b``-banded lower-triangular
strategy ``C`` whose columns have norm ``<= 1``. An example of group ``g`` then contributes only
to steps ``t ≡ g (mod b)``, which are ``b`` apart, so its contributions land on disjoint
coordinates of the encoded release ``C·x + z`` (column ``t`` of ``C`` is non-zero only on rows
``t..t+b-1``), each with norm ``<= 1`` (clip norm 1 after whitening). The release is therefore,
for that example, ``⌈T/b⌉``-or-fewer Poisson-subsampled Gaussian mechanisms with rate ``q_g``
and the steps' noise multipliers, composed adaptively: DP-SGD on its group. The run's guarantee
is the worst over the groups. ``b = 1`` is DP-SGD itself.

Accounting: the history's step ``k`` (0-based) is at cyclic position ``k mod b`` (the group of
batch ``k``); position ``p`` composes the steps ``k ≡ p`` of the history, and the accountant
reports the worst position. Counts are computed per run of equal steps arithmetically, so a
history of millions of steps costs ``O(b·runs)``.
"""

from __future__ import annotations

import numpy as np

from .base import _is_real

__all__ = ["check_bands", "position_counts", "worst_positions", "dominating_history"]


def check_bands(bands, name: str = "bands") -> int:
    """``bands`` as an int; it must be an integer >= 1 (1: plain Poisson sampling, DP-SGD)."""
    if not _is_real(bands) or not float(bands).is_integer() or int(bands) < 1:
        raise ValueError(f"{name} must be an integer >= 1 (the number of cyclic groups / bands of the "
                         f"strategy matrix; 1 for plain Poisson sampling), got {bands!r}")
    return int(bands)


def _upto(end: int, p: np.ndarray, b: int) -> np.ndarray:
    """The number of ``k`` in ``[0, end)`` with ``k ≡ p (mod b)``, for each ``p`` in ``[0, b)``."""
    return np.maximum(0, (end - p + b - 1) // b)


def position_counts(history, bands: int) -> np.ndarray:
    """``counts[p, r]``: how many of run ``r``'s steps are at cyclic position ``p``; shape ``(b, runs)``.

    Run ``r`` covers steps ``[s_r, s_r + n_r)`` with ``s_r`` the sum of the earlier runs' lengths,
    and ``#{k ∈ [s, s+n): k ≡ p} = #{k < s+n} − #{k < s}`` (:func:`_upto`)."""
    b = check_bands(bands)
    p = np.arange(b, dtype=np.int64)
    counts = np.zeros((b, len(history)), dtype=np.int64)
    start = 0
    for r, (_, _, n) in enumerate(history):
        counts[:, r] = _upto(start + int(n), p, b) - _upto(start, p, b)
        start += int(n)
    return counts


def _history_of(history, row) -> list:
    """The runs of one position: run ``r`` with ``row[r]`` steps, empty runs dropped, neighbours with
    equal ``(σ, q)`` merged (as :meth:`Accountant._append` would have)."""
    out: list = []
    for (sigma, q, _), c in zip(history, row):
        c = int(c)
        if c == 0:
            continue
        if out and out[-1][0] == sigma and out[-1][1] == q:
            out[-1] = (sigma, q, out[-1][2] + c)
        else:
            out.append((sigma, q, c))
    return out


def worst_positions(history, bands: int) -> list:
    """The histories of the positions that can be the worst, one per distinct such position.

    A position whose count of every run is ``<=`` another position's composes a subset of the
    other's mechanisms (the same ``(σ, q)`` events, fewer of each), so its true ε at any δ (and δ at
    any ε) is no larger: it is dropped, and the worst over the rest bounds every position (the
    reported value of the dominating position is an upper bound on its own true value, hence on
    the dominated one's). Positions with equal counts are one. With ``b = 1`` this is exactly
    ``[history]`` (same entries), so the accountant's events are unchanged.
    """
    b = check_bands(bands)
    history = list(history)
    if b == 1 or not history:
        return [history]
    rows = np.unique(position_counts(history, b), axis=0)
    keep = []
    for i, row in enumerate(rows):
        dominated = any(j != i and np.all(other >= row) for j, other in enumerate(rows))
        if not dominated:
            keep.append(_history_of(history, row))
    return keep


def dominating_history(history, bands: int) -> list:
    """A history that dominates every position: run ``r`` with ``max_p counts[p, r]`` steps.

    Its event bounds the privacy loss of every example (see :func:`worst_positions`); for a history
    with one run it is exactly the worst position, ``⌈n/b⌉`` steps; with several runs it may be
    looser than the worst single position (the maxima can come from different positions)."""
    b = check_bands(bands)
    history = list(history)
    if b == 1 or not history:
        return history
    return _history_of(history, position_counts(history, b).max(axis=0))
