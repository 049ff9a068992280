"""Private PCA (bpclip_fast.pca) and the accountants' one-off events (Abadi et al. 2016, §4).

Truths: float64 numpy (second moment, eigenvectors), and Google's dp_accounting composing the Gaussian
event with the Poisson-subsampled steps directly (no code of ours in the reference).
"""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import (ComposedDpEvent, GaussianDpEvent, NeighboringRelation,  # noqa: E402
                           PoissonSampledDpEvent, SelfComposedDpEvent)
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant as DpaPLD  # noqa: E402
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp  # noqa: E402

from bpclip_fast import pca  # noqa: E402
from bpclip_fast.accounting import (PLDAccountant, PrivacyBudgetError, RDPAccountant, ZCDPAccountant,  # noqa: E402
                                    gaussian_epsilon, get_noise_multiplier)
from bpclip_fast.engine import InsecureSeedWarning, PrivacyEngine  # noqa: E402

ADD_REMOVE = NeighboringRelation.ADD_OR_REMOVE_ONE
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
EPS64 = np.finfo(np.float64).eps
DELTA = 1e-5


def seeded(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureSeedWarning)
        return fn(*a, **kw)


def unit_rows(X):
    X = np.asarray(X, dtype=np.float64).reshape(len(X), -1)
    return X / np.linalg.norm(X, axis=1, keepdims=True)


def upper(M):
    return M[np.triu_indices(M.shape[0])]


# ---------------------------------------------------------------- the mechanism

def test_noise_is_symmetric_with_std_sigma_on_the_upper_triangle():
    """Z = Â − A (A in float64 from the same rows): exactly symmetric; its upper triangle (diagonal and
    off-diagonal apart) has variance σ_p². The sample variance of n i.i.d. normals has relative std
    √(2/(n−1)); 5 of them bound the check (a √2 factor on either part, as (E+Eᵀ)/√2 noise would give
    the diagonal, is 40 of them off). The float64 error of A (≤ N·eps per entry) is negligible."""
    rng = np.random.default_rng(0)
    d, N, sigma = 40, 30, 3.0
    X = rng.normal(size=(N, d)) * 5
    A = unit_rows(X).T @ unit_rows(X)
    diag, off = [], []
    for i in range(25):
        # the default (OS entropy) source and the seeded one both
        Ahat = pca.noisy_second_moment(X, sigma) if i % 2 else seeded(pca.noisy_second_moment, X, sigma, seed=i)
        Z = Ahat - A
        assert np.array_equal(Ahat, Ahat.T)
        diag.append(np.diag(Z))
        off.append(Z[np.triu_indices(d, 1)])
    for part in (np.concatenate(diag), np.concatenate(off)):
        n = part.size
        assert abs(part.var(ddof=1) / sigma ** 2 - 1) <= 5 * math.sqrt(2 / (n - 1))
        assert abs(part.mean()) <= 5 * sigma / math.sqrt(n)


def test_secure_noise_differs_between_calls_and_seeded_repeats():
    X = np.eye(5)
    assert not np.array_equal(pca.noisy_second_moment(X, 1.0), pca.noisy_second_moment(X, 1.0))
    with pytest.warns(InsecureSeedWarning):
        a = pca.noisy_second_moment(X, 1.0, seed=3)
    assert np.array_equal(a, seeded(pca.noisy_second_moment, X, 1.0, seed=3))


def test_removal_sensitivity_is_at_most_one_on_the_noisy_coordinates():
    """Removing one example changes A by uuᵀ: ‖uuᵀ‖_F = ‖u‖² = 1 and on the upper-triangle coordinates
    (where the noise is) ‖U(uuᵀ)‖² = (1 + Σu_i⁴)/2 ≤ 1, attained at u = e_1. Checked on A itself (raw
    rows of arbitrary scale through the module's normalisation), float64: each entry of the difference
    of two N-row sums errs by at most ~2N·eps (terms ≤ 1), so the norm by √(d(d+1)/2)·2N·eps."""
    rng = np.random.default_rng(1)
    N, d = 50, 20
    X = rng.normal(size=(N, d)) * rng.uniform(0.01, 100, size=(N, 1))
    X[7] = 0.0
    X[8] = 0.0
    X[8, 3] = -42.0  # an axis-aligned row: the bound is attained
    U = pca._rows(X, "test")
    A = U.T @ U
    tol = math.sqrt(d * (d + 1) / 2) * 2 * N * EPS64
    norms = []
    for i in range(N):
        Ui = np.delete(U, i, axis=0)
        M = A - Ui.T @ Ui
        assert np.linalg.norm(M) <= 1 + tol                 # Frobenius
        u = U[i]
        exact = math.sqrt((np.sum(u ** 2) ** 2 + np.sum(u ** 4)) / 2)
        assert abs(np.linalg.norm(upper(M)) - exact) <= tol  # the off-diagonal entries count once
        norms.append(np.linalg.norm(upper(M)))
    assert max(norms) <= 1 + tol and abs(norms[8] - 1) <= tol and norms[7] <= tol


def test_tiny_noise_recovers_the_top_k_eigenspace():
    """σ_p tiny: every principal angle between the components and the exact top-k eigenvectors of A
    (float64 eigh) is within the Davis–Kahan bound sin θ ≤ ‖Z‖₂/(gap − ‖Z‖₂) plus eigh's backward
    error (~d·eps·‖A‖₂ per matrix, twice)."""
    rng = np.random.default_rng(2)
    N, d, k = 400, 30, 5
    scales = np.r_[np.linspace(10, 6, k), np.ones(d - k)]
    X = rng.normal(size=(N, d)) * scales
    U = unit_rows(X)
    A = U.T @ U
    w, V = np.linalg.eigh(A)
    V_true = V[:, ::-1][:, :k].T
    sigma = 1e-7
    proj = seeded(pca.private_pca, X.reshape(N, 5, 6), k, sigma, seed=11)
    Z = seeded(pca.noisy_second_moment, X, sigma, seed=11) - A
    gap = w[::-1][k - 1] - w[::-1][k]
    z2 = np.linalg.norm(Z, 2) + 2 * d * EPS64 * np.linalg.norm(A, 2)
    # sin θ as the singular values of (I − P_true)Q, Q an orthonormal basis of the components' span
    # (not via 1 − cos², which loses half the digits)
    Q, _ = np.linalg.qr(proj.components.double().numpy().T)
    sines = np.linalg.svd(Q - V_true.T @ (V_true @ Q), compute_uv=False)
    # float32 storage moves each component by ≤ 2⁻²⁴ relative: ≤ √k·2⁻²⁴ on the sines
    assert sines.max() <= z2 / (gap - z2) + math.sqrt(k) * 2.0 ** -24 + 4 * d * EPS64
    assert gap > 100 * z2  # the check is meaningful: the bound is small


def test_projection_module_is_frozen_and_projects_raw_inputs():
    rng = np.random.default_rng(3)
    X = torch.tensor(rng.normal(size=(20, 2, 3, 3)))
    proj = seeded(pca.private_pca, X, 4, 2.0, seed=0)
    assert list(proj.parameters()) == [] and dict(proj.named_buffers()).keys() == {"components"}
    assert proj.components.shape == (4, 18) and proj.noise_multiplier == 2.0 and proj.num_rows == 20
    C = proj.components.double()
    assert torch.allclose(C @ C.T, torch.eye(4, dtype=torch.float64), atol=18 * 2.0 ** -23)
    out = proj.double()(X)
    assert torch.equal(out, X.flatten(1) @ proj.components.t())


@pytest.mark.parametrize("bad, match", [
    (dict(k=0), "k must be"), (dict(k=19), "k must be"), (dict(k=2.0), "k must be"),
    (dict(noise_multiplier=0.0), "noise_multiplier"), (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(noise_multiplier=float("nan")), "noise_multiplier"), (dict(noise_multiplier=None), "noise_multiplier"),
])
def test_bad_arguments_are_refused(bad, match):
    args = dict(X=np.ones((4, 18)), k=2, noise_multiplier=1.0) | bad
    with pytest.raises(ValueError, match=match):
        pca.private_pca(args["X"], args["k"], args["noise_multiplier"])


def test_non_finite_rows_are_refused_by_index():
    X = np.ones((6, 4))
    X[4, 1] = np.inf
    with pytest.raises(ValueError, match=r"rows \[4\]"):
        pca.private_pca(X, 2, 1.0)


# ---------------------------------------------------------------- accounting: one-off events

def _truth(history, events, delta, kind):
    ev = ComposedDpEvent([SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(s)), n)
                          for s, q, n in history] + [GaussianDpEvent(s) for s in events])
    if kind == "rdp":
        acc = dpa_rdp.RdpAccountant(orders=ORDERS, neighboring_relation=ADD_REMOVE)
    else:
        acc = DpaPLD(neighboring_relation=ADD_REMOVE, value_discretization_interval=1e-4)
    acc.compose(ev)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("kind", ["rdp", "pld"])
@pytest.mark.parametrize("bands", [1, 4])
def test_event_composes_with_the_steps_at_every_position(kind, bands):
    """T steps at (σ, q) and one Gaussian(σ_p) event = dp_accounting on ⌈T/b⌉ steps + the Gaussian.
    Had the event been a step of the history it would sit on one cyclic position and the worst
    position would pay ⌈T/b⌉ steps only: the values differ by far more than the tolerance (asserted)."""
    sigma, q, T, sigma_p = 1.1, 0.05, 30, 4.0
    acc = (RDPAccountant if kind == "rdp" else PLDAccountant)(bands=bands)
    for _ in range(T):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    acc.add_event(sigma_p)
    assert len(acc) == T
    truth = _truth([(sigma, q, -(-T // bands))], [sigma_p], DELTA, kind)
    rel = 1e-12 if kind == "rdp" else 1e-9  # the same composition summed in another order
    assert acc.get_epsilon(DELTA) == pytest.approx(truth, rel=rel)
    without = _truth([(sigma, q, -(-T // bands))], [], DELTA, kind)
    assert truth - without > 1e3 * rel * truth


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_event_alone(kind):
    acc = RDPAccountant() if kind == "rdp" else PLDAccountant()
    assert acc.get_epsilon(DELTA) == 0.0
    acc.add_event(7.0)
    assert len(acc) == 0
    assert acc.get_epsilon(DELTA) == pytest.approx(_truth([], [7.0], DELTA, kind), rel=1e-12)


@pytest.mark.parametrize("adjacency, rho_event", [("add_remove", 0.5 / 16.0), ("replace_one", 2.0 / 16.0)])
def test_zcdp_event(adjacency, rho_event):
    acc = ZCDPAccountant(adjacency=adjacency)
    for _ in range(10):
        acc.step(noise_multiplier=2.0, sample_rate=0.1)  # one epoch of 10 steps
    rho_steps = acc.rho
    acc.add_event(4.0)
    assert acc.rho == pytest.approx(rho_steps + rho_event, rel=1e-15)
    assert acc.get_epsilon(DELTA) == pytest.approx(gaussian_epsilon(math.sqrt(2 * acc.rho), DELTA), rel=1e-15)
    with pytest.raises(ValueError, match="sample_rate=1"):
        acc.add_event(4.0, sample_rate=0.5)


@pytest.mark.parametrize("cls", [RDPAccountant, PLDAccountant, ZCDPAccountant])
def test_state_dict_round_trip(cls):
    acc = cls()
    acc.step(noise_multiplier=1.5, sample_rate=0.1)
    acc.add_event(16.0)
    state = acc.state_dict()
    assert state["events"] == [(16.0, 1.0)]
    other = cls()
    other.load_state_dict(state)
    assert other.events == [(16.0, 1.0)] and len(other) == 1
    assert other.get_epsilon(DELTA) == acc.get_epsilon(DELTA)
    old = {k: v for k, v in state.items() if k != "events"}  # a state saved before events existed
    other.load_state_dict(old)
    assert other.events == []
    with pytest.raises(ValueError, match="events"):
        other.load_state_dict({**state, "events": [(0.0, 1.0)]})


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_calibration_leaves_room_for_the_event(kind):
    q, steps, target = 0.02, 200, 2.0
    plain = get_noise_multiplier(target_epsilon=target, target_delta=DELTA, sample_rate=q, steps=steps,
                                 accountant=kind)
    sigma = get_noise_multiplier(target_epsilon=target, target_delta=DELTA, sample_rate=q, steps=steps,
                                 accountant=kind, events=[(4.0, 1.0)])
    acc = RDPAccountant() if kind == "rdp" else PLDAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    acc.add_event(4.0)
    assert acc.get_epsilon(DELTA) <= target
    assert sigma > plain  # the steps alone at plain σ already spend about the target
    with pytest.raises(PrivacyBudgetError, match="one-off events"):
        get_noise_multiplier(target_epsilon=0.5, target_delta=DELTA, sample_rate=q, steps=steps,
                             accountant=kind, events=[(1.0, 1.0)])


# ---------------------------------------------------------------- the engine

def _setup(proj, n=64, d=18, batch_size=16):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 2, 3, 3, generator=g), torch.randint(0, 3, (n,), generator=g))
    model = nn.Sequential(proj, nn.Linear(proj.out_features, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, DataLoader(ds, batch_size=batch_size)


@pytest.mark.parametrize("clipping", ["backprop", "flat"])
def test_make_private_charges_the_projection(clipping):
    X = torch.randn(64, 18)
    proj = seeded(pca.private_pca, X, 5, 7.0, seed=0)
    model, opt, loader = _setup(proj)
    engine = PrivacyEngine()
    kw = dict(input_clip=1.0, grad_clip=1.0) if clipping == "backprop" else dict(max_grad_norm=1.0)
    model, opt, loader = seeded(engine.make_private, module=model, optimizer=opt, data_loader=loader,
                                noise_multiplier=1.0, clipping=clipping, noise_seed=1, **kw)
    assert engine.accountant.events == [(7.0, 1.0)] and len(engine.accountant) == 0
    assert engine.get_epsilon(DELTA) == pytest.approx(_truth([], [7.0], DELTA, "rdp"), rel=1e-12)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    q = engine.accounting_sample_rate
    truth = _truth([(engine.effective_noise_multiplier, q, 1)], [7.0], DELTA, "rdp")
    assert engine.get_epsilon(DELTA) == pytest.approx(truth, rel=1e-12)
    assert proj.components.grad is None


def test_make_private_refuses_a_non_private_projection():
    proj = pca.exact_pca(torch.randn(64, 18), 5)
    model, opt, loader = _setup(proj)
    with pytest.raises(ValueError, match="without noise"):
        seeded(PrivacyEngine().make_private, module=model, optimizer=opt, data_loader=loader,
               noise_multiplier=1.0, input_clip=1.0, grad_clip=1.0, noise_seed=1)


def test_make_private_with_epsilon_calibrates_with_the_projection():
    proj = seeded(pca.private_pca, torch.randn(64, 18), 5, 4.0, seed=0)
    model, opt, loader = _setup(proj)
    engine = PrivacyEngine()
    seeded(engine.make_private_with_epsilon, module=model, optimizer=opt, data_loader=loader, target_epsilon=3.0,
           target_delta=DELTA, epochs=5, input_clip=1.0, grad_clip=1.0, noise_seed=1)
    assert engine.accountant.events == [(4.0, 1.0)]
    after = engine.accountant.epsilon_after(DELTA, noise_multiplier=engine.effective_noise_multiplier,
                                            sample_rate=engine.accounting_sample_rate,
                                            num_steps=5 * engine.steps_per_epoch)
    assert after <= 3.0
    # the steps alone would leave ε well below the target: the event was counted in the calibration
    steps_only = RDPAccountant().epsilon_after(DELTA, noise_multiplier=engine.effective_noise_multiplier,
                                               sample_rate=engine.accounting_sample_rate,
                                               num_steps=5 * engine.steps_per_epoch)
    assert steps_only < 3.0 - 0.05


# ---------------------------------------------------------------- the trainer (--pca)

def test_trainer_pca_flag_charges_the_projection(tmp_path):
    from bpclip_fast.train.cli import cli_run

    out = tmp_path / "run"
    r = seeded(cli_run, ["--pca", "20", "--pca-noise", "4", "--sigma", "1.5", "--epochs", "1", "--limit", "200",
                         "--batch-size", "50", "--quiet", "--noise-seed", "3", "--out", str(out)])
    assert r["pca"] == {"components": 20, "in_features": 784, "noise_multiplier": 4.0, "rows": 200, "hidden": 256,
                        "private": True}
    assert r["privacy"]["accountant_events"] == [[4.0, 1.0]]
    history = [tuple(h) for h in r["privacy"]["accountant_history"]]
    truth = _truth(history, [4.0], DELTA, "rdp")
    assert r["epsilon"] == pytest.approx(truth, rel=1e-12)
    assert r["epsilons"]["pld"] == pytest.approx(_truth(history, [4.0], DELTA, "pld"), rel=1e-9)
    assert r["epsilon"] > _truth(history, [], DELTA, "rdp") + 0.1


def test_trainer_resume_keeps_the_released_components(tmp_path):
    from bpclip_fast.train.cli import cli_run

    ck = str(tmp_path / "ck.pt")
    args = ["--pca", "10", "--pca-noise", "4", "--sigma", "1.5", "--limit", "100", "--batch-size", "50", "--quiet",
            "--checkpoint", ck]
    seeded(cli_run, args + ["--epochs", "1"])
    saved = torch.load(ck, weights_only=False)["model"]["0.components"].clone()
    r = seeded(cli_run, args + ["--epochs", "2", "--resume"])
    assert torch.equal(torch.load(ck, weights_only=False)["model"]["0.components"], saved)
    assert r["privacy"]["accountant_events"] == [[4.0, 1.0]]


@pytest.mark.parametrize("kw, match", [
    (dict(method="dpsgd", pca=10, pca_noise=4.0), "Opacus"),
    (dict(method="bpclip", pca=10), "needs --pca-noise"),
    (dict(method="flat", pca=10, pca_noise=0.0), "needs --pca-noise"),
    (dict(method="nonprivate", pca=10, pca_noise=4.0), "not private"),
    (dict(method="bpclip", pca_noise=4.0), "needs --pca K"),
    (dict(method="bpclip", pca=10, pca_noise=4.0, model="mnist"), "own model"),
])
def test_trainer_refusals(kw, match):
    from bpclip_fast.train.trainer import Config

    with pytest.raises(ValueError, match=match):
        Config(**kw).resolved()
