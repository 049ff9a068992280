"""Cyclic Poisson sampling (amplified BandMF): CyclicPoissonBatchSampler and SamplingPlan(bands=...).

The properties the accounting (accounting/cyclic.py) rests on, checked exhaustively where they
are combinatorial and against a binomial bound where they are random.
"""

import math
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import data
from bpclip_fast.data import BatchCounter, CyclicPoissonBatchSampler, PoissonBatchSampler, SamplingPlan


def sampler(n=100, q=0.3, b=5, seed=7, partition_seed=None, rank=0, world_size=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the left-over warning has its own test
        return CyclicPoissonBatchSampler(n, q, b, 10, seed, partition_seed, rank, world_size)


def appearances(s, T):
    """example -> the batches t < T that hold it."""
    seen = {}
    for t in range(T):
        for i in s.global_batch(t).tolist():
            seen.setdefault(i, []).append(t)
    return seen


@pytest.mark.parametrize("n,b,q,seed", [(100, 5, 0.6, 1), (103, 7, 0.9, 2), (64, 64, 1.0, 3), (50, 2, 0.4, 4)])
def test_every_example_is_in_at_most_one_of_any_b_consecutive_batches(n, b, q, seed):
    s = sampler(n, q, b, seed)
    T = 40 * b
    seen = appearances(s, T)
    assert seen  # the check below is not vacuous
    group_of_example = {i: g for g in range(b) for i in s.group(g).tolist()}
    for i, ts in seen.items():
        assert all(t2 - t1 >= b for t1, t2 in zip(ts, ts[1:])), (i, ts)
        assert {t % b for t in ts} == {group_of_example[i]}
    # with q = 1 the separation is attained: every example in every batch of its group, exactly b apart
    if q == 1.0:
        assert all(ts == list(range(ts[0], T, b)) for ts in seen.values())


def test_partition_is_a_permutation_of_equal_groups_and_left_overs_are_never_sampled():
    n, b = 103, 5  # m = 20; 3 examples are left over
    s = sampler(n, 1.0, b)
    groups = [s.group(g).tolist() for g in range(b)]
    assert all(len(g) == 20 for g in groups)
    members = [i for g in groups for i in g]
    assert len(set(members)) == 100 and set(members) <= set(range(n))
    left = set(range(n)) - set(members)
    assert len(left) == 3
    sampled = set()
    for t in range(3 * b):
        batch = s.global_batch(t).tolist()
        assert batch == sorted(groups[t % b])  # q_g = 1: the whole group, nothing else
        sampled |= set(batch)
    assert sampled == set(members) and not sampled & left


def test_left_over_examples_warned_once_per_sampler():
    with pytest.warns(UserWarning, match="3 example.*never sampled"):
        CyclicPoissonBatchSampler(103, 0.5, 5, 10, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = CyclicPoissonBatchSampler(100, 0.5, 5, 10, seed=1)
        for t in range(10):
            s.global_batch(t)  # drawing never warns again


def test_group_rates_within_a_binomial_bound():
    """Batch t's coins are independent Bernoulli(q_g) over group t mod b (independent generators per
    t). Over K batches of each group, group g's total X_g ~ Binomial(m·K, q_g) and each example's count
    ~ Binomial(K, q_g). With z = 6 the two-sided normal tail is 2e-9 per quantity; over b groups and n
    examples the union bound is < 3e-7 (and the seeds are fixed, so the outcome is reproducible)."""
    n, b, B = 600, 6, 12
    m = n // b
    q_g = B / m
    s = sampler(n, q_g, b, seed=11)
    K = 400  # batches per group
    per_example = torch.zeros(n, dtype=torch.float64)
    per_group = [0] * b
    for t in range(K * b):
        batch = s.global_batch(t)
        per_group[t % b] += len(batch)
        per_example[batch] += 1
    z = 6.0
    for g in range(b):
        mean, sd = m * K * q_g, math.sqrt(m * K * q_g * (1 - q_g))
        assert abs(per_group[g] - mean) <= z * sd, (g, per_group[g], mean)
    mean, sd = K * q_g, math.sqrt(K * q_g * (1 - q_g))
    assert torch.all((per_example - mean).abs() <= z * sd)
    # the plain rate B/n would give a b times smaller mean: the bound tells them apart
    assert abs(sum(per_group) / (K * b) - B) <= z * math.sqrt(m * q_g * (1 - q_g) / K)
    assert z * math.sqrt(m * q_g * (1 - q_g) / K) < B - B / b


def test_counter_based_determinism():
    a, b_ = sampler(seed=5), sampler(seed=5)
    ts = [0, 17, 3, 99, 17, 1000003]
    first = {t: a.global_batch(t).tolist() for t in ts}
    for t in reversed(ts):  # another order, another object: the same batches
        assert b_.global_batch(t).tolist() == first[t]
    other = sampler(seed=6)
    assert any(other.global_batch(t).tolist() != first[t] for t in ts)


def test_ranks_union_is_the_single_process_batch():
    n, b, q, W = 97, 4, 0.5, 3
    single = sampler(n, q, b, seed=9)
    ranks = [sampler(n, q, b, seed=9, rank=r, world_size=W) for r in range(W)]
    for t in range(30):
        shares = [r.indices(t) for r in ranks]
        assert sorted(i for sh in shares for i in sh) == single.global_batch(t).tolist()
        assert all(i % W == r for r, sh in enumerate(shares) for i in sh)


def test_partition_independent_of_sampling_seed_and_survives_resume():
    p1, p2 = sampler(seed=1, partition_seed=42), sampler(seed=2, partition_seed=42)
    assert all(torch.equal(p1.group(g), p2.group(g)) for g in range(5))
    assert any(p1.global_batch(t).tolist() != p2.global_batch(t).tolist() for t in range(5))
    assert not torch.equal(sampler(seed=1, partition_seed=43)._partition, p1._partition)
    # default: derived from the seed, the same for every rank
    d = sampler(seed=1)
    assert d.partition_seed == data.derive_seed(1, "partition")
    assert torch.equal(d._partition, sampler(seed=1, rank=1, world_size=2)._partition)
    # resume: a fresh sampler given the saved partition_seed has the same groups
    fresh = sampler(seed=1)
    fresh.partition_seed = p1.partition_seed
    assert torch.equal(fresh._partition, p1._partition)
    assert fresh.global_batch(3).tolist() == p1.global_batch(3).tolist()
    with pytest.raises(RuntimeError, match="partition_seed"):
        fresh.partition_seed = 7  # after a draw: an example could change group mid-run
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="partition_seed"):
            sampler(partition_seed=bad)


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="bands"):
        CyclicPoissonBatchSampler(100, 0.5, 0, 10, seed=1)
    with pytest.raises(ValueError, match="bands=200 exceeds"):
        CyclicPoissonBatchSampler(100, 0.5, 200, 10, seed=1)
    with pytest.raises(ValueError, match="sample_rate"):
        CyclicPoissonBatchSampler(100, 1.5, 5, 10, seed=1)


# --------------------------------------------------------------------------- SamplingPlan

def test_plan_with_bands():
    plan = SamplingPlan(1000, 10, 2, True, bands=5)  # global batch 20, groups of 200
    assert plan.accounting_rate == 20 / 200 and plan.group_size == 200
    assert plan.sample_rate == 20 / 1000
    assert plan.steps_per_epoch == SamplingPlan(1000, 10, 2, True).steps_per_epoch == 50
    s = plan.sampler(3, 1, BatchCounter(), partition_seed=8)
    assert isinstance(s, CyclicPoissonBatchSampler)
    assert (s.sample_rate, s.bands, s.partition_seed, s.rank, s.world_size) == (0.1, 5, 8, 1, 2)
    # bands = 1 is the plain plan
    plain = SamplingPlan(1000, 10, 2, True)
    assert plain.bands == 1 and plain.accounting_rate == plain.sample_rate
    assert type(plain.sampler(3, 0, BatchCounter())) is PoissonBatchSampler


def test_plan_refusals_name_bands():
    with pytest.raises(ValueError, match="bands=4.*Poisson"):
        SamplingPlan(1000, 10, 1, False, bands=4)
    with pytest.raises(ValueError, match="bands=11 with batch size 100.*1100"):
        SamplingPlan(1000, 50, 2, True, bands=11)
    SamplingPlan(1000, 50, 2, True, bands=10)  # b·B = N: q_g = 1 is allowed
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="bands"):
            SamplingPlan(1000, 10, 1, True, bands=bad)


def test_plan_of_loader_passes_bands():
    loader = DataLoader(TensorDataset(torch.zeros(1000, 2)), batch_size=25)
    plan = SamplingPlan.of_loader(loader, 1, True, "make_private", bands=4)
    assert plan.bands == 4 and plan.accounting_rate == 25 / 250
    assert SamplingPlan.of_loader(loader, 1, True, "make_private").bands == 1
    with pytest.raises(ValueError, match="^make_private: bands=41"):
        SamplingPlan.of_loader(loader, 1, True, "make_private", bands=41)
