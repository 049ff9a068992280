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


class UserRMSNorm(nn.RMSNorm):
    """A subclass: not converted to the fused RMSNorm, so a generic unit."""


class SharedRow(nn.Module):
    """A learned vector added to every example: an Embedding's index of one row ([1]) broadcast over
    the batch, looked up per example of each rank's (micro-)batch (bpclip_fast/broadcast.py)."""

    def __init__(self, d):
        super().__init__()
        self.emb = nn.Embedding(1, d)

    def forward(self, x):
        return x + self.emb(torch.zeros(1, dtype=torch.long, device=x.device))


def model_fn(mode="backprop"):
    torch.manual_seed(1)
    if mode.endswith("_shared_row"):
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(),
                             SharedRow(64), nn.Linear(4 * 4 * 4, 10))
    if mode.endswith("_generic"):  # a module without a fused layer: the generic exact path (issue 26)
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(),
                             UserRMSNorm(64), nn.Linear(4 * 4 * 4, 10))
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
                 "per_layer_norms": dict(clipping="per_layer", max_grad_norm=[0.5, 0.2, 0.3, 0.2, 0.6]),
                 "flat_generic": dict(clipping="flat", max_grad_norm=0.7),
                 "per_layer_generic": dict(clipping="per_layer", max_grad_norm=[0.5, 0.2, 0.6]),
                 "flat_shared_row": dict(clipping="flat", max_grad_norm=0.7),
                 "per_layer_shared_row": dict(clipping="per_layer", max_grad_norm=[0.5, 0.2, 0.6])})
MODES = tuple(CLIPPING)


def run(model, batch_size, *, wrap=None, mode="backprop"):
    """STEPS steps (step 2: two micro-batches in ``opt.accumulate()`` in one process, refused under
    DDP; step 4: no backward); returns (engine, model, batch sizes)."""
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
            if isinstance(model, nn.parallel.DistributedDataParallel):
                if step == 2:  # micro-batches are not supported under DDP yet: refused before anything runs
                    try:
                        with opt.accumulate():
                            raise AssertionError("the block opened under DDP")
                    except RuntimeError as e:
                        assert "DistributedDataParallel" in str(e)
                nn.functional.cross_entropy(model(x), y).backward()
            else:  # one process: two micro-batches at step 2, the same release as one backward
                with opt.accumulate():
                    for xm, ym in zip(x.tensor_split(2 if step == 2 else 1), y.tensor_split(2 if step == 2 else 1)):
                        nn.functional.cross_entropy(model(xm), ym).backward()
        opt.step()
    return engine, model, sizes


def init_gloo(rank, port):
    """One process of a WORLD-rank gloo group on loopback, one thread (every worker of these tests)."""
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only: no hostname resolution needed in CI
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))


def _worker(rank, port, out_dir):
    init_gloo(rank, port)
    try:
        for mode, prewrap in ((m, p) for m in MODES for p in (False, True)):  # the engine wraps in DDP / the user
            wrap = (lambda m: nn.parallel.DistributedDataParallel(m)) if prewrap else None
            engine, model, sizes = run(model_fn(mode), BATCH, wrap=wrap, mode=mode)
            assert isinstance(model, nn.parallel.DistributedDataParallel)
            layers = [m for m in model.modules() if isinstance(m, bnn._Clipped)]
            result = {"params": [p.detach().clone() for p in model.module.parameters()], "sizes": sizes,
                      "epsilon": engine.get_epsilon(DELTA), "steps": engine.steps,
                      "sigmas": [layer._bp_noise_multiplier for layer in layers], "seed": engine._seed,
                      "thresholds": engine.thresholds()}
            torch.save(result, os.path.join(out_dir, f"{mode}_prewrap{int(prewrap)}_rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(out_dir, timeout=150, worker=None):
    ctx = mp.start_processes(worker or _worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"the {WORLD}-process run did not finish within {timeout} s")
    if worker is not None:
        return out_dir
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


# ---------------------------------------------------------------- every rank must pass the same dataset
# The engine takes rank r's share of one global Poisson batch over the dataset each rank passes
# (rate W·batch_size/N). With per-rank shards, each rank derived its own N, rate and (under
# make_private_with_epsilon) σ, while only rank 0's σ is drawn: examples of a shard half as long were
# sampled at twice the rate under rank 0's noise (ε 3.87 where 1.99 was reported). make_private must
# refuse on every rank, before the model is changed, naming the argument and each rank's value.

class _Shard(torch.utils.data.Dataset):
    """Items ``start, start + step, ...`` of ``dataset()`` (a user's own sharding, e.g. Subset)."""

    def __init__(self, n, start=0, step=1, jitter=False):
        self.base, self.n, self.start, self.step, self.jitter = dataset(), n, start, step, jitter

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x, y = self.base[(self.start + i * self.step) % len(self.base)]
        if self.jitter:  # random augmentation: every read differs (continuous noise, never equal twice)
            x = x + 0.01 * torch.randn(x.shape)
        return x, y


def _big(n):
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


SHARD_CASES = {
    # name: (per-rank loader kwargs, make_private overrides per rank, use make_private_with_epsilon)
    "unequal_length": (lambda r: dict(dataset=_big(1000 if r == 0 else 500), batch_size=6), {}, False),
    "unequal_batch": (lambda r: dict(dataset=dataset(), batch_size=6 if r == 0 else 3), {}, False),
    "epsilon_unequal_length": (lambda r: dict(dataset=_big(1000 if r == 0 else 500), batch_size=6), {}, True),
    "unequal_bound": (lambda r: dict(dataset=dataset(), batch_size=6), {1: dict(max_grad_norm=0.9)}, False),
    "unequal_loss_reduction": (lambda r: dict(dataset=dataset(), batch_size=6), {1: dict(loss_reduction="sum")},
                               False),
    "equal_length_shards": (lambda r: dict(dataset=_Shard(24, start=r, step=WORLD), batch_size=3), {}, False),
    # rank 1's shard is shorter than batch_size·W: it fails alone, before the collective
    "shard_too_small": (lambda r: dict(dataset=_big(48 if r == 0 else 5), batch_size=6), {}, False),
    "epsilon_shard_too_small": (lambda r: dict(dataset=_big(48 if r == 0 else 5), batch_size=6), {}, True),
    "same_data_own_order": (lambda r: dict(dataset=_Shard(48, start=5 * r), batch_size=6), {}, False),
    "same_dataset_augmented": (lambda r: dict(dataset=_Shard(48, jitter=True), batch_size=6), {}, False),
}


def _shard_worker(rank, port, out_dir):
    init_gloo(rank, port)
    try:
        for name, (loader_kw, overrides, by_epsilon) in SHARD_CASES.items():
            model = model_fn("flat")
            torch.manual_seed(100 + rank)  # the augmentation's draws differ between the ranks
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            engine = PrivacyEngine()
            kw = dict(CLIPPING["flat"], noise_seed=SEED, **overrides.get(rank, {}))
            result = {"error": None}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    if by_epsilon:
                        engine.make_private_with_epsilon(module=model, optimizer=opt,
                                                         data_loader=DataLoader(**loader_kw(rank)),
                                                         target_epsilon=2.0, target_delta=DELTA, epochs=1, **kw)
                    else:
                        engine.make_private(module=model, optimizer=opt, data_loader=DataLoader(**loader_kw(rank)),
                                            noise_multiplier=0.8, **kw)
                    result["sigma"] = engine.noise_multiplier
                    result["sample_rate"] = engine.sample_rate
                except Exception as exc:  # noqa: BLE001
                    result["error"] = f"{type(exc).__name__}: {exc}"
            result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                                  if not issubclass(w.category, InsecureSeedWarning)]
            result["converted"] = any(isinstance(m, bnn._Clipped) for m in model.modules())
            torch.save(result, os.path.join(out_dir, f"{name}_rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def shard_runs(tmp_path_factory):
    out = spawn(tmp_path_factory.mktemp("shards"), worker=_shard_worker)
    return {name: [torch.load(out / f"{name}_rank{r}.pt", weights_only=True) for r in range(WORLD)]
            for name in SHARD_CASES}


@pytest.mark.parametrize("case, argument, values", [
    ("unequal_length", "len(data_loader.dataset)", ("1000", "500")),
    ("unequal_batch", "data_loader.batch_size", ("6", "3")),
    # make_private_with_epsilon calibrated σ per rank (1000 vs 500 examples): refused, never two σ.
    ("epsilon_unequal_length", "noise_multiplier", None),
    ("unequal_bound", "max_grad_norm", ("0.7", "0.9")),
    ("unequal_loss_reduction", "loss_reduction", ("'mean'", "'sum'")),
])
def test_ranks_that_disagree_are_refused_on_every_rank(shard_runs, case, argument, values):
    ranks = shard_runs[case]
    for rank, r in enumerate(ranks):
        assert r["error"] is not None, f"rank {rank} was made private with {case}"
        assert r["error"].startswith("ValueError: ")
        assert argument in r["error"] and "same full dataset" in r["error"], r["error"]
        if values is not None:
            assert f"rank 0: {values[0]}" in r["error"] and f"rank 1: {values[1]}" in r["error"], r["error"]
        assert not r["converted"], "the refusal must come before the model is changed"
    assert ranks[0]["error"] == ranks[1]["error"]
    if case == "epsilon_unequal_length":
        assert "len(data_loader.dataset)" in ranks[0]["error"] and "sample rate" in ranks[0]["error"]


@pytest.mark.parametrize("case", ["shard_too_small", "epsilon_shard_too_small"])
def test_a_rank_failing_alone_is_not_left_waiting(shard_runs, case):
    """Rank 1 refuses its own arguments (batch_size·W exceeds its shard); rank 0, already in the
    agreement collective, must refuse too, naming rank 1's error, not wait for the process group's
    timeout (60 s here: then rank 0 reports a gloo timeout, not this message)."""
    ranks = shard_runs[case]
    assert "exceeds the dataset size 5" in ranks[1]["error"], ranks[1]["error"]
    assert "rank 1 refused" in ranks[0]["error"] and "exceeds the dataset size 5" in ranks[0]["error"], ranks[0]
    assert "same full dataset" in ranks[0]["error"]
    assert not ranks[0]["converted"] and not ranks[1]["converted"]


@pytest.mark.parametrize("case", ["equal_length_shards", "same_data_own_order"])
def test_equal_lengths_with_different_items_are_refused_on_every_rank(shard_runs, case):
    """Every argument agrees, but the items at the same index differ: disjoint shards would be half unused
    (each rank trains its residue class only), and a per-rank order of one dataset trains an example
    on two ranks with independent coins (twice the accounted rate). The engine cannot tell them apart."""
    ranks = shard_runs[case]
    for r in ranks:
        assert r["error"] is not None and r["error"].startswith("ValueError: "), r
        assert "items at the same indices differ between the ranks" in r["error"], r["error"]
        assert "same full dataset" in r["error"] and not r["converted"]
    assert ranks[0]["error"] == ranks[1]["error"]


def test_same_dataset_with_random_augmentation_is_neither_refused_nor_warned(shard_runs):
    """Every read of an augmented dataset differs, so its items cannot be compared between ranks: a
    false refusal (or warning) there would stop an ordinary training run."""
    for r in shard_runs["same_dataset_augmented"]:
        assert r["error"] is None and r["converted"] and r["warnings"] == [], r


def test_fingerprint_compares_only_reproducible_items():
    """Single process: what make_private's collective compares (bpclip_fast.ranks)."""
    from bpclip_fast import ranks

    fixed = _Shard(48)
    prints = ranks.fingerprint(fixed, len(fixed))
    assert len(prints) == ranks.K and all(p >= 0 for p in prints) and len(set(prints)) == ranks.K
    assert prints == ranks.fingerprint(_Shard(48), 48)  # the same data built anew: the same print
    assert prints != ranks.fingerprint(_Shard(48, start=1), 48)
    torch.manual_seed(0)
    assert ranks.fingerprint(_Shard(48, jitter=True), 48) == [-1.0] * ranks.K  # never compared

    class Flip(torch.utils.data.Dataset):  # one item random among two outcomes: the whole print is skipped
        def __len__(self):
            return 48

        def __getitem__(self, i):
            x, y = fixed[i]
            return (x.flip(-1) if i == 47 and torch.rand(()) < 0.5 else x), y

    torch.manual_seed(0)
    assert ranks.fingerprint(Flip(), 48) == [-1.0] * ranks.K
    assert ranks.fingerprint([(object(), 1)] * 48, 48) == [-1.0] * ranks.K  # no exact bytes to compare
    assert ranks.fingerprint(TensorDataset(torch.arange(3.0)), 3)[3:] == [-2.0] * (ranks.K - 3)
    assert ranks._normal(1) == ranks._normal(1.0) and ranks._normal([0.5, 2]) == ranks._normal((0.5, 2.0))
    assert ranks._normal(0.7) != ranks._normal(0.7000000000000001)
