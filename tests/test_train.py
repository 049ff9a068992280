"""The reference trainer (bpclip_fast.train): every method, run.json, ε against the accountants,
the data-set readers on files in the torchvision formats, checkpoint/resume, the sweep."""

import json
import math
import os
import warnings

import numpy as np
import pytest
import torch

import bpclip_fast
from bpclip_fast import accounting, models
from bpclip_fast.train import Config, cli, data, expected_calibration_error, methods, report, run, sweep

pytest.importorskip("sklearn")

# adaptive clipping thresholds are the engine's (bpclip_fast.Adaptive); the trainer's --adaptive needs them
needs_adaptive = pytest.mark.skipif(not hasattr(bpclip_fast, "Adaptive"),
                                    reason="the engine has no adaptive clipping yet")

TINY = dict(data="digits", limit=160, epochs=1, batch_size=32, progress=False, threads=1)


def tiny(tmp_path=None, **kw):
    cfg = Config(**{**TINY, **kw})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # explicit noise seeds, Opacus' non-secure mode
        return run(cfg)


# ---------------------------------------------------------------- every method, run.json

def test_method_lists():
    assert set(methods.METHODS) == {"bpclip", "flat", "per-layer", "dpsgd", "clip-only", "nonprivate"}
    assert set(methods.PRIVATE_METHODS) == {"bpclip", "flat", "per-layer", "dpsgd"}
    assert set(methods.ADAPTIVE_METHODS) == {"bpclip", "flat", "per-layer"}
    assert set(cli.build_parser()._option_string_actions["--method"].choices) == set(methods.METHODS)


@pytest.mark.parametrize("method", ["bpclip", "flat", "per-layer", "dpsgd", "clip-only", "nonprivate"])
def test_each_method_runs_and_writes_run_json(method, tmp_path):
    if method == "dpsgd":
        pytest.importorskip("opacus")
    out = tmp_path / "run"
    r = tiny(method=method, epochs=2, sigma=1.0 if method in methods.PRIVATE_METHODS else None, out=str(out))
    on_disk = json.loads((out / "run.json").read_text())
    assert (out / "curves.png").stat().st_size > 0
    assert on_disk["test_accuracy"] == r["test_accuracy"]
    for key in ("config", "history", "test_accuracy", "test_loss", "ece", "val_accuracy", "epsilon", "epsilons",
                "sigma", "steps", "machine", "versions", "wall_time_s", "data"):
        assert key in on_disk, key
    assert on_disk["config"]["method"] == method and on_disk["config"]["lr"] == Config().lr
    assert [h["epoch"] for h in on_disk["history"]] == [1, 2]
    for h in on_disk["history"]:
        assert math.isfinite(h["train_loss"]) and 0 <= h["val_accuracy"] <= 1
    assert 0 <= on_disk["test_accuracy"] <= 1 and 0 <= on_disk["ece"] <= 1
    assert on_disk["versions"]["torch"] == torch.__version__
    assert on_disk["machine"]["cpu_count"] == os.cpu_count()
    assert on_disk["steps"] > 0
    # every step timed (evaluation excluded: each step is a small part of the whole run)
    assert on_disk["step_time_n"] == on_disk["steps"]
    assert 0 < on_disk["step_time_median_s"] <= on_disk["step_time_p90_s"]
    assert on_disk["step_time_median_s"] * on_disk["step_time_n"] < on_disk["wall_time_s"]
    if method in ("bpclip", "flat", "per-layer"):  # the engine's thresholds, fixed: one entry per step and step 0
        th = on_disk["thresholds"]
        assert [t["step"] for t in th] == list(range(on_disk["steps"] + 1))
        assert all(t["values"] == th[0]["values"] for t in th)
        assert on_disk["privacy"]["gradient_noise_multiplier"] == on_disk["sigma"]
        assert on_disk["privacy"]["count_noise"] is None and on_disk["privacy"]["adaptive"] is None
    else:
        assert on_disk["thresholds"] is None
    if method in methods.PRIVATE_METHODS:
        assert on_disk["sigma"] == 1.0
        assert set(on_disk["epsilons"]) >= {"rdp", "rdp_basic_conversion", "pld"}
        assert 0 < on_disk["epsilons"]["pld"] <= on_disk["epsilons"]["rdp"] <= on_disk["epsilons"]["rdp_basic_conversion"]
        assert on_disk["epsilon"] == on_disk["epsilons"]["rdp"]
        assert on_disk["history"][0]["epsilon"] < on_disk["history"][1]["epsilon"] == on_disk["epsilon"]
    else:
        assert on_disk["epsilon"] is None and on_disk["sigma"] is None and on_disk["epsilons"] == {}


# ---------------------------------------------------------------- ε is the accountant's

def test_bpclip_epsilon_equals_the_accountants():
    r = tiny(method="bpclip", sigma=2.0, epochs=2)
    n, B, L = 160, 32, 4  # the mnist net has 4 clipped layers
    steps = 2 * round(n / B)
    assert r["steps"] == steps and r["privacy"]["n_layers"] == L
    acc = accounting.RDPAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=2.0 / math.sqrt(L), sample_rate=B / n)
    assert r["effective_sigma"] == pytest.approx(2.0 / math.sqrt(L), rel=1e-12)
    assert r["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert r["epsilons"]["rdp_basic_conversion"] == pytest.approx(acc.get_epsilon(1e-5, "basic"), rel=1e-12)
    pld = accounting.PLDAccountant()
    for _ in range(steps):
        pld.step(noise_multiplier=2.0 / math.sqrt(L), sample_rate=B / n)
    assert r["epsilons"]["pld"] == pytest.approx(pld.get_epsilon(1e-5), rel=1e-12)


def test_calibrated_epsilon_meets_the_target_and_zcdp_with_shuffle():
    r = tiny(method="bpclip", epsilon=4.0, epochs=2)
    assert 4.0 - 0.05 <= r["epsilon"] <= 4.0 and r["target_epsilon"] == 4.0
    z = tiny(method="bpclip", sigma=3.0, epochs=2, accountant="zcdp")  # --sampling shuffle follows
    assert z["config"]["sampling"] == "shuffle"
    acc = accounting.ZCDPAccountant()
    for _ in range(z["steps"]):
        acc.step(noise_multiplier=3.0 / 2.0, sample_rate=1.0 / (160 // 32))
    assert z["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    # ρ = 2L/σ² per epoch (replace-one), 2 epochs
    assert z["epsilons"]["zcdp_rho"] == pytest.approx(2 * 2 * 4 / 9.0, rel=1e-12)
    assert {"zcdp_gaussian", "zcdp_cks", "zcdp_bun_steinke"} <= set(z["epsilons"])


def test_dpsgd_epsilon_equals_ours_and_opacus():
    pytest.importorskip("opacus")
    r = tiny(method="dpsgd", sigma=1.3, epochs=2)
    q = 1 / math.ceil(160 / 32)
    acc = accounting.RDPAccountant()
    for _ in range(r["steps"]):
        acc.step(noise_multiplier=1.3, sample_rate=q)
    assert r["steps"] == 2 * math.ceil(160 / 32)
    assert r["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert r["epsilons"]["opacus_rdp"] == pytest.approx(r["epsilon"], rel=2e-3)


def test_bad_pairings_and_options_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--accountant", "rdp", "--sampling", "shuffle"])
    assert "does not analyse" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--epsilon", "1", "--sigma", "1"])
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    assert "--method" in capsys.readouterr().out


# ---------------------------------------------------------------- the models of exact clipping (issue 15)

def test_help_lists_the_issue15_models(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "resnet20-gn" in out and "vit" in out
    assert {"resnet20-gn", "vit"} <= set(cli.build_parser()._option_string_actions["--model"].choices)


@pytest.mark.parametrize("model", ["vit", "resnet20-gn"])
@pytest.mark.parametrize("method", ["bpclip", "clip-only"])
def test_backprop_clipping_refuses_norm_and_embedding_models(model, method, capsys):
    with pytest.raises(ValueError, match="--method flat or --method per-layer"):
        Config(model=model, method=method).resolved()  # before any data is read
    with pytest.raises(SystemExit) as exc:
        cli.main(["--model", model, "--method", method, "--quiet"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--model {model}" in err and f"--method {method}" in err
    assert ("GroupNorm" if model == "resnet20-gn" else "LayerNorm") in err
    Config(model="mnist", method=method).resolved()  # Linear/Conv2d only: accepted


@pytest.mark.parametrize("method", ["nonprivate", "dpsgd"])
def test_vit_trains(method):
    if method == "dpsgd":
        pytest.importorskip("opacus")
    r = tiny(model="vit", method=method, sigma=1.0 if method == "dpsgd" else None, limit=96)
    assert r["model_parameters"] == sum(p.numel() for p in models.vit(act=torch.nn.Tanh).parameters())
    assert r["steps"] > 0 and math.isfinite(r["history"][0]["train_loss"])


def test_resnet20_gn_trains_and_checks_the_channels(tmp_path):
    r = tiny(model="resnet20-gn", method="nonprivate", limit=64)
    assert r["model_parameters"] == sum(p.numel() for p in models.resnet20_gn().parameters())
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data.write_cifar10_batch(str(folder / name), np.zeros((2, 3, 32, 32), np.uint8), np.zeros(2, int))
    with pytest.raises(ValueError, match="takes 1-channel images but cifar10 has 3"):
        tiny(model="resnet20-gn", method="nonprivate", data="cifar10", data_dir=str(tmp_path), val_size=2, limit=None)


# ---------------------------------------------------------------- exact clipping (flat, per-layer), thresholds

@pytest.mark.parametrize("method", ["flat", "per-layer"])
def test_exact_methods_meet_the_budget_and_equal_the_accountant(method):
    r = tiny(method=method, epsilon=3.0, epochs=2, max_grad_norm=0.7)
    assert 3.0 - 0.05 <= r["epsilon"] <= 3.0 and r["target_epsilon"] == 3.0
    assert r["privacy"]["clipping"] == {"flat": "flat", "per-layer": "per_layer"}[method]
    # exact clipping: one Gaussian of multiplier σ on the whole gradient (no √L)
    assert r["effective_sigma"] == r["sigma"] == r["privacy"]["gradient_noise_multiplier"]
    acc = accounting.RDPAccountant()
    for _ in range(r["steps"]):
        acc.step(noise_multiplier=r["sigma"], sample_rate=32 / 160)
    assert r["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert math.isfinite(r["history"][-1]["train_loss"])


def test_fixed_thresholds_are_the_configured_bounds():
    L = 4  # the mnist net's clipped layers
    flat = tiny(method="flat", sigma=1.0, max_grad_norm=0.7)["thresholds"]
    assert [t["values"] for t in flat] == [{"max_grad_norm": 0.7}] * len(flat)
    per_layer = tiny(method="per-layer", sigma=1.0, max_grad_norm=0.7)["thresholds"][-1]["values"]
    assert len(per_layer) == L and all(k.endswith(".max_grad_norm") for k in per_layer)
    assert list(per_layer.values()) == pytest.approx([0.7 / math.sqrt(L)] * L, rel=1e-12)
    bp = tiny(method="bpclip", sigma=1.0, input_clip=3.0, grad_clip=0.4)["thresholds"][-1]["values"]
    assert sorted(bp.values()) == [0.4] * L + [3.0] * L
    assert {k for k, v in bp.items() if v == 3.0} == {k.replace("grad_clip", "input_clip") for k in bp
                                                     if k.endswith(".grad_clip")}


@needs_adaptive
@pytest.mark.parametrize("method", ["bpclip", "flat", "per-layer"])
def test_adaptive_thresholds_follow_the_rule_within_the_budget(method, tmp_path):
    fixed = tiny(method=method, sigma=1.0)
    r = tiny(method=method, epsilon=3.0, epochs=2, adaptive=True, out=str(tmp_path / "run"))
    assert 3.0 - 0.05 <= r["epsilon"] <= 3.0
    th = r["thresholds"]
    assert [t["step"] for t in th] == list(range(r["steps"] + 1))
    # they start at the configured bounds (the fixed run's), under the same names
    assert th[0]["values"] == fixed["thresholds"][0]["values"]
    # each step multiplies a threshold by exp(−η(b̃/B̄ + ½ − γ)) with b̃ an integer (the rounded noisy count;
    # b̃ = 0 at γ = ½ leaves it where it was), and the thresholds do move over the run
    eta, gamma, bbar = 0.2, 0.5, r["config"]["batch_size"]  # B̄: the engine's expected batch
    for name in th[0]["values"]:
        values = [t["values"][name] for t in th]
        assert all(v > 0 and math.isfinite(v) for v in values)
        assert len(set(values)) > len(values) // 2, name
        for a, b in zip(values, values[1:]):
            count = bbar * (-math.log(b / a) / eta - 0.5 + gamma)
            assert abs(count - round(count)) < 1e-6, (name, count)
    # the accountant keeps σ; the gradient pays for the counts with a little more noise
    p = r["privacy"]
    assert p["noise_multiplier"] == r["sigma"] < p["gradient_noise_multiplier"] < 1.2 * r["sigma"]
    assert p["count_noise"] > 0
    assert p["adaptive"]["target_quantile"] == 0.5 and p["adaptive"]["learning_rate"] == 0.2
    on_disk = json.loads((tmp_path / "run" / "run.json").read_text())
    assert on_disk["thresholds"] == th
    # one line per step's entry: compact however long the run
    assert len((tmp_path / "run" / "run.json").read_text().splitlines()) < 200 + len(th)


@needs_adaptive
def test_adaptive_thresholds_follow_the_target_quantile():
    """Same batches and noise: a higher target quantile (leave more examples unclipped) ends with a
    higher threshold, and a count noise given is the one used."""
    common = dict(method="flat", sigma=1.0, adaptive=True, noise_seed=5, epochs=3, count_noise=4.0)
    runs = [tiny(target_quantile=q, **common) for q in (0.1, 0.5, 0.9)]
    assert [r["privacy"]["count_noise"] for r in runs] == [4.0] * 3
    last = [r["thresholds"][-1]["values"]["max_grad_norm"] for r in runs]
    assert last[0] < last[1] < last[2] and last[2] > 1.0


def test_adaptive_is_refused_where_it_does_not_apply(capsys):
    for method in ("dpsgd", "clip-only", "nonprivate"):
        with pytest.raises(SystemExit):
            cli.main(["--method", method, "--adaptive", "--quiet"])
        err = capsys.readouterr().err
        assert "--adaptive" in err and method in err
        with pytest.raises(ValueError, match="--adaptive"):
            Config(method=method, adaptive=True).resolved()
    # the adaptive options without --adaptive would change nothing: refused, naming the option
    with pytest.raises(SystemExit):
        cli.main(["--method", "flat", "--target-quantile", "0.7", "--quiet"])
    assert "--target-quantile" in capsys.readouterr().err


@needs_adaptive
@pytest.mark.parametrize("option,value", [("--target-quantile", "1.5"), ("--clip-lr", "0"), ("--count-noise", "-1")])
def test_bad_adaptive_options_are_refused_by_name(option, value, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--method", "flat", "--adaptive", option, value, "--quiet"])
    err = capsys.readouterr().err
    assert option in err and "--adaptive" in err


# ---------------------------------------------------------------- data readers (torchvision formats)

def _write_idx_set(folder, n_train, n_test, seed, gz):
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, size=n).astype(np.uint8)
        ext = ".gz" if gz else ""
        data.write_idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte{ext}"), x)
        data.write_idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte{ext}"), y)
        arrays[prefix] = (x, y)
    return arrays


@pytest.mark.parametrize("name,sub,gz", [("mnist", "MNIST/raw", True), ("fmnist", "", False)])
def test_idx_loaders(tmp_path, name, sub, gz):
    arrays = _write_idx_set(str(tmp_path / sub), 40, 12, seed=1, gz=gz)
    s = data.load_dataset(name, str(tmp_path), val_size=10)
    assert (len(s.train), len(s.val), len(s.test)) == (30, 10, 12) and s.input_shape == (1, 28, 28)
    xt, yt = s.test.tensors
    assert torch.equal(xt, torch.from_numpy(arrays["t10k"][0][:, None].astype(np.float32) / 255))
    assert torch.equal(yt, torch.from_numpy(arrays["t10k"][1].astype(np.int64)))
    # train + val are a split of the training file
    x_all = torch.cat([s.train.tensors[0], s.val.tensors[0]]).flatten(1)
    want = torch.from_numpy(arrays["train"][0].astype(np.float32) / 255).flatten(1)
    assert sorted(map(tuple, x_all.tolist())) == sorted(map(tuple, want.tolist()))


def test_idx_header_is_checked(tmp_path):
    p = tmp_path / "bad"
    p.write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x05abc")  # says 5 bytes, holds 3
    with pytest.raises(ValueError, match="idx"):
        data.read_idx(str(p))


def test_cifar10_loader(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(2)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, size=(6, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, size=6)
        data.write_cifar10_batch(str(folder / name), x, y)
        batches[name] = (x, y)
    s = data.load_dataset("cifar10", str(tmp_path), val_size=5)
    assert (len(s.train), len(s.val), len(s.test)) == (25, 5, 6) and s.input_shape == (3, 32, 32)
    assert torch.equal(s.test.tensors[0], torch.from_numpy(batches["test_batch"][0].astype(np.float32) / 255))
    assert s.test.tensors[1].tolist() == list(batches["test_batch"][1])
    # a whole run on it: the Papernot CIFAR-10 net
    r = tiny(data="cifar10", data_dir=str(tmp_path), val_size=5, limit=None, model="papernot-cifar10",
             method="bpclip", sigma=1.0, batch_size=8)
    assert r["data"]["train"] == 25 and r["model_parameters"] == 550570


def test_missing_files_name_what_is_expected(tmp_path, capsys):
    with pytest.raises(data.DatasetNotFound, match="train-images-idx3-ubyte.*t10k-labels-idx1-ubyte"):
        data.load_dataset("mnist", str(tmp_path))
    with pytest.raises(data.DatasetNotFound, match="data_batch_1.*test_batch.*cifar-10-python.tar.gz"):
        data.load_dataset("cifar10", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        cli.main(["--data", "fmnist", "--data-dir", str(tmp_path), "--quiet"])
    assert exc.value.code == 2 and "fashion-mnist" in capsys.readouterr().err


def test_cli_trains_on_written_mnist_files(tmp_path, capsys):
    _write_idx_set(str(tmp_path / "MNIST" / "raw"), 60, 20, seed=3, gz=False)
    cli.main(["--data", "mnist", "--data-dir", str(tmp_path), "--val-size", "20", "--method", "nonprivate",
              "--epochs", "1", "--batch-size", "16", "--quiet", "--activation", "tempered", "--tempered", "1.5,2,0.5"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("nonprivate on mnist: test accuracy") and "wall time" in line


# ---------------------------------------------------------------- checkpoint and resume

def test_bpclip_resume_continues_from_the_checkpoint(tmp_path):
    ck = str(tmp_path / "ck.pt")
    common = dict(method="bpclip", sigma=1.5, noise_seed=1234, seed=7)
    whole = tiny(epochs=3, **common)
    first = tiny(epochs=2, checkpoint=ck, **common)
    assert first["steps"] == 2 * 5
    resumed = tiny(epochs=3, checkpoint=ck, resume=True, **common)
    assert resumed["steps"] == whole["steps"] == 15
    assert resumed["epsilon"] == pytest.approx(whole["epsilon"], rel=1e-12)
    assert [h["epoch"] for h in resumed["history"]] == [1, 2, 3]
    assert resumed["history"][:2] == first["history"]
    # same batches, noise and optimizer state: the resumed run is the uninterrupted one
    assert resumed["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-5)
    assert resumed["history"][2]["train_loss"] == pytest.approx(whole["history"][2]["train_loss"], rel=1e-5)
    # a run with a secret (OS) seed checkpoints no seed, and its resume draws fresh noise
    secret_ck = str(tmp_path / "secret.pt")
    tiny(epochs=1, checkpoint=secret_ck, method="bpclip", sigma=1.5, seed=7)
    saved = torch.load(secret_ck, weights_only=False)

    def keys(obj):
        if isinstance(obj, dict):
            return [k for k, v in obj.items() for k in [str(k)] + keys(v)]
        return [k for v in obj for k in keys(v)] if isinstance(obj, (list, tuple)) else []
    assert saved["config"]["noise_seed"] is None  # the config's own seed is the public model-init seed
    assert not any("seed" in k or "secret" in k for k in keys({k: v for k, v in saved.items() if k != "config"}))
    # another configuration cannot resume this checkpoint
    with pytest.raises(ValueError, match="other settings"):
        tiny(epochs=3, checkpoint=ck, resume=True, **{**common, "sigma": 2.0})


@needs_adaptive
@pytest.mark.parametrize("method", ["bpclip", "flat", "per-layer"])
def test_resume_continues_the_adaptive_thresholds(method, tmp_path):
    ck = str(tmp_path / "ck.pt")
    common = dict(method=method, sigma=1.5, adaptive=True, seed=3)  # a secret noise seed: fresh noise on resume
    first = tiny(epochs=2, checkpoint=ck, **common)
    resumed = tiny(epochs=3, checkpoint=ck, resume=True, **common)
    th = resumed["thresholds"]
    at = [i for i, t in enumerate(th) if t.get("resumed")]
    assert at == [len(first["thresholds"])]
    before, after = th[at[0] - 1], th[at[0]]
    assert th[:at[0]] == first["thresholds"]
    # the first thresholds after the resume are the last before, and they keep adapting
    assert after["step"] == before["step"] == first["steps"] and after["values"] == before["values"]
    assert [t["step"] for t in th[at[0] + 1:]] == list(range(first["steps"] + 1, resumed["steps"] + 1))
    assert th[-1]["values"] != before["values"] != first["thresholds"][0]["values"]
    assert resumed["step_time_n"] == resumed["steps"] == 15


@needs_adaptive
def test_resume_with_a_noise_seed_is_the_uninterrupted_adaptive_run(tmp_path):
    ck = str(tmp_path / "ck.pt")
    common = dict(method="flat", sigma=1.5, adaptive=True, noise_seed=99, seed=3)
    whole = tiny(epochs=3, **common)
    tiny(epochs=2, checkpoint=ck, **common)
    resumed = tiny(epochs=3, checkpoint=ck, resume=True, **common)
    trajectory = [t for t in resumed["thresholds"] if not t.get("resumed")]
    assert [t["step"] for t in trajectory] == [t["step"] for t in whole["thresholds"]]
    for a, b in zip(trajectory, whole["thresholds"]):
        assert a["values"]["max_grad_norm"] == pytest.approx(b["values"]["max_grad_norm"], rel=1e-9)
    assert resumed["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-5)


def test_dpsgd_resume_keeps_the_spent_budget(tmp_path):
    pytest.importorskip("opacus")
    ck = str(tmp_path / "ck.pt")
    tiny(method="dpsgd", sigma=1.2, epochs=1, checkpoint=ck)
    r = tiny(method="dpsgd", sigma=1.2, epochs=2, checkpoint=ck, resume=True)
    assert r["steps"] == 2 * 5
    acc = accounting.RDPAccountant()
    for _ in range(10):
        acc.step(noise_multiplier=1.2, sample_rate=1 / 5)
    assert r["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert r["epsilons"]["opacus_rdp"] == pytest.approx(r["epsilon"], rel=2e-3)


# ---------------------------------------------------------------- ECE, sweep

def test_expected_calibration_error():
    labels = torch.tensor([0, 1, 0, 1])
    sure = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert expected_calibration_error(sure, labels) == pytest.approx(0.0)
    wrong = sure.flip(1)  # confident and always wrong
    assert expected_calibration_error(wrong, labels) == pytest.approx(1.0)
    half = torch.full((4, 2), 0.5)  # accuracy 1/2 at confidence 1/2 (argmax picks class 0)
    assert expected_calibration_error(half, labels) == pytest.approx(0.0)


@needs_adaptive
def test_sweep_smoke_preset(tmp_path, capsys):
    pytest.importorskip("opacus")
    out = tmp_path / "sweep"
    best = sweep.cli_run(["--preset", "smoke", "--out", str(out), "--limit", "96", "--seeds", "0,1"])
    lines = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert len(lines) == len(sweep.expand(sweep.load_spec(sweep.build_parser().parse_args(
        ["--preset", "smoke", "--seeds", "0,1"])))) == 2 * (2 * 2 + 4 * 1 * 2) + 2 + 2
    assert all(0 <= r["test_accuracy"] <= 1 for r in lines)
    assert {r["method"] for r in lines} == set(methods.METHODS)
    assert all(r["step_time_median_s"] > 0 for r in lines)
    adaptive = [r for r in lines if r["config"]["adaptive"]]
    assert adaptive and all(r["final_thresholds"]["max_grad_norm"] != 1.0 for r in adaptive)
    assert (out / "accuracy_vs_epsilon.png").stat().st_size > 0
    table = (out / "results.md").read_text()
    assert "| bpclip | 1 |" in table and "∞ (not private)" in table
    assert "| flat (adaptive) | 8 |" in table and "| per-layer | 1 |" in table
    # the step-time column: each selected setting's median over its seeds of each run's median
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("|")]
    col = rows[0].index("median step (ms)")
    assert report.STEP_TIME_NOTE in table
    cell = {(r[0], r[1]): r[col] for r in rows[2:]}
    for b in best:
        eps = "∞ (not private)" if b["epsilon_budget"] is None else f"{b['epsilon_budget']:g}"
        want = 1000 * float(np.median([r["step_time_median_s"] for r in b["runs"]]))
        assert float(cell[b["label"], eps]) == pytest.approx(want, abs=0.051)
    # selection is by validation accuracy, never test
    bp = [b for b in best if b["label"] == "bpclip" and b["epsilon_budget"] == 1.0][0]
    by_hp = {}
    for r in lines:
        if r["label"] == "bpclip" and r["epsilon_budget"] == 1.0:
            by_hp.setdefault(r["hparams"]["lr"], []).append(r["val_accuracy"])
    assert np.mean(by_hp[bp["hparams"]["lr"]]) == max(np.mean(v) for v in by_hp.values())
    # started again: nothing is re-run
    capsys.readouterr()
    assert sweep.main(["--preset", "smoke", "--out", str(out), "--limit", "96", "--seeds", "0,1"]) == 0
    assert "already in" in capsys.readouterr().err
    assert len((out / "runs.jsonl").read_text().splitlines()) == len(lines)


@pytest.mark.parametrize("preset", sorted(sweep.PRESETS))
def test_every_preset_expands_to_valid_configs(preset):
    """A preset that cannot run (a misspelt setting, an impossible pairing) fails here, not hours in:
    figure1 needs the MNIST files and is never run by the tests."""
    runs = sweep.expand(sweep.PRESETS[preset])
    spec = sweep.PRESETS[preset]
    private = sum(1 for a in spec["arms"] if a["settings"].get("method", "bpclip") in methods.PRIVATE_METHODS)
    assert {r["epsilon_budget"] for r in runs if r["method"] in methods.PRIVATE_METHODS} == set(spec["epsilons"])
    assert len({r["id"] for r in runs}) == len(runs) and private >= 2
    for r in runs:
        cfg = Config(**r["config"]).resolved()
        assert cfg.method == r["method"] and (cfg.epsilon is not None) == (r["epsilon_budget"] is not None)


def test_digits_preset_covers_every_method_fixed_and_adaptive():
    runs = sweep.expand(sweep.PRESETS["digits"])
    pairs = {(r["method"], bool(r["config"].get("adaptive", False))) for r in runs}
    assert pairs == {(m, False) for m in methods.METHODS} | {(m, True) for m in methods.ADAPTIVE_METHODS}
    # each (method, thresholds) pair is one arm with its own label, at every budget and seed
    labels = {}
    for r in runs:
        labels.setdefault((r["method"], bool(r["config"].get("adaptive", False))), set()).add(r["label"])
    for (method, adaptive), names in labels.items():
        if method in methods.ADAPTIVE_METHODS:
            assert names == {f"{method} ({'adaptive' if adaptive else 'fixed'})"}
    spec = sweep.PRESETS["digits"]
    for r in runs:
        if r["method"] in methods.PRIVATE_METHODS:
            assert r["epsilon_budget"] in spec["epsilons"]
    per_arm = {}
    for r in runs:
        per_arm.setdefault((r["label"], r["epsilon_budget"], json.dumps(r["hparams"], sort_keys=True)),
                           set()).add(r["seed"])
    assert all(seeds == set(spec["seeds"]) for seeds in per_arm.values())


def test_step_time_column_is_the_median_of_the_seeds_medians():
    lines = [{"label": "flat (fixed)", "method": "flat", "epsilon_budget": 3.0, "hparams": {"lr": 0.01}, "seed": s,
              "val_accuracy": 0.5, "test_accuracy": 0.5, "ece": 0.1, "epsilon": 2.99, "sigma": 1.0,
              "step_time_median_s": t} for s, t in enumerate([0.010, 0.030, 0.0205])]
    lines.append({**lines[0], "hparams": {"lr": 0.03}, "val_accuracy": 0.4, "step_time_median_s": 1.0})
    best = sweep.select_best(lines)
    assert len(best) == 1 and best[0]["hparams"] == {"lr": 0.01}
    assert best[0]["step_time_median_s"] == pytest.approx(0.0205)
    table = report.markdown_table(best)
    assert "median step (ms)" in table.splitlines()[0] and "| 20.5 |" in table.splitlines()[2]
    # a line written before step times were recorded shows "-"
    old = [{k: v for k, v in r.items() if k != "step_time_median_s"} for r in lines]
    assert "| - |" in report.markdown_table(sweep.select_best(old)).splitlines()[2]


def test_banded_noise_run_reports_the_banded_accountants_epsilon():
    """--noise banded: the run meets its budget, and run.json's figures are those of the banded
    accountant (⌈T/b⌉ steps at the group's rate), not of T steps at that rate (dp_accounting's truth)."""
    import dp_accounting as dpa

    r = tiny(method="flat", epsilon=3.0, epochs=2, noise="banded", bands=4, optimizer="sgd", lr=0.01)
    assert 3.0 - 0.05 <= r["epsilon"] <= 3.0 and r["privacy"]["bands"] == 4
    q_g = 32 / (160 // 4)
    truth = dpa.rdp.RdpAccountant(orders=list(accounting.OPACUS_RDP_ORDERS))
    truth.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q_g, dpa.GaussianDpEvent(r["sigma"])),
                                          math.ceil(r["steps"] / 4)))
    assert r["epsilons"]["rdp"] == pytest.approx(truth.get_epsilon(1e-5), rel=1e-9)
    assert r["epsilon"] == pytest.approx(r["epsilons"]["rdp"], rel=1e-12)


def test_banded_resume_continues_the_band_from_the_checkpoints_rows(tmp_path, monkeypatch):
    """--checkpoint under --noise banded holds the secret noise rows (through the last step), and
    --resume loads them after the optimizer state, so that the band continues."""
    ck = str(tmp_path / "ck.pt")
    common = dict(method="flat", sigma=1.5, noise="banded", bands=4, optimizer="sgd", lr=0.01, seed=3)
    first = tiny(epochs=1, checkpoint=ck, **common)
    rows = torch.load(ck, weights_only=False)["method"]["secret_noise_rows"]
    assert rows["steps"] == first["steps"] and all(
        layer["next_row"] == rows["charged"] and layer["rows"].shape[0] == 3 for layer in rows["layers"].values())
    loaded = []
    real = bpclip_fast.PrivacyEngine.load_noise_state_dict
    monkeypatch.setattr(bpclip_fast.PrivacyEngine, "load_noise_state_dict",
                        lambda self, state: (loaded.append(self.steps), real(self, state)))
    resumed = tiny(epochs=2, checkpoint=ck, resume=True, **common)
    assert loaded == [first["steps"]] and resumed["steps"] == 2 * first["steps"]


def test_integer_noise_run_meets_its_budget_at_integer_orders():
    """--integer-noise: the engine's integer release, calibrated and charged at integer RDP orders
    with σ/(1 + 2⁻¹²) (dp_accounting's truth), within the budget; refused for Opacus' method."""
    import dp_accounting as dpa

    from bpclip_fast import integer_noise

    r = tiny(method="flat", epsilon=3.0, epochs=2, integer_noise=True, optimizer="sgd", lr=0.01)
    assert 3.0 - 0.05 <= r["epsilon"] <= 3.0 and r["privacy"]["integer_noise"] is True
    truth = dpa.rdp.RdpAccountant(orders=list(integer_noise.INTEGER_ORDERS))
    truth.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(
        r["privacy"]["sample_rate"], dpa.GaussianDpEvent(r["sigma"] / integer_noise.EFFECTIVE_FACTOR)), r["steps"]))
    assert r["epsilon"] == pytest.approx(truth.get_epsilon(1e-5), rel=1e-6)
    with pytest.raises(ValueError, match="--integer-noise applies to --method"):
        Config(**{**TINY, "method": "dpsgd", "integer_noise": True}).resolved()
