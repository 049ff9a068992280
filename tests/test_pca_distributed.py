"""A private PCA in a distributed run is one release: every rank must hold the same components.

A projection computed on each rank (each with its own OS-entropy noise) would be W releases of the
training data's second moment, charged once: make_private refuses it on every rank, before the model
is changed, naming the field (bpclip_fast/ranks.py). The same release on every rank passes."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from bpclip_fast import nn as bnn
from bpclip_fast import pca
from bpclip_fast.engine import InsecureSeedWarning, PrivacyEngine
from test_distributed import SEED, WORLD, dataset, init_gloo, spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def _worker(rank, port, out_dir):
    init_gloo(rank, port)
    try:
        X = dataset().tensors[0]
        for case in ("per_rank", "shared"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", InsecureSeedWarning)
                proj = pca.private_pca(X, 6, 4.0) if case == "per_rank" else pca.private_pca(X, 6, 4.0, seed=7)
            torch.manual_seed(1)
            model = nn.Sequential(proj, nn.Linear(6, 10))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            engine = PrivacyEngine()
            result = {"error": None}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", InsecureSeedWarning)
                    engine.make_private(module=model, optimizer=opt, data_loader=DataLoader(dataset(), batch_size=6),
                                        noise_multiplier=0.8, clipping="flat", max_grad_norm=0.7, noise_seed=SEED)
                result["events"] = list(engine.accountant.events)
            except Exception as exc:  # noqa: BLE001
                result["error"] = f"{type(exc).__name__}: {exc}"
            result["converted"] = any(isinstance(m, bnn._Clipped) for m in model.modules())
            torch.save(result, os.path.join(out_dir, f"{case}_rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_projection_per_rank_is_refused_and_one_release_passes(tmp_path):
    out = spawn(tmp_path, worker=_worker)
    runs = {case: [torch.load(out / f"{case}_rank{r}.pt", weights_only=True) for r in range(WORLD)]
            for case in ("per_rank", "shared")}
    for r in runs["per_rank"]:
        assert r["error"] is not None and "private PCA projections" in r["error"], r["error"]
        assert not r["converted"]
    for r in runs["shared"]:
        assert r["error"] is None, r["error"]
        assert r["events"] == [(4.0, 1.0)]
