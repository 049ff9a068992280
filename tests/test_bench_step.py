"""Smoke test of the step benchmark (bench/step.py): one tiny grid, every method, valid records."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FIELDS = ("model", "method", "batch_size", "device", "step_ms_median", "step_ms_min", "step_ms_max",
          "step_ms_iqr", "peak_mem_mb", "mem_increase_mb", "status", "n_steps", "threads", "versions")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    pytest.importorskip("opacus")
    import bpclip_fast

    if not bpclip_fast._ops.extension_loaded():
        pytest.skip("the bpclip_fast extension is not built")
    out = tmp_path_factory.mktemp("bench_step")
    cmd = [sys.executable, "-m", "bench.step", "--models", "mnist", "--batch-sizes", "8", "--reps", "2",
           "--warmup", "1", "--warmup-time", "0", "--steps", "2", "--min-time", "0", "--threads", "1",
           "--timeout", "60", "--json", str(out / "r.json"), "--md", str(out / "r.md"),
           "--plot", str(out / "r.png")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_records(bench_run):
    out, _ = bench_run
    sys.path.insert(0, str(ROOT))  # bench/ is not an installed package
    from bench.step import DEFAULT_METHODS

    records = json.loads((out / "r.json").read_text())
    assert sorted(r["method"] for r in records) == sorted(DEFAULT_METHODS)  # flat_generic: on request
    for r in records:
        missing = [f for f in FIELDS if f not in r]
        assert not missing, (r["method"], missing)
        assert r["model"] == "mnist" and r["batch_size"] == 8 and r["device"] == "cpu" and r["threads"] == 1
        assert r["status"] == "ok", (r["method"], r.get("errors"))
        assert r["n_steps"] == 4 and r["n_reps"] == 2 and len(r["rep_medians_ms"]) == 2
        assert 0 < r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"] and math.isfinite(r["step_ms_max"])
        assert r["step_ms_iqr"] >= 0
        assert r["peak_mem_mb"] > r["mem_base_mb"] > 0 and r["mem_increase_mb"] > 0
        # live tensor bytes: at least the parameters and their gradients (fp32)
        assert r["live_peak_mb"] >= 2 * 4 * r["params"] / 2 ** 20, r
        assert r["versions"]["torch"] and r["versions"]["opacus"]


def test_table_and_plot(bench_run):
    out, stdout = bench_run
    md = (out / "r.md").read_text()
    for method in ("nonprivate", "bpclip_fast", "opacus_ghost"):
        assert f"| mnist | 8 | {method} |" in md and f"| mnist | 8 | {method} |" in stdout
    assert "| mnist | 8 | nonprivate |" in md and "1.00× (1.00×)" in md
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failures_are_recorded(tmp_path):
    """A child that runs past --timeout becomes a record with status 'timeout', not a missing row."""
    cmd = [sys.executable, "-m", "bench.step", "--models", "cifar10", "--batch-sizes", "4", "--methods",
           "nonprivate", "--reps", "2", "--threads", "1", "--timeout", "0.05", "--json", str(tmp_path / "r.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rec,) = json.loads((tmp_path / "r.json").read_text())
    assert rec["status"] == "timeout" and rec["step_ms_median"] is None and rec["n_reps"] == 1
    assert "| cifar10 | 4 | nonprivate |" in proc.stdout and "timeout" in proc.stdout


def test_backprop_clipping_is_unsupported_on_the_exact_clipping_models(tmp_path):
    """vit and resnet20-gn train LayerNorm/GroupNorm/embeddings, which backpropagation clipping does not
    bound: its two methods are recorded as unsupported (not run with those layers unclipped)."""
    cmd = [sys.executable, "-m", "bench.step", "--models", "vit,resnet20-gn", "--batch-sizes", "4", "--methods",
           "nonprivate,bpclip_fast,bpclip_reference", "--reps", "1", "--warmup", "1", "--warmup-time", "0",
           "--steps", "1", "--min-time", "0", "--threads", "1", "--timeout", "60", "--json", str(tmp_path / "r.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {(r["model"], r["method"]): r for r in json.loads((tmp_path / "r.json").read_text())}
    assert len(records) == 6
    for model in ("vit", "resnet20-gn"):
        assert records[(model, "nonprivate")]["status"] == "ok"
        for method in ("bpclip_fast", "bpclip_reference"):
            rec = records[(model, method)]
            assert rec["status"] == "unsupported" and rec["step_ms_median"] is None, rec
            assert "Norm" in " ".join(rec["errors"]), rec


def test_live_bytes_is_the_peak_of_live_tensors():
    """LiveBytes sums allocations and frees in time order: 8 MB + 16 MB live together, then 4 MB."""
    import torch

    sys.path.insert(0, str(ROOT))
    from bench.probes import LiveBytes

    live = LiveBytes(True)
    if live.prof is None:
        pytest.skip("torch.profiler cannot record memory here")
    mb = 2 ** 20
    a = torch.empty(8 * mb, dtype=torch.uint8)
    b = torch.empty(16 * mb, dtype=torch.uint8)
    del a
    c = torch.empty(4 * mb, dtype=torch.uint8)
    del b, c
    live.stop()
    if live.peak_mb is None:
        pytest.skip("torch's profiler event tree is unavailable")
    assert 24.0 <= live.peak_mb < 24.1


def test_fixed_mmap_threshold_is_applied(tmp_path):
    """--mmap-threshold-mb reaches the child's allocator (mallopt succeeds) and is recorded."""
    pytest.importorskip("opacus")
    cmd = [sys.executable, "-m", "bench.step", "--models", "mnist", "--batch-sizes", "8", "--methods", "nonprivate",
           "--reps", "1", "--warmup", "1", "--warmup-time", "0", "--steps", "2", "--min-time", "0", "--threads", "1",
           "--mmap-threshold-mb", "1", "--json", str(tmp_path / "r.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rec,) = json.loads((tmp_path / "r.json").read_text())
    assert rec["status"] == "ok" and rec["mmap_threshold_mb"] == 1.0 and rec["mallopt_ok"] is True


def test_norm_cost_runs_and_reports_every_case(monkeypatch, capsys):
    """bench/norm_cost.py calls the norm ops directly, so a change of their schema breaks it without
    any other test noticing (it did once: the ``keep`` argument)."""
    import bpclip_fast

    if not bpclip_fast._ops.extension_loaded():
        pytest.skip("the bpclip_fast extension is not built")
    sys.path.insert(0, str(ROOT))
    from bench import norm_cost

    cases = [("small conv", "conv", 4, (3, 8, 8, 4, 3, 1, 1, 1)), ("small linear", "linear", 4, (5, 6, 7))]
    monkeypatch.setattr(norm_cost, "CASES", cases)
    norm_cost.main(["--reps", "1"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| small")]
    assert [r.split(" | ")[0][2:] for r in rows] == ["small conv", "small linear"]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert float(cells[5]) >= 0 and float(cells[6]) >= 0 and cells[7] in ("ghost", "instantiate")


def test_flat_generic_trains_every_layer_by_the_generic_path():
    # bench's flat_generic measures the fused paths against the generic one on the same model: every
    # layer of a registered type must become a generic unit, and its step must change the weights.
    import torch

    from bench.methods import build_step
    from bench.models import MODELS
    from bpclip_fast import registry

    factory, shape, classes = MODELS["lstm"]  # a composite (LSTM) and a fused Linear
    torch.manual_seed(0)
    model = factory()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(3, *shape), torch.randint(0, classes, (3,))
    step, wrapped = build_step("flat_generic", model, x, y, seed=1)
    step()
    trained = [m for m in wrapped.modules() if registry.owns_trainable(m)]
    assert len(trained) == 2 and all(registry.is_generic(m) and registry.layer_type(m) is None for m in trained)
    assert all(not torch.equal(a, p) for a, p in zip(before, wrapped.parameters()))


def test_flat_instantiate_trains_with_every_layers_gradients_instantiated():
    # bench's flat_instantiate measures kept instantiation against the cost rule's choice (issue 25's
    # GPU question): every exact layer must take norm_method "instantiate", and the step must train.
    import torch

    from bench.methods import build_step
    from bench.models import MODELS
    from bpclip_fast import nn as bnn

    factory, shape, classes = MODELS["vit"]
    torch.manual_seed(0)
    model = factory()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(3, *shape), torch.randint(0, classes, (3,))
    step, wrapped = build_step("flat_instantiate", model, x, y, seed=1)
    step()
    fused = [layer for _, layer in bnn.clipped_layers(wrapped) if type(layer).__name__ in ("Linear", "Conv2d")]
    assert len(fused) == 18 and all(layer.norm_method == "instantiate" and layer.clipping == "flat" for layer in fused)
    assert all(not torch.equal(a, p) for a, p in zip(before, wrapped.parameters()))
