"""The private data loaders (bpclip_fast.data): every batch claims its own counter value (no batch is
ever produced twice: two live iterators, prefetching workers, persistent-worker resets, resumed runs),
and the counter reports the number of examples of each delivered batch (``last_rows``)."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from bpclip_fast import data
from bpclip_fast.engine import InsecureSeedWarning, PrivacyEngine

N, FEATURES = 48, 3


def indexed_dataset(n=N):
    """Example i is (features [i, i, i], label i): a batch's labels are its dataset indices."""
    idx = torch.arange(n)
    return TensorDataset(idx.float().unsqueeze(1).expand(n, FEATURES).contiguous(), idx)


def transposed_collate(samples):
    """A custom collate that puts the batch in the last dimension: x is [FEATURES, rows], y is [rows]."""
    x, y = default_collate(samples)
    return x.T.contiguous(), y


def make_sampler(kind, n=N, seed=5, rank=0, world_size=1, counter=None, rate=0.25, batch=8):
    if kind == "poisson":
        return data.PoissonBatchSampler(n, rate, 4, seed, rank=rank, world_size=world_size, counter=counter)
    return data.ShuffleBatchSampler(n, batch, seed, rank=rank, world_size=world_size, counter=counter)


def make_loader(sampler, num_workers=0, persistent=False, collate=default_collate, dataset=None):
    return data.DPDataLoader(dataset or indexed_dataset(sampler.num_samples), sampler, collate_fn=collate,
                             num_workers=num_workers, persistent_workers=persistent)


def spy(sampler):
    """Records every ``t`` whose indices the sampler produces (the sampler runs in the main process)."""
    produced, indices = [], sampler.indices

    def recording(t):
        produced.append(t)
        return indices(t)

    sampler.indices = recording
    return produced


def members(batch):
    return tuple(batch[1].tolist())


def batch_t(sampler, t):
    """This rank's members of batch ``t`` (bypasses a spy)."""
    return tuple(type(sampler).indices(sampler, t))


# ---------------------------------------------------------------- defect 1: one batch per counter value


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["poisson", "shuffle"])
def test_two_live_iterators_never_yield_the_same_batch(kind, num_workers):
    sampler = make_sampler(kind, n=96)
    produced = spy(sampler)
    loader = make_loader(sampler, num_workers)
    it1, it2 = iter(loader), iter(loader)
    seen = []
    for _ in range(3):  # interleaved: 1, 2, 1, 2, ...
        seen.append(members(next(it1)))
        seen.append(members(next(it2)))
    assert all(seen)  # no empty batch: equal batches below would mean the same t
    assert len(set(seen)) == len(seen), "two live iterators delivered the same batch"
    assert len(set(produced)) == len(produced), f"a batch index t was produced twice: {produced}"
    assert sampler.counter.delivered == 6
    assert sampler.counter.claimed == len(produced) >= 6


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh_workers", "persistent_workers"])
@pytest.mark.parametrize("kind", ["poisson", "shuffle"])
def test_a_loop_broken_early_and_restarted_never_replays_a_batch(kind, persistent):
    sampler = make_sampler(kind, n=96)
    produced = spy(sampler)
    loader = make_loader(sampler, num_workers=2, persistent=persistent)
    seen = []
    for passes in range(3):
        for i, batch in enumerate(loader):
            seen.append(members(batch))
            if i == 1:
                break
    # The workers had prefetched beyond the 2 batches each loop used; those were skipped, not replayed.
    assert len(set(produced)) == len(produced), f"a batch index t was produced twice: {produced}"
    assert len(set(seen)) == len(seen) == 6
    assert produced == list(range(len(produced)))
    assert sampler.counter.delivered == 6 < sampler.counter.claimed == len(produced)
    # The next loop starts at the first batch not claimed.
    first, n = sampler.counter.claimed, len(produced)
    batch = next(iter(loader))
    assert produced[n] == first and members(batch) == batch_t(sampler, first)


def _quiet_make_private(engine, loader, seed=3):
    model = nn.Sequential(nn.Linear(FEATURES, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureSeedWarning)
        return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                   data_loader=loader, noise_multiplier=1.0, input_clip=1.0, grad_clip=1.0,
                                   noise_seed=seed)


def _step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y % 2).backward()
    opt.step()


def test_checkpoint_resumes_at_the_first_unclaimed_batch():
    ds = indexed_dataset(96)
    engine = PrivacyEngine()
    model, opt, loader = _quiet_make_private(engine, DataLoader(ds, batch_size=8, num_workers=2))
    produced_before = spy(loader.batch_sampler)
    used = []
    for i, batch in enumerate(loader):
        _step(model, opt, batch)
        used.append(members(batch))
        if i == 2:
            break
    state = engine.state_dict()

    resumed = PrivacyEngine()
    model2, opt2, loader2 = _quiet_make_private(resumed, DataLoader(ds, batch_size=8, num_workers=2), seed=4)
    resumed.load_state_dict(state)
    produced_after = spy(loader2.batch_sampler)
    batch = next(iter(loader2))
    _step(model2, opt2, batch)
    # The workers had prefetched beyond the 3 batches used: the resumed run starts after them.
    assert len(produced_before) > 3 and produced_after[0] not in produced_before, \
        f"the resumed run re-produced batch {produced_after[0]} (produced before: {produced_before})"
    assert members(batch) not in used
    assert state["batches_delivered"] == 3 and state["batches_claimed"] == len(produced_before)
    assert produced_after[0] == state["batches_claimed"]
    assert members(batch) == batch_t(loader2.batch_sampler, state["batches_claimed"])

    # A checkpoint written before "batches_claimed" existed resumes at the batches delivered.
    old = {k: v for k, v in state.items() if k != "batches_claimed"}
    again = PrivacyEngine()  # a fresh set-up: an engine that has stepped refuses to be rewound
    _quiet_make_private(again, DataLoader(ds, batch_size=8), seed=5)
    again.load_state_dict(old)
    assert again._counter.claimed == again._counter.delivered == 3


# ---------------------------------------------------------------- defect 2: last_rows


def test_counter_fields_and_constructor():
    c = data.BatchCounter(delivered=5)
    assert (c.delivered, c.claimed, c.last_rows, c.last_t) == (5, 5, 0, None)
    assert [c.claim(), c.claim()] == [5, 6] and c.claimed == 7 and c.delivered == 5
    assert data.BatchCounter(delivered=2, claimed=9).claimed == 9
    import copy
    import pickle
    assert pickle.loads(pickle.dumps(c)).claim() == copy.deepcopy(c).claim() == 7


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["poisson", "shuffle"])
def test_last_rows_is_the_size_of_the_delivered_batch(kind, num_workers):
    sampler = make_sampler(kind, rate=0.2)
    loader = make_loader(sampler, num_workers)
    sizes, ts = set(), []
    for _ in range(3):
        for x, y in loader:
            assert sampler.counter.last_rows == len(y) == x.shape[0]
            assert members((x, y)) == batch_t(sampler, sampler.counter.last_t)
            sizes.add(len(y))
            ts.append(sampler.counter.last_t)
    assert ts == list(range(len(ts))) and sampler.counter.delivered == len(ts)  # full passes: nothing skipped
    if kind == "poisson":
        assert len(sizes) > 2  # the sizes vary: last_rows follows them


@pytest.mark.parametrize("num_workers", [0, 2])
def test_last_rows_whatever_the_collate_returns(num_workers):
    sampler = make_sampler("poisson", rate=0.3)
    loader = make_loader(sampler, num_workers, collate=transposed_collate)
    rows = []
    for xt, y in loader:
        assert xt.shape[0] == FEATURES
        assert sampler.counter.last_rows == xt.shape[1] == len(y)
        rows.append(sampler.counter.last_rows)
    assert len(set(rows)) > 1 and FEATURES not in rows  # the batch dimension is not the first one


@pytest.mark.parametrize("kind", ["poisson", "shuffle"])
def test_last_rows_with_persistent_workers(kind):
    sampler = make_sampler(kind, n=96, rate=0.2)
    produced = spy(sampler)
    loader = make_loader(sampler, num_workers=2, persistent=True)
    delivered = []

    def check(batch):
        assert sampler.counter.last_rows == len(batch[1])
        assert members(batch) == batch_t(sampler, sampler.counter.last_t)
        delivered.append(sampler.counter.last_t)

    for stop in (1, None, 0, None):  # broken loops and full passes over the same workers
        for i, batch in enumerate(loader):
            check(batch)
            if i == stop:
                break
    # Two live iterators share the loader's one torch iterator: the second resets it under the first.
    it1 = iter(loader)
    check(next(it1))
    it2 = iter(loader)
    for _ in range(2):
        check(next(it2))
        check(next(it1))
    assert len(set(delivered)) == len(delivered) == sampler.counter.delivered
    assert len(set(produced)) == len(produced) == sampler.counter.claimed


@pytest.mark.parametrize("num_workers", [0, 2])
def test_empty_poisson_batches_have_zero_rows(num_workers):
    sampler = make_sampler("poisson", n=20, rate=0.04)
    loader = make_loader(sampler, num_workers)
    rows = []
    for _ in range(4):
        for x, y in loader:
            assert sampler.counter.last_rows == len(y) == x.shape[0]
            rows.append(sampler.counter.last_rows)
            if not rows[-1]:
                assert x.shape == (0, FEATURES) and y.shape == (0,)
    assert 0 in rows and any(rows)


@pytest.mark.parametrize("kind", ["poisson", "shuffle"])
def test_two_ranks_last_rows_are_their_shares_of_the_global_batch(kind):
    # Simulated DDP: one loader per rank (rank/world_size of the samplers), each with its own counter.
    single = make_sampler(kind, rate=0.3)
    loaders = [make_loader(make_sampler(kind, rate=0.3, rank=r, world_size=2)) for r in (0, 1)]
    shares = []
    for _ in range(2):
        for b0, b1 in zip(*loaders):
            c0, c1 = (loader.counter for loader in loaders)
            assert c0.last_t == c1.last_t
            glob = single.global_batch(c0.last_t).tolist()
            for r, (batch, c) in enumerate(((b0, c0), (b1, c1))):
                assert c.last_rows == len(batch[1])
                assert all(i % 2 == r for i in batch[1].tolist())
            assert c0.last_rows + c1.last_rows == len(glob)
            assert sorted(members(b0) + members(b1)) == sorted(glob)
            shares.append((c0.last_rows, c1.last_rows))
    assert len(shares) == 2 * len(loaders[0])
    assert any(a != b for a, b in shares)  # the shares are not a fixed split


class _FailsOnce(TensorDataset):
    def __init__(self, bad):
        ds = indexed_dataset()
        super().__init__(*ds.tensors)
        self.bad = bad

    def __getitem__(self, i):
        if i == self.bad:
            self.bad = None
            raise KeyError("transient failure")
        return super().__getitem__(i)


def test_a_failed_batch_is_skipped_and_the_rows_stay_in_step():
    sampler = make_sampler("shuffle")
    bad = sampler.indices(1)[0]  # a member of batch 1
    loader = make_loader(sampler, dataset=_FailsOnce(bad))
    it = iter(loader)
    next(it)
    with pytest.raises(KeyError, match="transient failure"):
        next(it)
    assert sampler.counter.delivered == 1 and sampler.counter.claimed == 2
    for x, y in loader:
        assert sampler.counter.last_rows == len(y)
        assert members((x, y)) == batch_t(sampler, sampler.counter.last_t)
        assert sampler.counter.last_t >= 2
