"""Found by the thirteenth attack review (correlated noise: the fused row op, the resumed band, one
std per layer, the 'converted' rule)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bpclip_fast
from test_banded_noise import data, make, run


def _backward(model, x, y):
    dtype = next(model.parameters()).dtype
    nn.functional.cross_entropy(model(x.to(dtype)), y).backward()


@pytest.mark.parametrize("convert", ["double()", "data of another dtype"])
def test_a_banded_model_converted_after_its_first_step_is_refused_as_converted(convert):
    """Under banded noise a layer's ring of noise rows is allocated at its first row, in the parameters'
    dtype. A model converted after that (model.double(), p.data = ...) crashed inside the backward with
    a bare RuntimeError naming no layer and no fix, before the 'converted' rule could refuse it; the
    refusal's charge then crashed too (the charge makes the rows of the refused batch in the ring's
    dtype). It must be refused as 'converted', charged, with nothing released, step after step."""
    X, Y = data()
    engine, model, opt, loader = make(X, Y, bands=3)
    run(engine, model, opt, loader, 2)
    if convert == "double()":
        model.double()
    else:
        for p in model.parameters():
            p.data = p.data.double()
    it = iter(loader)
    for attempt in range(2):
        x, y = next(it)
        opt.zero_grad()
        with pytest.raises(bpclip_fast.StepRefused) as info:
            _backward(model, x, y)
        exc = info.value
        assert exc.rule == "converted" and exc.charged, (exc.rule, str(exc))
        assert "before make_private" in str(exc) and "float64" in str(exc)
        assert len(engine.accountant) == 3 + attempt
        assert all(p.grad is None for p in model.parameters())


def test_the_rows_of_another_run_are_refused():
    """``load_noise_state_dict`` paired the rows with the checkpoint by its counters alone, so the rows of
    another run at the same step were continued. That run's groups are another partition of the data:
    an example in its last batches and in this run's first batches after the seam would have
    overlapping columns of ``C`` (b-min-separation broken across the seam), and this run's releases would
    carry the other run's secret rows. Refused: the rows belong to the run whose groups (partition
    seed) the checkpoint restored."""
    X, Y = data()
    first = make(X, Y, bands=4, seed=None)
    run(*first, 5, zero_loss=True)
    other = make(X, Y, bands=4, seed=None)
    run(*other, 5, zero_loss=True)
    state, foreign = other[2].state_dict(), first[0].noise_state_dict()
    assert first[0].data_loader.batch_sampler.partition_seed != other[0].data_loader.batch_sampler.partition_seed
    resumed = make(X, Y, bands=4, seed=None)
    resumed[2].load_state_dict(state)
    with pytest.raises(ValueError, match="another run|partition"):
        resumed[0].load_noise_state_dict(foreign)
    assert all(st.band.next_row is None for st in resumed[0]._steps_of)
    # the check can pass: the other run's own rows continue its band
    resumed[0].load_noise_state_dict(other[0].noise_state_dict())
    assert all(st.band.next_row == 5 for st in resumed[0]._steps_of)


@pytest.mark.parametrize("mode", ["flat", "per_layer", "backprop"])
def test_micro_batches_get_the_row_once(mode):
    """Checked and found sound (a regression test, passes on the reviewed code): with two backward passes
    per step, the row is made into the first pass's gradients and the second pass accumulates onto
    them without a draw, so the released gradient (zero loss: the noise alone) is exactly the stored
    row, never twice it or none of it."""
    X, Y = data()
    engine, model, opt, loader = make(X, Y, bands=3, mode=mode)
    it = iter(loader)
    for _ in range(4):
        x, y = next(it)
        opt.zero_grad()
        h = len(x) // 2
        with opt.accumulate():
            for part in (slice(0, h), slice(h, None)):
                (nn.functional.cross_entropy(model(x[part]), y[part], reduction="sum") * 0).backward()
        released = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        stored = torch.cat([st.band.newest_row() for st in engine._steps_of])
        assert torch.equal(released, stored) and bool(stored.ne(0).any())
        opt.step()
    assert len(engine.accountant) == 4
