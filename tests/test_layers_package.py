"""The clipped layer types live in :mod:`bpclip_fast.layers` (one file per type, issue 26) and keep
their public names in :mod:`bpclip_fast.nn`.

A pickle names a class by module and qualified name. Every model pickled before the layers moved
names ``bpclip_fast.nn.Linear`` (and so on), and user code imports ``from bpclip_fast.nn import
Linear``: both must keep working, and importing the package alone must register every type (a
pickle that loads ``bpclip_fast.nn`` before anything else must find the registry complete).
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys

import torch
from torch import nn

import bpclip_fast.nn as bnn
from bpclip_fast import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(data: bytes):
    """``(object, the (module, name) pairs it imported)``: what unpickling looks up, as it looks it up."""
    found = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            found.add((module, name))
            return super().find_class(module, name)

    return Recorder(io.BytesIO(data)).load(), found


def _old_pickle(model, monkeypatch, protocol) -> bytes:
    """``model`` pickled as the code before the move pickled it: its clipped classes under
    ``bpclip_fast.nn`` (pickle checks that the class found at that path is the very class)."""
    for m in model.modules():
        if isinstance(m, bnn._Clipped):
            monkeypatch.setattr(type(m), "__module__", "bpclip_fast.nn")
    data = pickle.dumps(model, protocol=protocol)
    monkeypatch.undo()
    return data


def _model():
    torch.manual_seed(0)
    return bnn.convert_model(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)),
                             clipping="per_layer", max_grad_norm=1.0)


def test_a_model_pickled_with_the_old_class_path_loads(monkeypatch):
    model = _model()
    x = torch.randn(5, 3)
    for protocol in (2, pickle.DEFAULT_PROTOCOL):
        data = _old_pickle(model, monkeypatch, protocol)
        loaded, found = _load(data)
        assert {("bpclip_fast.nn", "Linear"), ("bpclip_fast.nn", "LayerNorm")} <= found
        assert type(loaded[0]) is bnn.Linear and type(loaded[1]) is bnn.LayerNorm
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    # The same through torch.save/torch.load (the full-model checkpoint path).
    buf = io.BytesIO()
    for m in model.modules():
        if isinstance(m, bnn._Clipped):
            monkeypatch.setattr(type(m), "__module__", "bpclip_fast.nn")
    torch.save(model, buf)
    monkeypatch.undo()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded[2]) is bnn.Linear
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_an_old_pickle_loads_in_a_fresh_interpreter(monkeypatch, tmp_path):
    """Unpickling imports ``bpclip_fast.nn`` first: the classes and the whole registry are there."""
    path = tmp_path / "model.pkl"
    path.write_bytes(_old_pickle(_model(), monkeypatch, pickle.DEFAULT_PROTOCOL))
    # The optional libraries' types register once their library is imported (registry.load_optional):
    # the fresh interpreter imports those this one has.
    expected = sorted(e.torch_type.__name__ for e in registry.layer_types())
    optional = "".join(f"import {name}; " for name in registry._OPTIONAL_LOADED)
    code = ("import pickle, sys; m = pickle.load(open(sys.argv[1], 'rb')); " + optional +
            "from bpclip_fast import registry; "
            "print(type(m[0]).__name__, sorted(t.torch_type.__name__ for t in registry.layer_types()))")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(" ", 1) == ["Linear", f"{expected}\n"]


def test_every_registered_clipped_type_keeps_its_public_name():
    entries = list(registry._LAYERS.values())
    assert entries
    for entry in entries:
        name = entry.clipped_type.__name__
        assert getattr(bnn, name) is entry.clipped_type, name
        assert entry.clipped_type.__module__.startswith("bpclip_fast.layers."), name
