"""The private data loaders of :class:`bpclip_fast.PrivacyEngine`: Poisson and shuffled batches.

Both samplers are *counter-based*: batch ``t`` of a run is a function of (seed, t) only, so

- the batches of a run do not depend on the number of processes: with ``W`` ranks, rank ``r``
  gets the members of the global batch whose dataset index is ``≡ r (mod W)``, and the union over
  the ranks is exactly the batch a single process draws with the same seed;
- the sampler's state is one integer, the number of batches *claimed* (``BatchCounter.claimed``):
  every batch takes the next value of ``t`` when the sampler's iterator produces its indices, so
  no two batches ever share a ``t``, whether they come from two live iterators over the loader,
  from workers prefetching ahead of the training loop, or from a loader whose persistent workers
  were reset. The engine checkpoints it: a resumed run continues with batch ``claimed``.

Claimed is not delivered. Workers prefetch batches (``prefetch_factor · num_workers`` of them);
when a training loop stops early (``break``, an exception, a checkpoint), the batches they had
prefetched were claimed but never handed to the loop. They are skipped, never replayed: the next
loop (or the resumed run) starts at ``claimed``. Skipping is harmless to the sampling itself,
because which values of ``t`` are skipped depends only on how far the workers had read ahead,
never on the content of the batches:

- Poisson: every batch is an independent sample (its coins are keyed by ``t`` alone), so the
  batches the loop does use are still independent Poisson samples at rate ``q``.
- Shuffle: batch ``t`` of epoch ``e = t // steps_per_epoch`` is a fixed slice of epoch ``e``'s
  permutation, so an example is still in at most one batch of each epoch; a skipped slice only
  leaves its examples out of that epoch.

Caveat for accounting in shuffle mode: the zCDP accountant charges one epoch per
``steps_per_epoch`` consecutive *steps*, which is sound only if those steps' batches come from
one permutation epoch. After a skip (or a delivered batch whose step was refused) they need not:
an example can then be in several batches that are charged as one epoch. Sound accounting must
follow the permutation epoch of each step's batch, ``BatchCounter.last_t // steps_per_epoch``.

``BatchCounter.delivered`` counts the batches handed to the training loop (the engine allows one
per step), and ``BatchCounter.last_rows`` is the number of examples (this process's share) in the
last one delivered.

Poisson (``PoissonBatchSampler``): every example joins batch ``t`` independently with probability
``q``; its coin is ``u_t[i] < q`` with ``u_t`` a vector of ``N`` uniforms drawn from a generator
seeded by (seed, t). Batches may be empty; the loader then yields the collated structure with tensors
of shape ``[0, ...]`` and nothing of any example (:func:`_empty_like_batch`).

Shuffle (``ShuffleBatchSampler``, the zCDP setting): epoch ``e`` is a random permutation of the
``N`` indices (seeded by (seed, e)) cut into ``N // B`` disjoint batches of ``B``; the remainder is
left out of that epoch. Every example is in at most one batch of an epoch, whatever the data.

Cyclic Poisson (``CyclicPoissonBatchSampler``, ``bands = b > 1``: amplified BandMF, correlated
noise; accounting/cyclic.py): a fixed permutation of the ``N`` indices, from its own
``partition_seed``, cuts the data into ``b`` groups of ``m = N // b``; batch ``t`` is a Poisson
sample at rate ``q_g = B/m`` of group ``t mod b`` only, its coins keyed by (seed, t) as above. The
``N mod b`` examples after the last group are never sampled. An example is in at most one of any
``b`` consecutive *batches* (``t`` values); the accountant assumes step ``k`` used group ``k mod b``,
so the steps must follow the batches' ``t`` (skipped batches, above, shift them: see the class).

The seed must be secret: whoever knows it knows which examples were in which batch, and the
amplification by sampling is lost. The engine derives it from the noise seed (OS entropy unless
an explicit, insecure seed was given). Generators are torch's Mersenne Twister, as in Opacus'
non-secure mode.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Sampler


def derive_seed(seed: int, *labels) -> int:
    """A 63-bit seed derived from ``seed`` and ``labels`` (SHA-256), independent across labels."""
    text = ":".join(str(x) for x in (int(seed),) + labels).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


class BatchCounter:
    """The state of a private loader's sequence of batches.

    - ``claimed``: the number of batches the samplers' iterators have produced; the next batch
      produced is batch ``t = claimed`` (:meth:`claim`). This is the resume point a checkpoint
      stores: batches claimed but never delivered (prefetched when the loop stopped) are skipped.
    - ``delivered``: the number of batches :class:`DPDataLoader` has handed to the training loop.
    - ``last_rows``: the number of examples in the last batch delivered (this process's share of
      the global batch; 0 for an empty Poisson batch, and 0 before any batch is delivered).
    - ``last_t``: the counter value ``t`` of the last batch delivered (``None`` before any).

    ``BatchCounter(delivered=k)`` starts both counts at ``k``.
    """

    def __init__(self, delivered: int = 0, claimed: int | None = None):
        self.delivered = int(delivered)
        self.claimed = self.delivered if claimed is None else int(claimed)
        self.last_rows = 0
        self.last_t = None
        self._lock = threading.Lock()

    def claim(self) -> int:
        """Takes the next batch index ``t`` (thread-safe); no two calls return the same value."""
        with self._lock:
            t = self.claimed
            self.claimed = t + 1
        return t

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self):
        return (f"BatchCounter(delivered={self.delivered}, claimed={self.claimed}, last_rows={self.last_rows}, "
                f"last_t={self.last_t})")


class _Pass:
    """An iterator over ``len(sampler)`` batches of a counted sampler (what ``iter(sampler)`` returns).

    Nothing is claimed until ``next`` is called; each ``next`` claims ``t`` and returns this rank's
    indices of batch ``t``, and records ``(t, number of indices)`` in a FIFO that
    :class:`DPDataLoader` pops once per batch it delivers (a DataLoader with ``in_order=True``, the
    default and what DPDataLoader uses, delivers batches in the order its sampler iterator
    produced them, whatever its workers).
    """

    def __init__(self, sampler: "_CountedSampler"):
        self.sampler = sampler
        self.left = sampler.steps_per_epoch
        self.produced = collections.deque()

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.left <= 0:
            raise StopIteration
        self.left -= 1
        t = self.sampler.counter.claim()
        indices = self.sampler.indices(t)
        self.produced.append((t, len(indices)))
        return indices


class _CountedSampler(Sampler):
    """Common part: ``__iter__`` yields this rank's indices of ``len`` batches, each claiming its ``t``."""

    def __init__(self, num_samples: int, steps_per_epoch: int, seed: int, rank: int, world_size: int,
                 counter: BatchCounter):
        if num_samples <= 0:
            raise ValueError("the private data loader needs a non-empty dataset")
        self.num_samples = int(num_samples)
        self.steps_per_epoch = int(steps_per_epoch)
        self.seed = int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.counter = counter
        self._newest_pass = None

    def __len__(self):
        return self.steps_per_epoch

    def __getstate__(self):
        # The seed names every batch's members: pickled, it would tell a file's reader which examples
        # each step used (the loader's workers never need the sampler, which stays in this process).
        raise TypeError(f"{type(self).__name__} cannot be pickled or copied: it holds the secret sampling seed, "
                        "which says which examples each step used. Checkpoint with optimizer.state_dict() "
                        "(it holds the batch counters, never the seed) and resume into a fresh make_private set-up")

    def __iter__(self):
        """One pass of ``len(self)`` batches; each claims its ``t`` when the pass produces it."""
        it = _Pass(self)
        self._newest_pass = it
        return it

    def global_batch(self, t: int) -> torch.Tensor:
        raise NotImplementedError

    def indices(self, t: int) -> list[int]:
        """This rank's share of batch ``t``: the members with index ≡ rank (mod world size)."""
        batch = self.global_batch(t)
        if self.world_size > 1:
            batch = batch[batch % self.world_size == self.rank]
        return batch.tolist()


class PoissonBatchSampler(_CountedSampler):
    """Each example joins batch ``t`` independently with probability ``sample_rate``."""

    def __init__(self, num_samples, sample_rate, steps_per_epoch, seed, rank=0, world_size=1, counter=None):
        super().__init__(num_samples, steps_per_epoch, seed, rank, world_size, counter or BatchCounter())
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.sample_rate = float(sample_rate)

    def global_batch(self, t: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "poisson", t))
        coins = torch.rand(self.num_samples, generator=gen, dtype=torch.float64)
        return torch.nonzero(coins < self.sample_rate).flatten()


class CyclicPoissonBatchSampler(_CountedSampler):
    """Cyclic Poisson sampling for amplified BandMF (Choquette-Choo et al. 2023, arXiv:2306.08153).

    A permutation of ``range(N)`` drawn from ``partition_seed`` splits the data into ``bands`` groups
    of ``m = N // bands`` examples, group ``g = perm[g·m:(g+1)·m]``; the ``N mod bands`` examples
    after the last group are never sampled (left out of the run, warned about once). Batch ``t``
    holds each member of group ``t mod bands`` independently with probability ``sample_rate`` (the
    group rate ``q_g = B/m``): its coin is ``u[j] < q_g`` with ``u`` the ``m`` uniforms of a generator
    seeded by ``derive_seed(seed, "cyclic", t)``. So an example is in at most one of any ``bands``
    consecutive batches, whatever the seed and the data (b-min-separation).

    ``partition_seed`` is **not secret**: the analysis already lets the adversary know every
    example's group (only the coins, from ``seed``, must stay secret). It must survive a checkpoint:
    a resumed run must keep each example in its group, or an example could join two batches
    fewer than ``bands`` apart. It is a plain attribute: save ``sampler.partition_seed`` and, on
    resume, set it on the fresh sampler before its first batch is drawn (setting it later is
    refused). Default: ``derive_seed(seed, "partition")`` (the same on every rank, which share
    ``seed``); an independent value may be passed instead.

    Alignment with the steps: the accountant (``bands=b``) charges step ``k`` to group ``k mod b``,
    and a banded noise matrix correlates the noise of steps ``k..k+b-1``. Both need step ``k`` to
    use a batch of group ``k mod b`` (:meth:`group_of` its ``t``); a batch skipped (prefetched when a
    loop stopped, a refused step) breaks that unless the caller keeps steps and ``t`` in step.
    """

    def __init__(self, num_samples, sample_rate, bands, steps_per_epoch, seed, partition_seed=None, rank=0,
                 world_size=1, counter=None):
        super().__init__(num_samples, steps_per_epoch, seed, rank, world_size, counter or BatchCounter())
        from .accounting.cyclic import check_bands
        self.bands = check_bands(bands)
        self.group_size = self.num_samples // self.bands
        if self.group_size < 1:
            raise ValueError(f"bands={bands} exceeds the dataset size {num_samples}: every group would be empty")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate (the rate within a group) must be in (0, 1], got {sample_rate}")
        self.sample_rate = float(sample_rate)
        self._drawn = False
        self.partition_seed = derive_seed(self.seed, "partition") if partition_seed is None else partition_seed
        left_out = self.num_samples - self.bands * self.group_size
        if left_out:
            warnings.warn(f"cyclic Poisson sampling with bands={self.bands}: the dataset size {self.num_samples} "
                          f"is not a multiple of bands, so {left_out} example(s) are never sampled (each group "
                          f"has {self.group_size}); use a dataset size divisible by bands to train on all",
                          UserWarning, stacklevel=3)

    @property
    def partition_seed(self) -> int:
        return self._partition_seed

    @partition_seed.setter
    def partition_seed(self, value) -> None:
        if self._drawn:
            raise RuntimeError("partition_seed cannot change after this sampler drew a batch: an example could "
                               "move to another group and join two batches fewer than bands apart. Set it on the "
                               "fresh sampler of a resumed run, before its first batch")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"partition_seed must be an integer >= 0, got {value!r}")
        self._partition_seed = int(value)
        gen = torch.Generator().manual_seed(derive_seed(self._partition_seed, "partition"))
        self._partition = torch.randperm(self.num_samples, generator=gen)

    def group_of(self, t: int) -> int:
        """The group batch ``t`` samples from, ``t mod bands``."""
        return int(t) % self.bands

    def group(self, g: int) -> torch.Tensor:
        """The dataset indices of group ``g`` (in partition order)."""
        if not 0 <= g < self.bands:
            raise ValueError(f"group must be in [0, {self.bands}), got {g}")
        return self._partition[g * self.group_size:(g + 1) * self.group_size]

    def global_batch(self, t: int) -> torch.Tensor:
        self._drawn = True
        members = self.group(self.group_of(t))
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "cyclic", t))
        coins = torch.rand(self.group_size, generator=gen, dtype=torch.float64)
        return torch.sort(members[coins < self.sample_rate]).values


class ShuffleBatchSampler(_CountedSampler):
    """Disjoint batches of ``batch_size`` (global) from a fresh random permutation each epoch."""

    def __init__(self, num_samples, batch_size, seed, rank=0, world_size=1, counter=None):
        steps = num_samples // batch_size
        if steps < 1:
            raise ValueError(f"the batch size {batch_size} exceeds the dataset size {num_samples}")
        super().__init__(num_samples, steps, seed, rank, world_size, counter or BatchCounter())
        self.batch_size = int(batch_size)
        self._perm = (None, None)

    def global_batch(self, t: int) -> torch.Tensor:
        epoch, j = divmod(t, self.steps_per_epoch)
        if self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(derive_seed(self.seed, "shuffle", epoch))
            self._perm = (epoch, torch.randperm(self.num_samples, generator=gen))
        return self._perm[1][j * self.batch_size:(j + 1) * self.batch_size]


@dataclass(frozen=True)
class SamplingPlan:
    """How a private run samples its batches and what the accountant is told: the one derivation of
    sample rate, accounting rate and steps per epoch from (dataset size, per-process batch size,
    world size, sampling), used by ``make_private``, ``make_private_with_epsilon`` and the trainer.

    Poisson: rate ``q = W·batch_size/N`` (must be ≤ 1), ``round(N/(W·batch_size))`` batches per pass
    (at least 1), and the accountant is stepped with ``q``. Shuffle: ``N // (W·batch_size)``
    disjoint batches per epoch (the remainder sits out), and the zCDP accountant is stepped with
    ``1/steps_per_epoch``, so that steps·rate is the exact number of passes.

    ``bands = b > 1`` (Poisson only; amplified BandMF, :class:`CyclicPoissonBatchSampler`): batch
    ``t`` samples group ``t mod b`` of ``m = N // b`` examples at ``q_g = W·batch_size/m`` (must be
    ≤ 1, i.e. ``b·W·batch_size ≤ N``), so the expected batch size is unchanged; the accountant
    (``bands=b``) is stepped with ``accounting_rate = q_g``; ``sample_rate`` stays
    ``W·batch_size/N`` and ``steps_per_epoch`` is unchanged. The ``N mod b`` examples after the last
    group are never sampled (the sampler warns).
    """

    num_samples: int
    batch_size: int  # per process
    world_size: int
    poisson: bool
    bands: int = 1

    def __post_init__(self):
        from .accounting.cyclic import check_bands
        bands = check_bands(self.bands)
        object.__setattr__(self, "bands", bands)  # frozen: the validated int
        if bands == 1:
            return
        if not self.poisson:
            raise ValueError(f"bands={bands}: correlated (banded) noise needs cyclic Poisson sampling; shuffled "
                             "batches (poisson_sampling=False) are not analysed with it. Use Poisson sampling or bands=1")
        group = self.num_samples // bands
        if group < 1 or self.global_batch > group:
            raise ValueError(f"bands={bands} with batch size {self.global_batch} (batch_size·world_size) needs "
                             f"bands·batch size = {bands * self.global_batch} <= the dataset size {self.num_samples} "
                             f"(each batch is drawn from one group of {group} examples at rate batch size/group "
                             "size, which must be <= 1): use fewer bands or a smaller batch size")

    @classmethod
    def of_loader(cls, data_loader: DataLoader, world_size: int, poisson: bool, what: str,
                  bands: int = 1) -> "SamplingPlan":
        """The plan for a user's ``DataLoader``; ``what`` names the caller in error messages."""
        batch_size = data_loader.batch_size or getattr(data_loader.batch_sampler, "batch_size", None)
        if not batch_size:
            raise ValueError(f"{what}: the data loader has no batch_size (a custom batch_sampler?); build it "
                             "with DataLoader(dataset, batch_size=...)")
        try:
            n = len(data_loader.dataset)
        except TypeError:
            raise TypeError(f"{what}: the dataset must have a length (an IterableDataset cannot be sampled "
                            "privately)") from None
        if int(batch_size) * int(world_size) > n:
            raise ValueError(f"{what}: batch_size·world_size = {int(batch_size) * int(world_size)} exceeds the "
                             f"dataset size {n}")
        try:
            return cls(int(n), int(batch_size), int(world_size), bool(poisson), bands)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def sample_rate(self) -> float:
        return self.global_batch / self.num_samples

    @property
    def steps_per_epoch(self) -> int:
        if self.poisson:
            return max(1, round(self.num_samples / self.global_batch))
        return self.num_samples // self.global_batch

    @property
    def group_size(self) -> int:
        """``N // bands``: the examples of one cyclic group (``N`` for ``bands=1``)."""
        return self.num_samples // self.bands

    @property
    def accounting_rate(self) -> float:
        if self.bands > 1:
            return self.global_batch / self.group_size
        return self.sample_rate if self.poisson else 1.0 / self.steps_per_epoch

    def sampler(self, seed: int, rank: int, counter: BatchCounter, partition_seed: int | None = None
                ) -> "_CountedSampler":
        """``partition_seed`` (``bands > 1`` only): the groups' seed, saved with a checkpoint and passed
        again on resume (:class:`CyclicPoissonBatchSampler`); ``None``: derived from ``seed``."""
        if self.bands > 1:
            return CyclicPoissonBatchSampler(self.num_samples, self.accounting_rate, self.bands, self.steps_per_epoch,
                                             seed, partition_seed, rank, self.world_size, counter)
        if self.poisson:
            return PoissonBatchSampler(self.num_samples, self.sample_rate, self.steps_per_epoch, seed, rank,
                                       self.world_size, counter)
        return ShuffleBatchSampler(self.num_samples, self.global_batch, seed, rank, self.world_size, counter)


def _empty_like_batch(batch):
    """The structure of a collated batch (the first example's) with every tensor cut to 0 rows: an
    empty draw must hold nothing of any example. Any Mapping keeps its type (Hugging Face's
    ``BatchEncoding`` is a ``UserDict``: returned whole, every empty draw handed the loop the first
    example); a list of non-tensor leaves (``default_collate``'s batch of strings) is the examples'
    and becomes empty; a 0-dimensional tensor (a custom collate's count over the batch) is 0 over no
    example."""
    if isinstance(batch, torch.Tensor):
        return batch[:0] if batch.dim() else torch.zeros_like(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_empty_like_batch(b) for b in batch))
    if isinstance(batch, (list, tuple)):
        if batch and not any(isinstance(b, (torch.Tensor, list, tuple, Mapping)) for b in batch):
            return type(batch)()
        return type(batch)(_empty_like_batch(b) for b in batch)
    if isinstance(batch, Mapping):
        empty = {k: _empty_like_batch(v) for k, v in batch.items()}
        try:
            return type(batch)(empty)
        except Exception:  # noqa: BLE001  a Mapping type that is not built from a dict: model(**batch) takes a dict
            return empty
    return batch


class EmptyBatchCollate:
    """Wraps a ``collate_fn`` so that an empty index list gives tensors of shape ``[0, ...]``.

    The template is the collation of the dataset's first example, cut to zero rows; a model can
    then run forward and backward on the empty batch (zero gradient, plus the step's noise).
    """

    def __init__(self, collate_fn, dataset):
        self.collate_fn = collate_fn
        self.dataset = dataset
        self._template = None

    def __call__(self, batch):
        if len(batch) > 0:
            return self.collate_fn(batch)
        if self._template is None:
            self._template = _empty_like_batch(self.collate_fn([self.dataset[0]]))
        return self._template


class DPDataLoader(DataLoader):
    """A ``DataLoader`` over a counter-based private batch sampler; counts the batches it delivers.

    ``len(loader)`` is the number of batches of one pass (an "epoch"). Iterating starts at the
    first batch not yet claimed, so a new ``for`` loop (or a resumed run) continues the sequence
    of batches instead of restarting it; batches prefetched by the workers of a loop that stopped
    early are skipped (module docstring). For every batch it delivers, the loader sets the
    counter's ``delivered`` (+1), ``last_rows`` and ``last_t``.
    """

    def __init__(self, dataset, batch_sampler: _CountedSampler, *, collate_fn, num_workers=0, pin_memory=False,
                 timeout=0, worker_init_fn=None, multiprocessing_context=None, persistent_workers=False,
                 prefetch_factor=None):
        kwargs = {}
        if num_workers > 0 and prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
        super().__init__(dataset, batch_sampler=batch_sampler, collate_fn=EmptyBatchCollate(collate_fn, dataset),
                         num_workers=num_workers, pin_memory=pin_memory, timeout=timeout,
                         worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                         persistent_workers=persistent_workers and num_workers > 0, **kwargs)
        self.counter = batch_sampler.counter
        # Called with t before batch t is handed over; may refuse it (the engine's budget: an uncharged
        # PrivacyBudgetError, a function of public counters). A refused batch is skipped, as a prefetched one.
        self.before_delivery = None
        # torch's iterator -> the sampler pass it reads. With persistent workers every ``iter(loader)``
        # resets the one shared torch iterator onto a new pass, so the pass is looked up per batch.
        self._pass_of = weakref.WeakKeyDictionary()

    @property
    def sample_rate(self):
        return getattr(self.batch_sampler, "sample_rate", None)

    def __iter__(self):
        sampler = self.batch_sampler
        before = sampler._newest_pass
        batches = super().__iter__()  # creates (persistent workers: resets) the torch iterator and its pass
        if sampler._newest_pass is before:
            raise RuntimeError("DPDataLoader: the DataLoader did not create a sampler iterator when iterated; "
                               "cannot tell which batches it delivers")
        self._pass_of[batches] = sampler._newest_pass
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except BaseException:
                # Whether the failed batch was consumed is unknown: nothing may pop this pass again.
                self._pass_of.pop(batches, None)
                raise
            current = self._pass_of.get(batches)
            if current is None or not current.produced:
                raise RuntimeError("DPDataLoader: a batch arrived from a loader iterator that failed or was reset; "
                                   "start a new loop over the loader")
            t, rows = current.produced.popleft()
            if self.before_delivery is not None:
                self.before_delivery(t)
            self.counter.delivered += 1
            self.counter.last_rows = rows
            self.counter.last_t = t
            yield batch
