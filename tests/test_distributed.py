"""Two processes (gloo, CPU) under DistributedDataParallel against one process on the same batches.

The engine's batches are counter-based (bpclip_fast.data): with the same seed, the union of the two
ranks' batches is the single process's batch (batch_size·2), so both runs see the same examples
and the same noise draws. If the noise were added on every rank, or on none, or independently per
rank, the parameters would differ.
"""

import datetime
import os
import socket
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import Adaptive
from bpclip_fast.engine import InsecureSeedWarning, PrivacyEngine
from bpclip_fast import nn as bnn
from bpclip_fast.modules import PositionalEmbedding

WORLD = 2
STEPS = 6
BATCH = 6  # per process
SEED = 4321
DELTA = 1e-5


def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(48, 1, 8, 8, generator=g), torch.randint(0, 10, (48,), generator=g))


def model_fn(mode="backprop"):
    torch.manual_seed(1)
    if mode.endswith("_norms"):  # the layer types of issue 15 (exact modes only)
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.MaxPool2d(2),
                             nn.Flatten(), PositionalEmbedding(64), nn.LayerNorm(64), nn.Linear(4 * 4 * 4, 10))
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 10))


CLIPPING = {"backprop": dict(input_clip=2.0, grad_clip=0.5),
            "flat": dict(clipping="flat", max_grad_norm=0.7),
            "per_layer": dict(clipping="per_layer", max_grad_norm=[0.5, 0.6])}
# Adaptive thresholds: the counts are summed over the ranks and noised once (same seed everywhere), so
# every rank moves the thresholds as the single process does.
CLIPPING.update({f"{mode}_adaptive": dict(kw, adaptive=Adaptive(learning_rate=0.5)) for mode, kw in list(CLIPPING.items())})
CLIPPING.update({"flat_norms": dict(clipping="flat", max_grad_norm=0.7),
                 "per_layer_norms": dict(clipping="per_layer", max_grad_norm=[0.5, 0.2, 0.3, 0.2, 0.6])})
MODES = tuple(CLIPPING)


def run(model, batch_size, *, wrap=None, mode="backprop"):
    """STEPS steps (step 2: two micro-batches; step 4: no backward); returns (engine, model, batch sizes)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    if wrap is not None:
        model = wrap(model)
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureSeedWarning)
        model, opt, loader = engine.make_private(module=model, optimizer=opt,
                                                 data_loader=DataLoader(dataset(), batch_size=batch_size),
                                                 noise_multiplier=0.8, noise_seed=SEED, **CLIPPING[mode])
    sizes = []
    batches = (batch for _ in range(STEPS) for batch in loader)  # over epochs (4 steps each)
    for step in range(STEPS):
        x, y = next(batches)
        sizes.append(len(x))
        opt.zero_grad()
        if step != 4:  # step 4: the loop skips its batch; step() must still add the noise, once globally
            for xm, ym in zip(x.tensor_split(2 if step == 2 else 1), y.tensor_split(2 if step == 2 else 1)):
                nn.functional.cross_entropy(model(xm), ym).backward()
        opt.step()
    return engine, model, sizes


def _worker(rank, port, out_dir):
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only: no hostname resolution needed in CI
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for mode, prewrap in ((m, p) for m in MODES for p in (False, True)):  # the engine wraps in DDP / the user
            wrap = (lambda m: nn.parallel.DistributedDataParallel(m)) if prewrap else None
            engine, model, sizes = run(model_fn(mode), BATCH, wrap=wrap, mode=mode)
            assert isinstance(model, nn.parallel.DistributedDataParallel)
            layers = [m for m in model.modules() if isinstance(m, bnn._Clipped)]
            result = {"params": [p.detach().clone() for p in model.module.parameters()], "sizes": sizes,
                      "epsilon": engine.get_epsilon(DELTA), "steps": engine.steps,
                      "sigmas": [layer.noise_multiplier for layer in layers], "seed": engine._seed,
                      "thresholds": engine.thresholds()}
            torch.save(result, os.path.join(out_dir, f"{mode}_prewrap{int(prewrap)}_rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(out_dir, timeout=150):
    ctx = mp.start_processes(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"the {WORLD}-process run did not finish within {timeout} s")
    return {(mode, prewrap): [torch.load(out_dir / f"{mode}_prewrap{int(prewrap)}_rank{r}.pt", weights_only=True)
                              for r in range(WORLD)] for mode in MODES for prewrap in (False, True)}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    return spawn(tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def single_process():
    return {mode: run(model_fn(mode), BATCH * WORLD, mode=mode) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prewrap", [False, True], ids=["engine_wraps_ddp", "user_wraps_ddp"])
def test_two_processes_equal_one_process_on_the_same_batches(two_processes, single_process, prewrap, mode):
    """Exact clipping too: the norms are per example, so per rank; the noise once, on rank 0."""
    ranks = two_processes[(mode, prewrap)]
    engine, model, sizes = single_process[mode]
    # The ranks' batches partition the single process's batches.
    assert [a + b for a, b in zip(ranks[0]["sizes"], ranks[1]["sizes"])] == sizes
    assert sum(sizes) > 0 and any(a != b for a, b in zip(ranks[0]["sizes"], ranks[1]["sizes"]))
    # One seed, noise drawn on rank 0 only, one accountant stepped identically everywhere.
    assert ranks[0]["seed"] == ranks[1]["seed"] == SEED
    assert all(s == engine.gradient_noise_multiplier for s in ranks[0]["sigmas"])
    assert all(s == 0.0 for s in ranks[1]["sigmas"])
    assert engine.gradient_noise_multiplier == (0.8 if engine.adaptive is None else pytest.approx(0.8 / 0.9 ** 0.5))
    for r in ranks:  # the thresholds moved (adaptive) and every rank holds the single process's values
        assert r["thresholds"] == pytest.approx(engine.thresholds(), rel=1e-9)
    assert (engine.adaptive is None) == (engine.thresholds() == run(model_fn(mode), BATCH * WORLD, mode=mode.split("_ad")[0])[0].thresholds())
    for r in ranks:
        assert r["steps"] == engine.steps == STEPS
        assert r["epsilon"] == pytest.approx(engine.get_epsilon(DELTA), rel=1e-12)
    for r in ranks:
        for a, b in zip(r["params"], model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    # The runs moved far from the start, so the comparison above is not trivial.
    assert (ranks[0]["params"][0] - model_fn(mode)[0].weight.detach()).abs().max() > 1e-2
