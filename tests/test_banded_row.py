"""A layer's correlated-noise rows made in place in the ring by ``_ops.banded_row_`` (``LayerBand``):
each row against the float64 recursion of the regenerated draws, within the fp32 bound carried
through the recursion; the ring holding the newest ``b−1`` made rows; the gradients getting exactly
the stored row."""

from __future__ import annotations

import pytest
import torch

from bpclip_fast import _ops, banded


def _draw(key, numel, dtype):
    """The row's normals: float64 rows draw float64 normals, float32 rows float32 ones."""
    z = torch.empty(numel, dtype=dtype)
    _ops.philox_noise_(z, *key, 1.0)
    return z.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bands", [2, 3, 6])
def test_rows_follow_the_float64_recursion_with_skips_and_outs(dtype, bands):
    c = banded.bsr_coefficients(bands)
    noise = banded.BandedNoise(c)
    key = lambda row: (1234 + row, (row << 20) | 7)  # noqa: E731
    layer = noise.layer(key)
    numel, std = 1037, 0.8
    like = torch.zeros(1, dtype=dtype)
    u = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -53
    k = bands + 2
    gamma = k * u / (1 - k * u)  # one row's rounding: Higham's γ for b + 1 rounded products and b additions
    w = {}    # float64 truth, from the regenerated draws
    err = {}  # bound on |made − truth|, carried through the recursion
    made = {}
    weights = [-c[a] / c[0] for a in range(1, bands)]
    # rows 3, 4, then 8 (5, 6, 7 caught up from their own draws), then a charge through 10 (9, 10 made)
    for r, with_outs in ((3, True), (4, False), (8, True)):
        g0 = torch.randn(numel - 40, dtype=dtype)
        g1 = torch.randn(30, dtype=dtype)
        before = (g0.clone(), g1.clone())
        slot = layer.row(r, std, like, numel, *(([g0, g1], [0, numel - 30]) if with_outs else ((), ())))
        assert layer.made(r) and not layer.made(r + 1) and layer.next_row == r + 1
        made[r] = slot.double().clone()
        if with_outs:  # exactly out + the stored row: one rounding in the out's dtype
            assert torch.equal(g0, before[0] + slot[:numel - 40])
            assert torch.equal(g1, before[1] + slot[numel - 30:])
        else:
            assert torch.equal(g0, before[0])
        # the ring holds the newest b−1 made rows: ring[newest] is this one, age a at newest − a + 1
        assert torch.equal(layer.newest_row(), slot)
    layer.commit_through(10, std, like, numel)
    assert layer.next_row == 11
    for a in range(1, bands):
        made.setdefault(11 - a, layer.ring[(layer.newest - a + 1) % (bands - 1)].double().clone())
    for r in range(3, 11):
        z = _draw(key(r), numel, dtype)
        terms = [std / c[0] * z] + [weights[a - 1] * w.get(r - a, torch.zeros(numel, dtype=torch.float64))
                                    for a in range(1, bands)]
        w[r] = sum(terms)
        carried = sum(abs(weights[a - 1]) * err.get(r - a, 0.0) for a in range(1, bands))
        # the made rows it was computed from differ from the truth by err: their terms by |weight|·err
        err[r] = gamma * (sum(t.abs() for t in terms) + carried) + carried
        if r in made:
            assert bool(((made[r] - w[r]).abs() <= err[r]).all()), r
    with pytest.raises(RuntimeError, match="already made"):
        layer.row(10, std, like, numel)


def test_made_rows_are_history_at_once_and_restart_forgets_them():
    layer = banded.BandedNoise(banded.bsr_coefficients(3)).layer(lambda r: (5, r))
    like = torch.zeros(1)
    assert not layer.made(0) and layer.next_row is None
    layer.commit_through(0, 1.0, like, 10)  # nothing made since the start: the block has not begun
    assert layer.ring is None and not layer.made(0)
    first = layer.row(1, 1.0, like, 10).clone()
    second = layer.row(2, 1.0, like, 10).clone()
    # both stored, no separate current row: the slot of age 2 is row 1, of age 1 row 2
    assert torch.equal(layer.ring[layer.newest], second)
    assert torch.equal(layer.ring[(layer.newest - 1) % 2], first)
    layer.restart()
    assert layer.next_row is None and bool((layer.ring == 0).all())


def test_a_row_the_op_cannot_add_to_is_added_by_the_caller():
    """Gradients the one-pass op cannot take (non-contiguous here) are refused by the op's check, which
    the layer's caller reads to make the row alone and add it (LayerStep.make_band)."""
    ring = torch.zeros(2, 12)
    g = torch.zeros(4, 3).t()
    assert "not contiguous" in _ops.banded_row_outs_problem(ring, 12, [g], [0])
    assert _ops.banded_row_outs_problem(ring, 12, [g.contiguous()], [0]) is None
    assert "float64" in _ops.banded_row_outs_problem(ring, 12, [torch.zeros(12, dtype=torch.float64)], [0])
    assert "at most" in _ops.banded_row_outs_problem(ring, 12, [torch.zeros(1)] * 5, list(range(5)))


def test_engine_gradients_are_the_same_whether_the_op_or_the_caller_adds_the_row(monkeypatch):
    """The backward's gradients get the row inside the op (LayerStep.make_band's fused path) or, where the op
    cannot take them, from the returned slot by add_band: the same one rounding of g + w either way, so a
    run is bit for bit the same; a layer no backward reached (the fallback at step()) gets its row too."""
    import warnings

    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import bpclip_fast
    from bpclip_fast import boundary
    from bpclip_fast.engine._common import InsecureSeedWarning

    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(64, 12, generator=g), torch.randint(0, 3, (64,), generator=g)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused = nn.Linear(12, 24), nn.Linear(24, 3), nn.Linear(5, 2)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    def released(calls):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = bpclip_fast.PrivacyEngine("rdp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InsecureSeedWarning)
            model, opt, loader = engine.make_private(
                module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(X, Y), batch_size=4),
                noise_multiplier=0.7, clipping="flat", noise="banded", bands=3, noise_seed=99, max_grad_norm=1.0)
        out = []
        it = iter(loader)
        for _ in range(5):
            x, y = next(it)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        calls.append(engine)
        return torch.stack(out)

    fused_calls, fused = [], None
    original = boundary.LayerStep.add_band
    added = []

    def counting_add_band(self, grads, w):
        added.append(self.name)
        return original(self, grads, w)

    monkeypatch.setattr(boundary.LayerStep, "add_band", counting_add_band)
    fused = released(fused_calls)
    assert added == []  # every row went in through the op
    monkeypatch.setattr(_ops, "banded_row_outs_problem", lambda like, numel, outs, starts: "refused here" if outs else None)
    separate = released([])
    assert len(added) == 5 * 3  # three layers (one reached by no backward), five steps
    assert torch.equal(fused, separate)
    # the unused layer's released gradient is its row alone: zeros + w
    engine = fused_calls[0]
    st = next(s for s in engine._steps_of if s.params[0].shape == (2, 5))
    assert torch.equal(fused[-1][-12:], st.band.newest_row())
