"""The empirical audits under correlated noise (``make_private(noise="banded", bands=b)``; issue 27).

The released noise follows ``c_0 w_t = σΔ z_t − Σ_{1≤j<b} c_j w_{t−j}``: the residual check
(``bpclip_fast.audit.noise``) whitens the per-step residuals by the engine's ``band_coefficients``,
``y_t = Σ_j c_j r_{t−j}`` from the run's first row, which is i.i.d. ``N(0, 1)`` under the claim; the
one-run score reads canary ``k``'s steps through the same view (its contribution at step ``s`` is
``c_j`` times it in ``y_{s+j}``). On correct code the bounds stay below the claim and the check
passes at its significance (1e-6); bugs planted in the recursion only (``banded.BandedNoise``,
what ``LayerBand`` makes its rows from — never the coefficients the audit whitens with) are
flagged: ``c_1`` with the wrong sign, ``c_1`` dropped, the last band dropped (correlated whitened
residuals), coefficients doubled (half the noise: std below the claim). Every run has a fixed seed.
"""

import math

import numpy as np
import pytest
import torch

from bpclip_fast import banded
from bpclip_fast.audit import cli, empirical
from bpclip_fast.audit.noise import NoiseCheck

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# 1000 canaries in 4 groups of 250; batch 125: the group rate q = 0.5; 8 steps, two windows a canary
BANDED = dict(mode="flat", canaries=1000, noise_multiplier=1.5, steps=8, batch_size=125, noise="banded", bands=4,
              seed=3)


def _below_claim(report):
    assert report["epsilon_lower_bound"] <= report["claimed_epsilon"], report
    assert not report["violation"], report["violation_reasons"]
    lo, hi = report["noise"]["std_interval"]
    assert lo <= 1 <= hi and report["noise"]["ok"]


def _violation(report, reason):
    assert report["violation"] and any(reason in r for r in report["violation_reasons"]), report["violation_reasons"]


def _recursion(c, z):
    """``w`` of the banded recursion in float64 from the draws ``z`` [T, P] (rows before 0 are zeros)."""
    w = torch.zeros_like(z)
    for t in range(len(z)):
        w[t] = (z[t] - sum(c[j] * w[t - j] for j in range(1, len(c)) if t - j >= 0)) / c[0]
    return w


def _plant_band(monkeypatch, change):
    """The recursion (each layer's ``LayerBand``) runs on ``change(c)``; the engine's
    ``band_coefficients``, which the audit reads as the claim, stay ``c``."""
    original = banded.BandedNoise.__init__
    monkeypatch.setattr(banded.BandedNoise, "__init__", lambda self, c: original(self, change(tuple(c))))


# ------------------------------------------------------------------------------------ the whitening
def test_whitened_residuals_are_the_draws_and_each_run_starts_the_band():
    c = banded.bsr_coefficients(4)
    gen = torch.Generator().manual_seed(0)
    check = NoiseCheck(lambda *_: torch.zeros(3000, dtype=torch.float64), torch.ones(3000, dtype=torch.float64),
                       [("p", slice(0, 3000))], c)
    for run in range(2):  # each run a block of its own, as the engine's rows restart with a fresh engine
        z = torch.randn(10, 3000, generator=gen, dtype=torch.float64)
        w = _recursion(c, z)
        check.new_run()
        # The computed rows satisfy c_0 w_t = z_t − Σ_j c_j w_{t−j} up to row t's own rounding (b + 1
        # float64 operations on terms of size ≤ (b + 1)·M, M the largest |w| or |z|), so y_t − z_t is
        # that rounding plus the whitening's own (b products and sums): no error carries across rows.
        b, eps = len(c), torch.finfo(torch.float64).eps
        tol = 4 * (b + 2) ** 2 * eps * float(torch.maximum(w.abs().max(), z.abs().max()))
        for t in range(len(z)):
            y = check._whiten(w[t])
            assert float((y - z[t]).abs().max()) <= tol, (run, t)
    # whitened: every test passes; the same residuals unwhitened are correlated across steps
    result = _run_check(c, c, seed=1)
    assert result["ok"] and not result["correlated"], result
    naive = _run_check(c, (1.0,), seed=1)
    assert not naive["ok"] and "steps 1 apart" in naive["correlated"], naive


def _run_check(true_c, claimed_c, seed, runs=3, steps=8, width=4000):
    gen = torch.Generator().manual_seed(seed)
    check = NoiseCheck(lambda *_: torch.zeros(width, dtype=torch.float64), torch.ones(width, dtype=torch.float64),
                       [("a", slice(0, width // 2)), ("b", slice(width // 2, width))], claimed_c)
    for _ in range(runs):
        check.new_run()
        for w in _recursion(true_c, torch.randn(steps, width, generator=gen, dtype=torch.float64)):
            check.add(w, [], [])
    return check.result()


def test_coefficients_off_in_the_recursion_are_flagged_by_the_check():
    c = banded.bsr_coefficients(4)
    flipped = (c[0], -c[1]) + c[2:]
    dropped = c[:-1] + (0.0,)
    assert "steps 1 apart" in _run_check(flipped, c, seed=2)["correlated"]
    assert "steps 3 apart" in _run_check(dropped, c, seed=3)["correlated"]


def test_bands_one_is_the_independent_audit():
    """``bands=1`` whitens nothing: the report is the independent audit's, number for number."""
    settings = dict(mode="flat", canaries=200, noise_multiplier=1.5, steps=3, batch_size=100, seed=4)
    a = empirical.one_run(**settings, return_scores=True)
    b = empirical.one_run(**settings, noise="banded", bands=1, return_scores=True)
    assert a["scores"] == b["scores"] and a["noise"] == b["noise"]
    assert b["band_coefficients"] == [1.0]


# ------------------------------------------------------------------------------------ correct code
@pytest.mark.parametrize("mode, accountant, bands, fillers, batch, loop", [
    ("flat", "rdp", 4, 0, 125, "plain"), ("backprop", "pld", 2, 0, 500, "plain"),
    ("per_layer", "rdp", 3, 2, 167, "plain"), ("backprop", "rdp", 4, 0, 125, "micro-batches"),
    ("flat", "pld", 2, 0, 500, "inplace-zero"),
])
def test_one_run_below_claim_under_banded_noise(mode, accountant, bands, fillers, batch, loop):
    report = empirical.one_run(**{**BANDED, "mode": mode, "accountant": accountant, "bands": bands,
                                  "fillers": fillers, "batch_size": batch, "steps": 2 * bands, "loop": loop})
    _below_claim(report)
    assert report["canary_reach"] > 0.999
    assert report["band_coefficients"] == pytest.approx(banded.bsr_coefficients(bands), rel=0, abs=0)
    assert report["epsilon_lower_bound"] > 0  # not blind: q ≤ 1, two windows per canary


def test_scores_follow_the_claimed_gaussian_under_banded_noise():
    """q = 1 and steps = bands: canary ``k`` of group ``g`` has one window, rows ``g..b−1`` (truncated at the
    run's end), so its score is ``m Y − m²/2`` with ``m = μ·(Σ_{j<b−g} c_j²)^½`` and ``Y`` its whitened
    projection: ``N(0, 1)`` excluded, ``N(m, 1)`` included. Scoring the release as independent noise
    (no whitening) leaves ``Y`` with the std of ``w_s``, not 1 (first row ``1/c_0 ≈ 1.22``)."""
    b = 4
    report = empirical.one_run(mode="backprop", canaries=1000, noise_multiplier=2.0, steps=b, batch_size=250,
                               noise="banded", bands=b, seed=9, heads=2, return_scores=True)
    assert not report["violation"], report["violation_reasons"]
    scores, included = np.array(report["scores"]), np.array(report["included"])
    c = banded.bsr_coefficients(b)
    mu = 1 / report["effective_noise_multiplier"]
    ys = {True: [], False: []}
    for k, g in enumerate(report["groups"]):
        m = mu * math.sqrt(sum(v * v for v in c[:b - g]))
        ys[bool(included[k])].append(((scores[k] + m * m / 2) / m) - (m if included[k] else 0.0))
    for side in (True, False):
        y = np.array(ys[side])
        assert abs(y.mean()) < 0.15 and abs(y.std() - 1) < 0.1, (side, y.mean(), y.std())


def test_many_run_below_claim_under_banded_noise():
    report = empirical.many_run(mode="flat", noise_multiplier=1.0, runs=120, fillers=7, batch_size=4, steps=2,
                                noise="banded", bands=2, delta=1e-2, seed=5)
    _below_claim(report)


# ------------------------------------------------------------------------------------ planted bugs
@pytest.mark.parametrize("bug, change, reason", [
    ("c_1 with the wrong sign", lambda c: (c[0], -c[1]) + c[2:], "steps 1 apart"),
    ("c_1 dropped", lambda c: (c[0], 0.0) + c[2:], "steps 1 apart"),
    ("the last band dropped", lambda c: c[:-1] + (0.0,), "steps 3 apart"),
    ("coefficients doubled (half the noise)", lambda c: tuple(2 * v for v in c), "noise below the claim"),
])
def test_coefficients_off_in_the_recursion_are_caught(monkeypatch, bug, change, reason):
    _below_claim(empirical.one_run(**BANDED))  # the control at the same settings
    _plant_band(monkeypatch, change)
    _violation(empirical.one_run(**BANDED), reason)


@pytest.mark.parametrize("claim, reason", [
    (lambda real, b: tuple(2 * v for v in real(b)), "the claimed band's norm exceeds 1"),
    (lambda real, b: real(b + 1), "the claimed band is longer than the loader's separation"),
])
def test_a_claimed_band_the_proof_does_not_cover_is_caught(monkeypatch, claim, reason):
    """A band changed in the claim *and* the recursion whitens consistently (the residual check passes),
    but the proof needs ‖c‖ ≤ 1 (doubled: ``y`` moves by ``2Δ`` against noise ``σΔ``) and at most as many
    bands as the loader separates an example's steps by (one more: two participations overlap in ``y``)."""
    real = banded.bsr_coefficients
    monkeypatch.setattr(banded, "bsr_coefficients", lambda b, momentum=0.0: claim(real, b))
    report = empirical.one_run(**BANDED)
    assert report["noise"]["ok"], report["noise"]
    _violation(report, reason)


def test_unwhitened_check_flags_correct_banded_noise(monkeypatch):
    """Why the check whitens: read as independent noise, correct banded noise is correlated across steps."""
    monkeypatch.setattr(empirical, "claimed_band", lambda engine: (1.0,))
    _violation(empirical.one_run(**BANDED), "steps 1 apart")


# ------------------------------------------------------------------------------------ interface
@pytest.mark.parametrize("bad, message", [
    (dict(bands=2), "needs noise='banded'"),
    (dict(noise="correlated"), "noise must be one of"),
    (dict(noise="banded", bands=2, batch_size=None), "batch_size must be at most 500"),
    (dict(noise="banded", bands=3, batch_size=100), "multiple of bands=3"),
    (dict(noise="banded", bands=4, batch_size=100, steps=3), "steps must be at least bands=4"),
    (dict(noise="banded", bands=2, batch_size=100, steps=2, accountant="zcdp"), "accountant='rdp'"),
])
def test_bad_banded_settings_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        empirical.one_run(**{"canaries": 1000, "seed": 1, **bad})


def test_cli_banded(capsys):
    code = cli.main(["one-run", "--canaries", "200", "--seed", "1", "--noise", "banded", "--bands", "2",
                     "--batch-size", "50", "--steps", "4"])
    out = capsys.readouterr().out
    assert code == 0 and "banded b=2" in out and "consistent with the claim" in out
