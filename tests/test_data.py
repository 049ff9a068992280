"""The private data loaders (bpclip_fast.data): every batch claims its own counter value (no batch is
ever produced twice: two live iterators, prefetching workers, persistent-worker resets, resumed runs)."""

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
    resumed.load_state_dict(old)
    assert resumed._counter.claimed == resumed._counter.delivered == 3


def test_counter_fields_and_constructor():
    c = data.BatchCounter(delivered=5)
    assert (c.delivered, c.claimed) == (5, 5)
    assert [c.claim(), c.claim()] == [5, 6] and c.claimed == 7 and c.delivered == 5
    assert data.BatchCounter(delivered=2, claimed=9).claimed == 9
    import copy
    import pickle
    assert pickle.loads(pickle.dumps(c)).claim() == copy.deepcopy(c).claim() == 7
