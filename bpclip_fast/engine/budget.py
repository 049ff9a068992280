"""The ε budget (``max_epsilon`` at ``delta``) and the accountant's charges (module docstring of
:mod:`bpclip_fast.engine`, "Budget").

A charged event may only happen where the budget covers its charge (:func:`covers`): the private
loader does not hand over a batch the budget cannot charge with those drawn since the last step,
and every training forward, backward pass and step asks before anything whose refusal is charged.
Those refusals (``PrivacyBudgetError``) depend only on the public accountant and batch counters,
and are not charged. The state lives on the engine (its counters are checkpointed with it); these
functions are the one home of the rules over it.
"""

from __future__ import annotations

from . import correlated
from ._common import accounting


def init(engine, max_epsilon, delta) -> None:
    """The step counters and the budget ``step()`` enforces."""
    engine._steps = 0
    engine._taken_here = 0  # steps taken since make_private or the last load_state_dict
    engine._delivered_at_step = 0
    engine._max_epsilon = None if max_epsilon is None else float(max_epsilon)
    engine._delta = None if delta is None else float(delta)
    engine._budget_cache = None


def steps_left(engine) -> int:
    """How many more steps keep ε ≤ max_epsilon (the accountant's bisection, cached; asked at every
    training forward, so the key is what σ_eff is computed from, not σ_eff itself)."""
    key = (engine._noise_multiplier, len(engine._layers), engine._accounting_rate, engine.max_epsilon, engine.delta)
    base = len(engine.accountant)
    cache = engine._budget_cache
    if cache is not None and cache[0] == key and cache[1] <= base <= cache[1] + cache[2]:
        return cache[2] - (base - cache[1])
    left = engine.accountant.max_steps(engine.max_epsilon, engine.delta,
                                       noise_multiplier=engine.effective_noise_multiplier,
                                       sample_rate=engine._accounting_rate)
    engine._budget_cache = (key, base, left)
    return left


def drawn(engine) -> int:
    """Batches the private loader delivered since the last step (or refusal)."""
    return engine._counter.delivered - engine._delivered_at_step


def need(engine, next_t=None) -> int:
    """The accountant steps a charged refusal now would add (with ``next_t``: after batch
    ``next_t`` is delivered too); at least one, since no step is begun that the budget cannot
    hold. Poisson: one per batch drawn since the last step (``refusal.refuse``); shuffled and
    banded noise: the accountant goes to length ``t + 1`` for the last batch ``t`` (:func:`charge`),
    which may be ahead of it after skipped batches (the same rule as the charge: a gate that counted
    batches drawn let a banded step past ``max_epsilon``)."""
    n, t = drawn(engine), engine._counter.last_t
    if next_t is not None:
        n, t = n + 1, next_t
    if engine.poisson_sampling and engine._band is None:
        return max(1, n)
    if engine._band is not None and n == 0:  # a refusal with no batch of its own: b skipped rows (charge)
        return max(1, engine._counter.claimed + engine.bands - len(engine.accountant))
    return max(1, charged_batch(engine, t) + 1 - len(engine.accountant))


def charged_batch(engine, t=None) -> int:
    """Shuffled batches: the batch a charge now is for, ``t`` (default the last delivered). Before
    any was delivered (a refusal before the loop's first batch) it is the next to be claimed: its
    epoch's charge, the same ρ whatever of the epoch is used."""
    t = engine._counter.last_t if t is None else t
    return engine._counter.claimed if t is None else t


def covers(engine, next_t=None) -> bool:
    """Whether ``max_epsilon`` covers ``need(next_t)``. A charged event may only happen where the
    budget covers its charge, so this is asked before anything whose refusal is charged, and a
    ``False`` is refused uncharged: it depends only on the public accountant and batch counters."""
    return engine.max_epsilon is None or steps_left(engine) >= need(engine, next_t)


def require(engine, what: str, next_t=None) -> None:
    """Raises ``PrivacyBudgetError`` (not charged) unless ``covers(next_t)``."""
    if covers(engine, next_t):
        return
    raise accounting().PrivacyBudgetError(
        f"{what} refused: {need(engine, next_t)} more step(s) could be charged for it, and after "
        f"{steps_left(engine)} more ε would exceed max_epsilon={engine.max_epsilon:g} at δ={engine.delta:g} (spent "
        f"so far: ε={engine.get_epsilon(engine.delta):.4g} over {engine.steps} steps; {drawn(engine)} batch(es) drawn "
        "since the last step, each charged if refused). Nothing the budget cannot cover is computed: take "
        "one optimizer.step() per batch drawn, or stop training")


def before_delivery(engine, t: int) -> None:
    """The private loader's gate: batch ``t`` is handed to the loop only if the budget covers it
    with the batches drawn since the last step (a second batch drawn is charged, per batch)."""
    require(engine, "the private data loader's next batch", next_t=t)


def charge(engine) -> None:
    """One step of the accountant for the batch delivered last (taken or refused).

    Shuffled batches: the zCDP accountant charges each group of ``steps_per_epoch`` consecutive
    steps as one epoch, which is sound only if a group's batches come from one permutation
    epoch. Batches claimed but never used (prefetched when a loop stopped, a refused step)
    would shift the groups, so the accountant is kept at length ``t + 1`` for batch ``t``:
    skipped batches are charged as steps of their own epoch (same σ: no more than that
    epoch's cost), and a second charge for the same batch is not added (same group, same σ:
    it would not change ρ)."""
    kw = dict(noise_multiplier=engine.effective_noise_multiplier, sample_rate=engine._accounting_rate)
    engine._taken_here += 1
    if engine.poisson_sampling and engine._band is None:
        engine.accountant.step(**kw)
        return
    # Shuffled, and correlated noise: the accountant's step k is batch k. Under banded noise batch t is
    # row t of the noise and comes from group t mod b, so the banded accountant's positions are the
    # groups; a skipped batch is a row with no release, charged (rows are made for it: correlated.commit).
    t = charged_batch(engine)
    if engine._band is not None and drawn(engine) == 0:
        # A charged refusal with no batch drawn since the last step (a training forward refused on its
        # input's shape) is tied to no row: the last batch's row is charged already, and the data may be
        # any group's. It is charged as b skipped rows (claimed, never delivered): one event for every
        # group, and the rows stay the batches.
        for _ in range(engine.bands):
            engine._counter.claim()
        t = engine._counter.claimed - 1
    for _ in range(t + 1 - len(engine.accountant)):
        engine.accountant.step(**kw)
    if engine._counter.last_t is not None:  # rows exist only for batches delivered
        correlated.commit(engine, engine._counter.last_t)
