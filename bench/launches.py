"""Host cost of one training step: leaf ops with data work, host syncs, host time, against non-private.

    python -m bench.launches                       # ViT, ResNet-20-GN, digits, MNIST, CIFAR-10 nets
    python -m bench.launches --models vit --methods nonprivate,flat --ops   # + the op histogram
    python -m bench.launches --expected-batch 2.5  # the mean loss's d/B̄ != 1, as in a Poisson step

On a GPU every leaf op that does data work is a kernel launch and every host sync a stall, and small
and medium models are bound by those, not by FLOPs. Both can be counted on a CPU, and so can the
Python time around them: this report measures them for each model and method in one process, at
batch 2 on one thread, and prints each as a ratio to the non-private step of the same model.

**One step** is what a training loop does per batch after the loader delivered it: ``zero_grad``,
forward, loss, backward, ``optimizer.step()``. The batch is fetched outside the counted region (the
loader's own work is not the step's). bpclip_fast's methods run through ``PrivacyEngine.make_private``
(Poisson sampling at q = 1, so every batch is both examples; the mean loss), Opacus' through its own
``make_private`` (``poisson_sampling=False``, the sum loss, as ``bench.step``), both with σ = 1 and
clipping norm 1.

**How an op is counted** (the step's ops as dispatched below autograd, by a ``TorchDispatchMode``,
after warm-up steps; on a GPU each is one kernel launch):

- composites (``linear``, ``cross_entropy_loss``) are already decomposed there, so they count
  through the ops they run (``addmm``, ``_log_softmax``, ``nll_loss_forward``);
- an ATen op with data work counts once; views (the schema returns an alias of an input: ``view``,
  ``t``, ``slice``, ``expand``, ...), allocation and metadata ops (``empty*``, ``resize_``,
  ``detach``, ``as_strided_``, ...) and syncs count zero;
- an extension (``bpclip_fast::``) op with a kernel of its own (``clip_rows``, ``philox_noise_``,
  ``exact_bound_``, ...) counts once *plus* whatever its CPU implementation calls; a composite one
  (registered ``CompositeExplicitAutograd``: the layer and exact ops of csrc/layers.cpp and
  csrc/exact.cpp, written once over ATen for every backend) counts only what it calls. What an
  extension op calls is read from ``torch.profiler`` events of another step, call by call in call
  order (one op's calls can take different routes): the innermost ATen events with data work, and
  the extension kernels (each once, plus theirs). So fusing a Python chain into a C++ op that
  still calls ATen op by op does not flatter the count;
- a *host sync* is ``_local_scalar_dense`` (``item``, ``bool``, ``int``, ``float`` of a tensor),
  ``nonzero``, ``equal``/``allclose``, or a Python-level ``Tensor.tolist/numpy/cpu`` during the step
  (patched for the counted step only).

Host time is the median time of ``--reps`` steps at batch 2 with ``torch.set_num_threads(1)``,
profiler off; at batch 2 almost all of it is Python and dispatch, which is what a GPU step waits on.
The methods of one model are timed in ``--rounds`` interleaved blocks (each block's first step, the one
after the switch, is not counted), so a drift of the machine (another process, frequency) falls on
every method alike instead of on whichever ran last; ``--clock cpu`` reads this process's CPU time
instead of the wall clock (on a shared machine: the time others took is not counted).

``--breakdown N`` prints, per method, the N entries of ``torch.profiler``'s self CPU time per step that
grew most over non-private: the Python bodies of autograd nodes (``_ExactLayerBackward``: the node's
own Python, its ops counted apart), the engine's ``AccumulateGrad`` (with the gradient hooks it runs),
each op. Where a private step's host time goes, to aim the next change at.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import statistics
import sys
import time
import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import models as bmodels

SIGMA, CLIP, LR, BATCH = 1.0, 1.0, 0.01, 2

MODELS = {  # name -> (factory, input shape, classes)
    "vit": (lambda: bmodels.vit(), (1, 28, 28), 10),
    "resnet20-gn": (lambda: bmodels.resnet20_gn(), (1, 28, 28), 10),
    "digits": (lambda: bmodels.digits_net(), (1, 8, 8), 10),
    "mnist": (lambda: bmodels.mnist_net(nn.Tanh), (1, 28, 28), 10),
    "cifar10": (lambda: bmodels.cifar10_net(nn.Tanh), (3, 32, 32), 10),
}


def _bench_models():
    """bench.step's models not named above (issue 26's: lstm, transformer, conv1d, gpt2, ...), on
    request: ``--models transformer,conv1d``."""
    from bench import models as step_models

    return {name: (lambda f=f: f(nn.Tanh), shape, classes)
            for name, (f, shape, classes) in step_models.MODELS.items() if name not in MODELS}


MODELS.update(_bench_models())
DEFAULT_MODELS = ("vit", "resnet20-gn", "digits", "mnist", "cifar10")
METHODS = ("nonprivate", "backprop", "flat", "per_layer", "opacus_ghost", "opacus_hooks", "flat_generic", "flat_banded",
           "flat_instantiate", "flat_integer", "flat_unchecked")
# The last five: the generic path, banded noise, instantiated norms (bench.methods), the integer release
# (integer_noise=True), and flat with the step boundary's bookkeeping switched off (_uncheck: a
# measurement of that bookkeeping's share, NOT private).
ON_REQUEST = 5

_ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_",
          "lift_fresh", "detach", "detach_", "result_type", "is_same_size", "sym_size", "sym_stride",
          "sym_numel", "_has_compatible_shallow_copy_type", "is_nonzero", "item", "record_stream",
          "_reshape_alias", "_unsafe_view", "contiguous", "reshape", "to", "_to_copy", "type_as",
          "resolve_conj", "resolve_neg", "view_as", "expand_as", "flatten", "unflatten", "chunk",
          "split", "unbind", "lift_fresh_copy", "as_strided_"}
SYNCS = {"_local_scalar_dense", "nonzero", "equal", "allclose"}
_PY_SYNCS = ("tolist", "numpy", "cpu")


def _is_view(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return False
    try:  # overloads returning a Tensor (``slice.str`` returns a str)
        schemas = [s for s in (getattr(packet, o)._schema for o in packet.overloads())
                   if s.returns and str(s.returns[0].type) == "Tensor"]
    except Exception:  # noqa: BLE001 -- an op without introspectable overloads is counted
        return False
    return bool(schemas) and all(s.returns[0].alias_info is not None and not s.returns[0].alias_info.is_write
                                 for s in schemas)


_VIEW_CACHE: dict = {}


def _composite(name: str) -> bool:
    """An extension op written over ATen and other extension ops for every backend (csrc/exact.cpp,
    csrc/layers.cpp): it launches nothing of its own, only what it calls."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")


def _kind(name: str) -> str | None:
    """'ext' (an extension kernel), 'composite' (an extension op over other ops), 'aten' (data
    work), 'sync', 'free' (views, allocation, metadata) or None (not an op)."""
    ns, _, op = name.partition("::")
    if ns == "bpclip_fast":
        return "composite" if _composite(name) else "ext"
    if ns != "aten":
        return None
    if op in SYNCS:
        return "sync"
    if op in _ALLOC:
        return "free"
    if op not in _VIEW_CACHE:
        _VIEW_CACHE[op] = _is_view(op)
    return "free" if _VIEW_CACHE[op] else "aten"


class _Ops(TorchDispatchMode):
    """Records the name of every op dispatched below autograd (composites already decomposed)."""

    def __init__(self):
        super().__init__()
        self.names: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(f"{func.namespace}::{func.__name__.split('.')[0]}")
        return func(*args, **(kwargs or {}))


def inner_leaves(events) -> dict:
    """Extension op name -> the ATen leaves with data work its CPU implementation calls, one entry per
    call in call order (from profiler events: innermost ATen events under it, views/allocation/syncs
    excluded). Only calls made from outside any extension op are listed: those are the ones the
    dispatch mode sees (an op's own inner calls are in its entry)."""
    kinds = {id(e): _kind(e.name) for e in events}

    def leaves(e) -> int:  # an extension kernel inside counts once plus its own leaves
        n = 0
        for c in e.cpu_children:
            below, k = leaves(c), kinds.get(id(c))
            n += below + 1 if k == "ext" else below if below or k != "aten" else 1
        return n

    def top(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if kinds.get(id(p)) in ("ext", "composite"):
                return False
            p = p.cpu_parent
        return True
    per: dict = collections.defaultdict(list)
    for e in sorted(events, key=lambda e: e.time_range.start):
        if kinds[id(e)] in ("ext", "composite") and top(e):
            per[e.name].append(leaves(e))
    return dict(per)


def count(names, inner: dict) -> tuple[int, int, collections.Counter]:
    """(leaf ops with data work, host syncs, histogram) of the dispatched op names of one step. The
    k-th call of an extension op counts the leaves of the k-th call in ``inner`` (the same step's
    calls in the same order: one op's calls can differ, e.g. a layer that keeps its per-example
    gradients releases them by another route); past the end of its list, the most any call had."""
    ops, syncs, hist, seen = 0, 0, collections.Counter(), collections.Counter()
    for name in names:
        k = _kind(name)
        if k == "sync":
            syncs += 1
        elif k == "aten":
            ops += 1
            hist[name] += 1
        elif k in ("ext", "composite"):
            calls = inner.get(name, [])
            below = calls[seen[name]] if seen[name] < len(calls) else max(calls, default=0)
            seen[name] += 1
            n = (k == "ext") + below
            ops += n
            hist[name] += n
    return ops, syncs, hist


@contextlib.contextmanager
def python_syncs(counter: list):
    """Counts ``Tensor.tolist/numpy/cpu`` calls while active (they read device data on a GPU)."""
    saved = {n: getattr(torch.Tensor, n) for n in _PY_SYNCS}

    def wrap(orig):
        def f(self, *a, **k):
            counter[0] += 1
            return orig(self, *a, **k)
        return f
    try:
        for n, orig in saved.items():
            setattr(torch.Tensor, n, wrap(orig))
        yield
    finally:
        for n, orig in saved.items():
            setattr(torch.Tensor, n, orig)


def _data(name: str, seed: int):
    _, shape, classes = MODELS[name]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((BATCH,) + shape, generator=gen), torch.randint(0, classes, (BATCH,), generator=gen)


def build(method: str, name: str, seed: int = 0, expected_batch: float | None = None):
    """(fetch, step): ``fetch()`` returns the next batch (uncounted), ``step(batch)`` trains on it.
    ``expected_batch``: bpclip_fast's mean loss divides by this B̄ instead of the loader's batch size
    (``--expected-batch``)."""
    torch.manual_seed(seed)
    model = MODELS[name][0]()
    x, y = _data(name, seed)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    if method == "nonprivate":
        opt, crit = torch.optim.SGD(model.parameters(), lr=LR), nn.CrossEntropyLoss()
    elif method in ("backprop", "flat", "per_layer", "flat_generic", "flat_banded", "flat_instantiate", "flat_integer",
                    "flat_unchecked"):
        from bpclip_fast import PrivacyEngine
        noise = {}
        if method == "flat_banded":  # 4 bands; the data set is 4 copies of the batch: the group's rate is 1
            noise = dict(noise="banded", bands=4)
            loader = DataLoader(TensorDataset(x.repeat((4,) + (1,) * (x.dim() - 1)), y.repeat(4)), batch_size=BATCH)
        if method == "flat_integer":  # 4 copies of the batch: a Poisson rate of 1/4 (the integer release needs <= 1/2)
            noise = dict(integer_noise=True)
            loader = DataLoader(TensorDataset(x.repeat((4,) + (1,) * (x.dim() - 1)), y.repeat(4)), batch_size=BATCH)
        if method == "flat_generic":  # the same model, every layer by the generic path (bench.methods)
            from bench.methods import _generic_everywhere

            _generic_everywhere(model)
        clip = (dict(input_clip=CLIP, grad_clip=CLIP) if method == "backprop"
                else dict(clipping=method.split("_")[0] if method.startswith("flat") else method, max_grad_norm=CLIP))
        if method == "flat_instantiate":  # every layer's per-example gradients instantiated (kept where they fit)
            clip["norm_method"] = "instantiate"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader,
                noise_multiplier=SIGMA, noise_seed=seed, **clip, **noise)
        if expected_batch is not None:
            _set_expected_batch(model, expected_batch)
        if method == "flat_unchecked":
            _uncheck(opt)
        crit = nn.CrossEntropyLoss()
    elif method in ("opacus_ghost", "opacus_hooks"):
        from opacus import PrivacyEngine as OpacusEngine
        warnings.filterwarnings("ignore")
        crit = nn.CrossEntropyLoss(reduction="sum")
        out = OpacusEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader,
            criterion=crit, noise_multiplier=SIGMA, max_grad_norm=CLIP, loss_reduction="sum",
            poisson_sampling=False, grad_sample_mode=method.split("_")[1])
        if method == "opacus_ghost":  # its criterion runs both backward passes of ghost clipping
            model, opt, crit, loader = out
        else:
            model, opt, loader = out
    else:
        raise ValueError(f"--methods: unknown method {method!r} (one of {', '.join(METHODS)})")
    batches = iter(())

    def fetch():
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:
            batches = iter(loader)
            return next(batches)

    def step(batch):
        xb, yb = batch
        opt.zero_grad(set_to_none=True)
        crit(model(xb), yb).backward()
        opt.step()
    return fetch, step


def _set_expected_batch(model, expected_batch: float) -> None:
    """Every clipped layer's mean-loss B̄ (``LayerStep.mean_loss_batch``) set to ``expected_batch``: at
    q = 1 each batch holds B̄ = d rows, so the mean-loss scale d/B̄ is 1 and the ops skip it, where a
    Poisson step's d almost never equals B̄ (P(d = B̄) ≈ 2.5% at B̄ = 256). A bench-only setting: the
    accountant and the sampler are those of q = 1."""
    if not (0 < expected_batch < float("inf")):
        raise ValueError(f"--expected-batch must be a positive number, got {expected_batch!r}")
    steps = [m._bp_step for m in model.modules() if getattr(m, "_bp_step", None) is not None]
    if not steps:
        raise ValueError("--expected-batch: the model has no armed clipped layer")
    if any(st.band is not None for st in steps):  # its rows' one std was fixed from B̄ at make_private
        raise ValueError("--expected-batch: not for banded noise (every row's std is fixed from B̄ at make_private)")
    for st in steps:
        st.mean_loss_batch = float(expected_batch)


def _uncheck(opt) -> None:
    """``flat_unchecked``: the private step with the step boundary's bookkeeping off, to measure its
    share of the host cost (what moving it into C++ could save at most). Every layer's records, hooks
    and checks (``boundary.LayerStep``: enforce off, hooks removed) and ``step()``'s verification
    (every layer taken to hold its draw) are gone; the clipping, the norms, the flat release and the
    noise are as in ``flat``. A measurement, not a training mode: nothing checks the guarantee."""
    engine = opt.engine
    for st in engine._steps_of:
        st.remove_hooks()
        st.enforce = False
        st.install_hooks = lambda: None  # arm() would re-hook what trains
    opt._verify = lambda: [False] * len(engine._steps_of)


_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def count_step(fetch, step, warmup: int) -> dict:
    """Leaf ops, syncs and the op histogram of one step (after ``warmup`` steps)."""
    for _ in range(warmup):
        step(fetch())
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(fetch())
    inner = inner_leaves(prof.events())
    batch, py, mode = fetch(), [0], _Ops()
    with mode, python_syncs(py):
        step(batch)
    ops, syncs, hist = count(mode.names, inner)
    return {"ops": ops, "syncs": syncs + py[0], "hist": dict(hist.most_common())}


def self_times(fetch, step, steps: int = 20) -> dict:
    """``{profiler key: self CPU µs per step}`` over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(fetch())
    return {e.key: e.self_cpu_time_total / steps for e in prof.key_averages()}


def host_times(cells: dict, reps: int, rounds: int, clock: str = "wall") -> dict:
    """``{method: median step ms}``: ``reps`` steps of each cell's ``(fetch, step)``, in ``rounds``
    interleaved blocks (methods alternating); the first step of each block, after the switch from
    another method, is run but not counted."""
    tick = _CLOCKS[clock]
    rounds = max(1, min(rounds, reps))
    times: dict = {m: [] for m in cells}
    for r in range(rounds):
        n = reps // rounds + (r < reps % rounds)
        for m, (fetch, step) in cells.items():
            step(fetch())
            for _ in range(n):
                batch = fetch()
                t0 = tick()
                step(batch)
                times[m].append((tick() - t0) * 1e3)
    return {m: statistics.median(t) for m, t in times.items()}


def measure_model(name: str, methods, reps: int, warmup: int, expected_batch: float | None = None,
                  rounds: int = 5, clock: str = "wall", breakdown: int = 0) -> list:
    """One row per method of model ``name``: leaf ops, syncs and histogram counted method by method,
    host times measured interleaved (:func:`host_times`); a method that cannot train the model is a
    row with an ``error``. ``breakdown``: each row also gets ``grew``, the ``breakdown`` profiler
    entries whose self CPU time per step grew most over non-private's (over the first method's where
    non-private is not among them)."""
    rows, cells, selfs = [], {}, {}
    for method in methods:
        try:
            fetch, step = build(method, name, expected_batch=expected_batch)  # bpclip_fast's methods only take it
            r = {"model": name, "method": method, **count_step(fetch, step, warmup)}
            if breakdown:
                selfs[method] = self_times(fetch, step)
        except Exception as exc:  # noqa: BLE001 -- a method that cannot train this model is a table cell
            rows.append({"model": name, "method": method, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
            continue
        cells[method] = (fetch, step)
        rows.append(r)
    if cells:
        host = host_times(cells, reps, rounds, clock)
        for r in rows:
            if r["method"] in host:
                r["host_ms"] = host[r["method"]]
    if breakdown and selfs:
        against = "nonprivate" if "nonprivate" in selfs else next(iter(selfs))
        base = selfs[against]
        for r in rows:
            own = selfs.get(r["method"])
            if own is None or r["method"] == against:
                continue
            grew = {k: own.get(k, 0.0) - base.get(k, 0.0) for k in set(own) | set(base)}
            r["grew"] = sorted(((k, v) for k, v in grew.items() if v > 0), key=lambda kv: -kv[1])[:breakdown]
    return rows


def measure(method: str, name: str, reps: int, warmup: int, expected_batch: float | None = None) -> dict:
    """One method's row alone (:func:`measure_model`)."""
    return measure_model(name, [method], reps, warmup, expected_batch)[0]


def table(rows: list) -> str:
    base = {r["model"]: r for r in rows if r["method"] == "nonprivate" and "error" not in r}
    out = ["| model | method | leaf ops | ×np | syncs | host ms (b2, 1 thread) | ×np |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['method']} | — | | | {r['error'][:60]} | |")
            continue
        b = base.get(r["model"])
        ro = f"{r['ops'] / b['ops']:.2f}" if b else ""
        rt = f"{r['host_ms'] / b['host_ms']:.2f}" if b and "host_ms" in b else ""
        out.append(f"| {r['model']} | {r['method']} | {r['ops']} | {ro} | {r['syncs']} | {r['host_ms']:.2f} | {rt} |")
    return "\n".join(out)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--methods", default=",".join(METHODS[:-ON_REQUEST]))
    p.add_argument("--reps", type=int, default=30, help="timed steps per cell (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ops", action="store_true", help="print each cell's op histogram")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--expected-batch", type=float, default=None,
                   help="bpclip_fast's mean loss divides by this B̄ rather than the batch (2): the step of a Poisson "
                        "batch whose size differs from B̄, which multiplies every release by d/B̄ (e.g. 2.5)")
    p.add_argument("--rounds", type=int, default=5,
                   help="the methods of a model are timed in this many interleaved blocks of steps")
    p.add_argument("--clock", choices=sorted(_CLOCKS), default="wall",
                   help="wall: the wall clock; cpu: this process's CPU time (a machine shared with other work)")
    p.add_argument("--breakdown", type=int, default=0, metavar="N",
                   help="print the N profiler entries (self CPU per step) that grew most over the first method")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.reps < 1:
        p.error("--reps and --rounds must be at least 1")
    torch.set_num_threads(1)
    rows = []
    methods = a.methods.split(",")
    for method in methods:
        if method not in METHODS:
            raise SystemExit(f"--methods: unknown method {method!r} (one of {', '.join(METHODS)})")
    for name in a.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"--models: unknown model {name!r} (one of {', '.join(MODELS)})")
        model_rows = measure_model(name, methods, a.reps, a.warmup, a.expected_batch, a.rounds, a.clock, a.breakdown)
        rows += model_rows
        for r in model_rows:
            if a.ops and "hist" in r:
                print(f"# {name} {r['method']}: " + ", ".join(f"{k.split('::')[1]} {v}" for k, v in r["hist"].items()),
                      file=sys.stderr)
            if r.get("grew"):
                print(f"# {name} {r['method']}, self CPU µs per step above "
                      f"{'nonprivate' if 'nonprivate' in methods else methods[0]}: "
                      + ", ".join(f"{k} +{v:.0f}" for k, v in r["grew"]), file=sys.stderr)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
