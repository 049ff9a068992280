"""Attack review of the late exact-norm changes (eps at T = 1, a Linear's position sums in the bound
kernel, the non-finite count inside the norms op). Each test compares the op's bound with the exact
norm of the example's gradient in rational arithmetic (fractions.Fraction): the bound must be >= it.
Each test is a finding: it failed on the code before its fix."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

WS = 1 << 26


def _exact_sq(xs, gs, bias):
    """||[G_W, G_b]||^2 of one example, exactly: G_W = sum_t g_t x_t^T, G_b = sum_t g_t (lists of
    float rows, T positions)."""
    T, d, p = len(xs), len(xs[0]), len(gs[0])
    x = [[Fraction(v) for v in row] for row in xs]
    g = [[Fraction(v) for v in row] for row in gs]
    sq = Fraction(0)
    for j in range(p):
        for k in range(d):
            sq += sum(g[t][j] * x[t][k] for t in range(T)) ** 2
        if bias:
            sq += sum(g[t][j] for t in range(T)) ** 2
    return sq


def _covers(bound, sq):
    """bound >= sqrt(sq), exactly (bound a finite non-negative double)."""
    b = Fraction(bound)
    return b * b >= sq


@pytest.mark.parametrize("T", [1, 2])
def test_fp64_linear_tiny_inputs_huge_gradients(T):
    """fp64 data: entries near 1e-163 square to 0 in double, so the kernel's position norm a_t came
    out 0 while g_t ~ 1e153 (squares still finite) made ||G_W|| ~ 1e-10: a bound of 0 (or that of the
    bias alone), and the whole weight gradient released unclipped, whatever C (the norms are
    scale-free: not clip.h's absolute 2^-537 sqrt(N), which does not multiply by ||g||). Before the
    position sums moved into the kernel, T > 1 added 3 d tau for exactly this (T = 1 never had it)."""
    bias = False  # with a bias, its own norm ||g|| ~ 1e153 dwarfs ||G_W|| and the bound holds anyway
    d, p = 3, 2
    x = torch.full((1, T, d), 1e-163, dtype=torch.float64)
    g = torch.full((1, T, p), 1e153, dtype=torch.float64)
    if T == 1:
        x, g = x[:, 0], g[:, 0]
    _, bound, _, _ = torch.ops.bpclip_fast.linear_grad_norms(g, x, [True, bias], "ghost", WS, False, None)
    xs = x.reshape(T, d).tolist()
    gs = g.reshape(T, p).tolist()
    sq = _exact_sq(xs, gs, bias)
    assert sq > Fraction(1, 10 ** 21)  # ||G|| > 1e-10.5, not 1e-162
    assert _covers(bound.item(), sq), (bound.item(), float(sq) ** 0.5)


def test_fp64_depthwise_conv_t1_group_sum_rounding():
    """fp64 depthwise Conv2d at T = 1 (1x1 kernel and input): the per-group sq are summed over the
    groups in double (G - 1 additions), which neither grow (gamma_{p+3} with p = 1 channel per group)
    nor eps P^2 counted. Group 0 has sq = 1 and the other G - 1 groups sq just under half an ulp of 1,
    each lost entirely: ||G||^2 = 1 + (G - 1) 0.98 v, far beyond the bound's slack."""
    G, bias = 256, False  # (a bias's P^2 in eps P^2 would cover this example)
    x = torch.empty(1, G, 1, 1, dtype=torch.float64)
    g = torch.empty(1, G, 1, 1, dtype=torch.float64)
    x[0, 0], g[0, 0] = 1.0, 1.0
    x[0, 1:] = 2.0 ** -13
    g[0, 1:] = 0.7 * 2.0 ** -13
    _, bound, _, _ = torch.ops.bpclip_fast.conv2d_grad_norms(g, x, [1, 1], [1, 1], [0, 0], [1, 1], G, [True, bias],
                                                             "auto", WS, False, None)
    xs = x.reshape(1, G).tolist()
    gs = g.reshape(1, G).tolist()
    # depthwise: channel j's weight gradient is g_j x_j (its own input channel only)
    sq = sum(Fraction(gs[0][j]) ** 2 * Fraction(xs[0][j]) ** 2 for j in range(G))
    if bias:
        sq += sum(Fraction(gs[0][j]) ** 2 for j in range(G))
    assert _covers(bound.item(), sq), (bound.item() - 1.0, float(sq - 1) / 2)


@pytest.mark.parametrize("T_hw", [(2, 1), (2, 2)])
def test_fp64_depthwise_conv_ghost_group_sum_rounding(T_hw):
    """The same group sum at T > 1 (ghost, fp64 data): grow covers the T^2 products, p bias terms and
    two roundings; the G - 1 additions over the groups were not counted."""
    G = 512
    h, w = T_hw
    x = torch.zeros(1, G, h, w, dtype=torch.float64)
    g = torch.zeros(1, G, h, w, dtype=torch.float64)
    x[0, 0, 0, 0], g[0, 0, 0, 0] = 1.0, 1.0
    x[0, 1:, 0, 0] = 2.0 ** -13
    g[0, 1:, 0, 0] = 0.7 * 2.0 ** -13
    _, bound, _, _ = torch.ops.bpclip_fast.conv2d_grad_norms(g, x, [1, 1], [1, 1], [0, 0], [1, 1], G, [True, False],
                                                             "ghost", WS, False, None)
    xv = x.reshape(G, h * w).tolist()
    gv = g.reshape(G, h * w).tolist()
    sq = Fraction(0)
    for j in range(G):
        sq += sum(Fraction(gv[j][t]) * Fraction(xv[j][t]) for t in range(h * w)) ** 2
    assert _covers(bound.item(), sq), (bound.item() - 1.0, float(sq - 1) / 2)
