"""The clipping modes as objects (bpclip_fast.modes): the lookup, and that every mode answers the
whole interface (a mode missing a rule would raise NotImplementedError mid-set-up)."""

import pytest
from torch import nn

from bpclip_fast import exact, modes, registry
from bpclip_fast import nn as bnn


def test_names_have_one_home():
    assert exact.MODES is modes.NAMES and exact.EXACT_MODES is modes.EXACT
    assert tuple(modes.strategy(name).name for name in modes.NAMES) == modes.NAMES
    assert tuple(n for n in modes.NAMES if modes.strategy(n).exact) == modes.EXACT
    assert registry.layer_type(nn.Linear(2, 2)).modes == modes.NAMES


@pytest.mark.parametrize("name", ["Backprop", "flat ", None, ["flat"]])
def test_unknown_mode_is_refused_as_before(name):
    with pytest.raises(ValueError, match=r"^make_private: clipping must be one of \('backprop', 'flat', 'per_layer'\), "
                                         rf"got {name!r}".replace("[", r"\[").replace("]", r"\]")):
        modes.strategy(name, "make_private")


@pytest.mark.parametrize("name", modes.NAMES)
def test_every_mode_answers_the_interface(name):
    mode = modes.strategy(name)
    bounds = (1.0, 2.0, None) if name == "backprop" else (None, None, 3.0)
    mode.check_request(*bounds)
    assert mode.layer_bounds("Linear", *bounds) == bounds
    assert mode.sigma_factor(4) == (2.0 if name == "backprop" else 1.0)
    assert mode.effective_sigma(2.0, 4) == pytest.approx(1.0 if name == "backprop" else 2.0, rel=1e-12)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    kw = dict(input_clip=1.0, grad_clip=2.0) if name == "backprop" else dict(max_grad_norm=3.0)
    layers = [layer for _, layer in bnn.clipped_layers(bnn.convert_model(model, clipping=name, **kw))]
    slots = mode.threshold_slots(layers)
    assert len(slots) == (1 if mode.collects else len(layers) * len(mode.threshold_attrs))
    assert (mode.collector(layers) is not None) == mode.collects
    mode.set_thresholds(layers, [float(getattr(ls[0], attr)) for _, ls, attr in slots], mode.collector(layers))
    assert mode.step_problems([]) == []
