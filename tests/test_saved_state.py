"""A saved or copied private model holds nothing data-dependent (issue 24, finding 4).

The attack: every clipped layer counts the examples it dropped as non-finite (NaN/Inf, or a norm
that overflowed). If that counter travels with ``torch.save(model)``, ``pickle`` or
``copy.deepcopy(model)``, a published model tells whether a NaN canary (or a finite example whose
norm overflows) was ever sampled: a membership oracle the accountant never charged.

Two runs differ only in one example (a NaN, or a finite 1e200 in float64, whose squared norm
overflows even in fp64 and so is counted) against the same example made ordinary. Each run takes one
private step with the same explicit seed in a fresh interpreter (so that hook ids and every other
process counter line up), then zeroes the parameters: the released parameters may differ, that is
the noisy release itself; everything else that leaves must be identical, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

# The modes and the example that makes their counter move (checked by the live engine in each run).
CASES = {
    "backprop-nan": ("backprop", "float32", float("nan")),
    "flat-nan": ("flat", "float32", float("nan")),
    "per_layer-nan": ("per_layer", "float32", float("nan")),
    "backprop-finite-1e200-float64": ("backprop", "float64", 1e200),
}


def saved_forms(mode: str, dtype: str, bad) -> dict:
    """In a fresh interpreter: one private step on ``data()`` with example 1 set to ``bad`` (or left as
    it is for ``bad=None``); ``{"hashes": {form: sha256}, "counts": engine.nonfinite_counts()}``."""
    import copy
    import io
    import pickle
    import warnings
    import zipfile

    import torch

    from test_guarantee import data, legit_step, mlp, private

    def torch_save(obj) -> str:
        buf = io.BytesIO()
        torch.save(obj, buf)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:  # the serialization id is unique per save
            records = sorted((n, z.read(n)) for n in z.namelist() if not n.endswith("serialization_id"))
        return hashlib.sha256(repr(records).encode()).hexdigest()

    class Digest(pickle.Pickler):
        """pickle.dumps with each tensor replaced by its exact contents (a pickled tensor embeds a
        torch.save of its storage, with a fresh serialization id)."""

        def persistent_id(self, o):
            if isinstance(o, torch.Tensor):
                t = o.detach().cpu().contiguous().reshape(-1)
                return ("tensor", type(o).__name__, str(o.dtype), tuple(o.shape), t.view(torch.uint8).numpy().tobytes())
            return None

    def pickled(obj) -> str:
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that tensor hooks are not pickled
            Digest(buf, protocol=4).dump(obj)
        return hashlib.sha256(buf.getvalue()).hexdigest()

    torch.set_num_threads(1)
    X, Y = data()
    X = X.to(getattr(torch, dtype))
    if bad is not None:
        X[1] = float(bad)
    kw = {} if mode == "backprop" else dict(input_clip=None, grad_clip=None, clipping=mode, max_grad_norm=1.0)
    engine, model, opt, loader = private(mlp().to(getattr(torch, dtype)), X, Y, **kw)
    legit_step(model, opt, loader)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            p.grad = None
    hashes = {
        "torch.save(model)": torch_save(model),
        "torch.save(copy.deepcopy(model))": torch_save(copy.deepcopy(model)),
        "pickle.dumps(model)": pickled(model),
        "pickle.dumps(copy.deepcopy(model))": pickled(copy.deepcopy(model)),
        "pickle.loads(pickle.dumps(model))": pickled(pickle.loads(pickle.dumps(model))),
        "torch.save(model.state_dict())": torch_save(model.state_dict()),
        "dict(model.named_buffers())": torch_save(dict(model.named_buffers())),
        "torch.save(optimizer.state_dict())": torch_save(opt.state_dict()),
    }
    return {"hashes": hashes, "counts": engine.nonfinite_counts()}


def run_fresh(mode: str, dtype: str, bad) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_saved_state as t; "
            "print(json.dumps(t.saved_forms(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))))")
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code, HERE, mode, dtype, json.dumps(bad)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_a_saved_or_copied_model_does_not_reveal_a_dropped_example(case):
    mode, dtype, bad = CASES[case]
    canary = run_fresh(mode, dtype, bad)
    plain = run_fresh(mode, dtype, None)
    assert any(any(c) for c in canary["counts"].values()), (
        f"{case}: the live engine did not count the example ({canary['counts']}), so this test shows nothing")
    assert not any(any(c) for c in plain["counts"].values()), plain["counts"]
    differ = [form for form in canary["hashes"] if canary["hashes"][form] != plain["hashes"][form]]
    assert not differ, (f"{case}: these saved or copied forms of the private model differ between a run that sampled "
                        f"the example and one that did not (a membership oracle, not charged): {differ}")


def test_the_saved_forms_are_deterministic():
    """The comparison above can fail only through the data: two identical runs give identical forms."""
    a, b = run_fresh("backprop", "float32", None), run_fresh("backprop", "float32", None)
    assert a["hashes"] == b["hashes"]


@pytest.mark.parametrize("what", ["engine", "optimizer", "sampler"])
@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_engine_and_optimizer_refuse_to_be_saved_whole(what, how):
    """The engine (and the DPOptimizer, which holds it) carries the secret noise seed: pickled whole it
    would put the seed in a file, and a copy would continue the same draws; the private loader's
    sampler carries the sampling seed (which examples each step used). Both refuse with a message
    that names what to save instead; optimizer.state_dict() stays the way to checkpoint."""
    import copy
    import io
    import pickle

    import torch

    from test_guarantee import data, legit_step, mlp, private

    X, Y = data()
    engine, model, opt, loader = private(mlp(), X, Y)[0:4]
    legit_step(model, opt, loader, None)
    obj = {"engine": engine, "optimizer": opt, "sampler": loader.batch_sampler}[what]
    save = {"pickle": pickle.dumps, "deepcopy": copy.deepcopy, "torch.save": lambda o: torch.save(o, io.BytesIO())}
    with pytest.raises(TypeError, match="secret (noise|sampling) seed.*optimizer.state_dict"):
        save[how](obj)
    privacy = opt.state_dict()["bpclip_fast_privacy_engine"]
    assert "secrets" not in privacy and engine._seed not in privacy.values()
