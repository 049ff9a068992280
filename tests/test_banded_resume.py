"""A resumed banded run continues the correlation: ``PrivacyEngine.noise_state_dict()`` (the last
``b−1`` rows of every layer, secret, never in ``state_dict``, no seed) loaded after the checkpoint
makes the resumed rows solve ``C·w = σΔ·z`` with the history the first process released, and every
mismatch (another checkpoint, other coefficients, another model, a step in progress, tampered rows)
is refused before anything is assigned."""

from __future__ import annotations

import pytest
import torch

from bpclip_fast import banded
from test_banded_noise import EPS32, data, layer_rows, make, run


def _stds(engine):
    from bpclip_fast.engine import correlated
    return torch.cat([torch.full((st.band_layout()[1],), correlated.std(engine, st), dtype=torch.float64)
                      for st in engine._steps_of])


def _recursion_holds(engine, W, t):
    """Row ``t`` of ``W`` (the released rows, float64) solves the recursion with ``engine``'s draw
    for ``t``, to the fp32 rounding of ≤ b terms (the bound of test_banded_noise)."""
    c, stds = engine.band_coefficients, _stds(engine)
    y = sum(c[j] * W[t - j] for j in range(len(c)) if t - j >= 0)
    z = layer_rows(engine, t)
    scale = stds * z.abs() + sum(abs(c[j]) * W[t - j].abs() for j in range(1, len(c)) if t - j >= 0)
    return bool(((y - stds * z).abs() <= 2 * len(c) * EPS32 * scale + 1e-30).all())


def _first(X, Y, steps=5, **kw):
    first = make(X, Y, bands=4, seed=None, **kw)
    W, _ = run(*first, steps, zero_loss=True)
    return first, W, first[2].state_dict(), first[0].noise_state_dict()


def test_a_resume_with_the_noise_rows_continues_the_band():
    X, Y = data()
    first, WA, state, rows = _first(X, Y)
    second = make(X, Y, bands=4, seed=None)
    second[2].load_state_dict(state)
    second[0].load_noise_state_dict(rows)
    assert second[0]._stream.seed != first[0]._stream.seed  # fresh draws: a second resume is not the same noise
    WB, batches = run(*second, 4, zero_loss=True)
    assert batches == [5, 6, 7, 8]
    W = torch.cat([WA, WB])
    assert all(_recursion_holds(second[0], W, t) for t in range(5, 9))
    # the check can fail: a resume without the rows starts a new band, whose first row ignores the history
    third = make(X, Y, bands=4, seed=None)
    third[2].load_state_dict(state)
    WC, _ = run(*third, 1, zero_loss=True)
    assert not _recursion_holds(third[0], torch.cat([WA, WC]), 5)


def test_the_rows_are_exported_as_they_were_kept_and_hold_no_seed():
    X, Y = data()
    first, WA, state, rows = _first(X, Y)
    seed = first[0]._stream.seed

    def ints(v):
        if isinstance(v, dict):
            return [i for x in v.values() for i in ints(x)]
        if isinstance(v, (list, tuple)):
            return [i for x in v for i in ints(x)]
        return [v] if isinstance(v, int) else []

    assert seed not in ints(rows) and "secrets" not in state["bpclip_fast_privacy_engine"]
    assert not any(isinstance(v, torch.Tensor) and v.numel() >= 24 for v in state["bpclip_fast_privacy_engine"].values())
    # oldest first: the newest saved row is the last released one, exactly (zero loss: the release is the row)
    flat = torch.cat([layer["rows"][-1].double() for layer in rows["layers"].values()])
    assert torch.equal(flat, WA[-1])
    second = make(X, Y, bands=4, seed=None)
    second[2].load_state_dict(state)
    second[0].load_noise_state_dict(rows)
    for st, saved in zip(second[0]._steps_of, rows["layers"].values()):
        again, next_row = st.band.export_rows()
        assert torch.equal(again, saved["rows"]) and next_row == saved["next_row"] == 5


def test_a_checkpoint_before_the_first_step_resumes_with_no_rows():
    X, Y = data()
    first = make(X, Y, bands=4, seed=None)
    state, rows = first[2].state_dict(), first[0].noise_state_dict()
    assert all(layer["rows"] is None for layer in rows["layers"].values())
    second = make(X, Y, bands=4, seed=None)
    second[2].load_state_dict(state)
    second[0].load_noise_state_dict(rows)
    W, batches = run(*second, 3, zero_loss=True)
    assert batches == [0, 1, 2] and all(_recursion_holds(second[0], W, t) for t in range(3))


def _tamper(rows, key, fn):
    out = {**rows, "layers": {k: dict(v) for k, v in rows["layers"].items()}}
    name = next(iter(out["layers"]))
    out["layers"][name][key] = fn(out["layers"][name][key])
    return out


@pytest.mark.parametrize("case, error, match", [
    ("no checkpoint", ValueError, "belong to a checkpoint"),
    ("drawn", RuntimeError, "has drawn batches"),
    ("momentum", ValueError, "coefficients"),
    ("model", ValueError, "do not fit|layers"),
    ("nan", ValueError, "finite"),
    ("dtype", ValueError, "finite torch.float32"),
    ("next_row", ValueError, "do not fit"),
    ("format", ValueError, "not a banded noise state"),
])
def test_what_cannot_continue_the_band_is_refused_before_anything_is_assigned(case, error, match):
    X, Y = data()
    _, _, state, rows = _first(X, Y)
    second = make(X, Y, bands=4, seed=None, width=25 if case == "model" else 24)
    if case != "no checkpoint":
        second[2].load_state_dict(state)
    if case == "momentum":  # what a run with SGD(momentum=0.9) saved: other coefficients, the same bands
        rows = {**rows, "coefficients": list(banded.bsr_coefficients(4, 0.9))}
    if case == "drawn":
        next(iter(second[3]))
    if case == "nan":
        rows = _tamper(rows, "rows", lambda r: r.clone().fill_(float("nan")))
    if case == "dtype":
        rows = _tamper(rows, "rows", lambda r: r.double())
    if case == "next_row":
        rows = _tamper(rows, "next_row", lambda r: r + 3)
    if case == "format":
        rows = {**rows, "format": "something else"}
    before = [st.band.export_rows() for st in second[0]._steps_of]
    with pytest.raises(error, match=match):
        second[0].load_noise_state_dict(rows)
    after = [st.band.export_rows() for st in second[0]._steps_of]
    assert all(a[1] == b[1] and (a[0] is None) == (b[0] is None) for a, b in zip(before, after))


def test_the_rows_are_saved_only_between_steps_and_only_under_banded_noise():
    X, Y = data()
    engine, model, opt, loader = make(X, Y, bands=4, seed=None)
    x, y = next(iter(loader))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="step is in progress"):
        engine.noise_state_dict()
    opt.step()
    engine.noise_state_dict()
    independent = make(X, Y, noise="independent", bands=1, seed=None)
    with pytest.raises(ValueError, match="independent noise"):
        independent[0].noise_state_dict()
