"""Differentially private PCA of the inputs, used as a frozen input layer (Abadi et al. 2016, §4, §5.1).

``private_pca(X, k, σ_p)`` returns a :class:`PCAProjection`: the top-``k`` eigenvectors of a noisy
second-moment matrix of the training inputs, as a module with no trainable parameter that flattens
its input and projects it, ``x ↦ V x`` with ``V`` of shape ``[k, d]``. The mechanism:

1. every row is normalised to unit L2 norm, ``u_i = x_i/‖x_i‖`` (an all-zero row stays zero);
2. ``A = Σ_i u_i u_iᵀ`` (the uncentred second moment, as Abadi et al.: centring would need a
   private mean too);
3. ``Â = A + Z`` with ``Z`` symmetric: ``Z_ij = Z_ji ~ N(0, σ_p²)`` independent for ``i <= j`` (the
   upper triangle, diagonal included, filled and mirrored);
4. ``V`` = the eigenvectors of ``Â`` with the ``k`` largest eigenvalues (post-processing).

**Sensitivity (add/remove one example).** ``Â`` is a function of its upper triangle
``U(Â) = U(A) + U(Z)``, a vector of ``d(d+1)/2`` coordinates carrying i.i.d. ``N(0, σ_p²)`` noise, so
the release is the Gaussian mechanism on ``U(A)``, and its sensitivity is measured in *those*
coordinates. Removing example ``u`` changes ``A`` by ``M = u uᵀ``, and ::

    ‖U(M)‖² = Σ_i u_i⁴ + Σ_{i<j} u_i² u_j²
            = (‖u‖⁴ + Σ_i u_i⁴)/2          (since ‖u‖⁴ = Σ_i u_i⁴ + 2 Σ_{i<j} u_i² u_j²)
            <= ‖u‖⁴ <= 1                     (Σ_i u_i⁴ <= (Σ_i u_i²)²),

so ``Δ = 1``: an off-diagonal entry appears twice in the Frobenius norm ``‖M‖_F² = ‖u‖⁴`` but once
among the noisy coordinates, and ``‖U(M)‖ <= ‖M‖_F <= 1``. The bound is attained (``u = e_1``), so
the release is exactly a Gaussian mechanism with noise multiplier ``σ_p``, charged to the engine's
accountant as one event of sample rate 1 (:meth:`~bpclip_fast.accounting.Accountant.add_event`).
(Under replace-one adjacency ``‖U(uuᵀ − wwᵀ)‖ <= ‖uuᵀ − wwᵀ‖_F = (2 − 2(uᵀw)²)^½ <= √2``; the zCDP
accountant charges replace-one events with ``2Δ``, which covers it.)

**Which data.** The PCA must be computed on the *training* set, the set whose privacy the engine's
ε claims, and nothing else of it is charged: the validation and test sets are not touched (a PCA
computed on a superset of the training set is still covered for the training examples).

**Inputs of the projection.** The covariance is of normalised rows; the projection is applied to the
raw (flattened) inputs, as Abadi et al.'s MNIST code does: ``V`` is fixed before training
(post-processing of ``Â``), so what it is applied to does not affect the guarantee, and every later
layer bounds each example's contribution itself. ``‖V x‖ <= ‖x‖`` (orthonormal rows).

**Noise source.** By default the noise comes from the OS (``os.urandom``, a CSPRNG) through the
Box–Muller transform in float64, so nobody can regenerate it; ``seed=`` gives a reproducible,
**insecure** draw (NumPy's PCG64; whoever knows the seed can subtract the noise) with an
:class:`~bpclip_fast.InsecureSeedWarning`.

A :class:`PCAProjection` inside a model passed to ``PrivacyEngine.make_private`` is charged there
automatically (:func:`events_of`), and ``make_private_with_epsilon`` calibrates σ with it; one made
without noise (:func:`exact_pca`, for non-private baselines) is refused there.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from numbers import Integral, Real

import numpy as np
import torch
from torch import nn

__all__ = ["PCAProjection", "private_pca", "exact_pca", "events_of", "fingerprints", "noisy_second_moment"]


class PCAProjection(nn.Module):
    """A frozen linear input layer ``x ↦ x.flatten(1) @ componentsᵀ`` (buffer ``components``, ``[k, d]``).

    It has no parameter, so the engine clips nothing in it. ``noise_multiplier``: the σ_p of the
    release that produced ``components`` (``None``: computed without noise, not private);
    ``num_rows``: how many training rows it was computed from (for the record). Building one by hand
    asserts that ``components`` were released by :func:`private_pca`'s mechanism with that σ_p on the
    training set; the engine charges exactly that.
    """

    def __init__(self, components: torch.Tensor, *, noise_multiplier: float | None, num_rows: int):
        super().__init__()
        components = torch.as_tensor(components)
        if components.dim() != 2 or not components.is_floating_point():
            raise ValueError(f"PCAProjection: components must be a floating [k, d] tensor, got "
                             f"{tuple(components.shape)} {components.dtype}")
        if noise_multiplier is not None:
            noise_multiplier = _check_sigma(noise_multiplier)
        self.register_buffer("components", components.detach().clone().to(torch.float32))
        self.noise_multiplier = noise_multiplier
        self.num_rows = int(num_rows)

    @property
    def private(self) -> bool:
        return self.noise_multiplier is not None

    @property
    def in_features(self) -> int:
        return self.components.shape[1]

    @property
    def out_features(self) -> int:
        return self.components.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if x.shape[1] != self.in_features:
            raise ValueError(f"PCAProjection: inputs have {x.shape[1]} features per example, the projection "
                             f"was computed on {self.in_features}")
        return x @ self.components.to(x.dtype).t()

    def extra_repr(self) -> str:
        sigma = "not private" if self.noise_multiplier is None else f"noise_multiplier={self.noise_multiplier:g}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {sigma}, rows={self.num_rows}"


def _check_sigma(noise_multiplier) -> float:
    if (not isinstance(noise_multiplier, Real) or isinstance(noise_multiplier, bool)
            or not math.isfinite(noise_multiplier) or noise_multiplier <= 0):
        raise ValueError(f"private_pca: noise_multiplier must be a finite number > 0 (σ_p: the noise std on each "
                         f"entry of the upper triangle, the sensitivity being 1), got {noise_multiplier!r}; "
                         "exact_pca computes a non-private projection for non-private baselines")
    return float(noise_multiplier)


def _rows(X, what: str) -> np.ndarray:
    """``X`` as float64 ``[N, d]`` rows normalised to unit norm (a zero row stays zero)."""
    if isinstance(X, torch.Tensor):
        X = X.detach().cpu().to(torch.float64).numpy()
    X = np.asarray(X, dtype=np.float64)
    if X.ndim < 2 or X.shape[0] < 1:
        raise ValueError(f"{what}: X must be [N, d] or [N, *] with N >= 1 rows, got shape {X.shape}")
    X = X.reshape(X.shape[0], -1)
    bad = ~np.isfinite(X).all(axis=1)
    if bad.any():
        rows = np.flatnonzero(bad)
        raise ValueError(f"{what}: rows {rows[:5].tolist()}{' ...' if len(rows) > 5 else ''} of X hold NaN/Inf: "
                         "their normalised row is undefined; clean or drop them (from the training set "
                         "itself, which the guarantee is about)")
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    # an all-zero row contributes 0 (<= the bound); dividing by its norm would make NaNs
    return np.divide(X, norms, out=np.zeros_like(X), where=norms > 0)


def _check_k(k, d: int, what: str) -> int:
    if not isinstance(k, Integral) or isinstance(k, bool) or not 1 <= k <= d:
        raise ValueError(f"{what}: k must be an integer with 1 <= k <= d = {d} (the input dimension), got {k!r}")
    return int(k)


def _secure_normal(n: int) -> np.ndarray:
    """``n`` float64 N(0, 1) draws from OS entropy (Box–Muller on 53-bit uniforms)."""
    m = (n + 1) // 2
    bits = np.frombuffer(os.urandom(16 * m), dtype=np.uint64).reshape(2, m) >> np.uint64(11)
    u1 = (bits[0].astype(np.float64) + 1.0) * 2.0 ** -53  # (0, 1]: log(u1) is finite
    u2 = bits[1].astype(np.float64) * 2.0 ** -53
    r = np.sqrt(-2.0 * np.log(u1))
    return np.concatenate([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)])[:n]


def _noise(d: int, std: float, seed) -> np.ndarray:
    """Symmetric ``[d, d]`` noise: the upper triangle (diagonal included) i.i.d. ``N(0, std²)``, mirrored."""
    n = d * (d + 1) // 2
    if seed is None:
        z = _secure_normal(n)
    else:
        from .engine import InsecureSeedWarning

        warnings.warn("private_pca: an explicit seed makes the PCA noise reproducible and insecure (whoever "
                      "knows the seed can subtract it); leave seed=None for OS entropy",
                      InsecureSeedWarning, stacklevel=4)
        z = np.random.default_rng(int(seed)).standard_normal(n)
    Z = np.zeros((d, d))
    iu = np.triu_indices(d)
    Z[iu] = std * z
    return Z + np.triu(Z, 1).T


def noisy_second_moment(X, noise_multiplier: float, *, seed: int | None = None) -> np.ndarray:
    """``Σ_i u_i u_iᵀ + Z`` (float64, symmetric) of the module docstring: the mechanism's only release."""
    sigma = _check_sigma(noise_multiplier)
    U = _rows(X, "private_pca")
    return _release(U, sigma, seed)


def _release(U: np.ndarray, sigma: float, seed) -> np.ndarray:
    return U.T @ U + _noise(U.shape[1], sigma, seed)


def _top_k(A: np.ndarray, k: int) -> torch.Tensor:
    w, V = np.linalg.eigh(A)  # ascending eigenvalues; A symmetric
    return torch.from_numpy(np.ascontiguousarray(V[:, ::-1][:, :k].T))


def private_pca(X, k: int, noise_multiplier: float, *, seed: int | None = None) -> PCAProjection:
    """The (σ_p)-Gaussian private PCA projection of the training inputs ``X`` (module docstring).

    ``X``: the training set's inputs, ``[N, d]`` or ``[N, *]`` (flattened), tensor or array;
    ``k``: output dimension (``1 <= k <= d``); ``noise_multiplier``: σ_p (Abadi et al.'s MNIST runs:
    16, 7, 4 with 60 components); ``seed``: None (OS entropy) or an int (insecure, reproducible).
    """
    sigma = _check_sigma(noise_multiplier)
    U = _rows(X, "private_pca")
    k = _check_k(k, U.shape[1], "private_pca")
    return PCAProjection(_top_k(_release(U, sigma, seed), k), noise_multiplier=sigma, num_rows=U.shape[0])


def exact_pca(X, k: int) -> PCAProjection:
    """The same projection without noise: NOT private (for non-private baselines); the engine refuses it."""
    U = _rows(X, "exact_pca")
    k = _check_k(k, U.shape[1], "exact_pca")
    return PCAProjection(_top_k(U.T @ U, k), noise_multiplier=None, num_rows=U.shape[0])


def events_of(module: nn.Module, what: str = "make_private") -> list:
    """``[(σ_p, 1.0), ...]``: the accountant event of every :class:`PCAProjection` in ``module``.

    Refuses a projection computed without noise: it released the training data's second moment
    exactly, which no ε covers."""
    events = []
    for name, m in module.named_modules():
        if isinstance(m, PCAProjection):
            if not m.private:
                raise ValueError(f"{what}: module {name or '(root)'!r} is a PCAProjection computed without noise "
                                 "(exact_pca): it reveals the training data's second moment and no ε covers it; "
                                 "use private_pca(X_train, k, noise_multiplier)")
            events.append((m.noise_multiplier, 1.0))
    return events


def fingerprints(module: nn.Module) -> list:
    """``[(name, σ_p, sha256 of the components)]`` of every :class:`PCAProjection` in ``module``: the
    ranks of a distributed run must hold one release (compute it on one rank and broadcast it); a
    projection computed on each rank would be several releases, charged once."""
    return [(name, m.noise_multiplier, hashlib.sha256(m.components.detach().cpu().contiguous().numpy().tobytes())
             .hexdigest()) for name, m in module.named_modules() if isinstance(m, PCAProjection)]
