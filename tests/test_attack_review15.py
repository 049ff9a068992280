"""Attack review of ffd44e2 (host_cache: the CPU ops' released gradients, kept per-example gradients,
patches and norm-layer rows from storages kept for reuse while nothing but the cache references them).

What could go wrong there, and what each test pins:

* A storage that never becomes idle again. PyTorch preserves a storage's Python object
  (c10/util/intrusive_ptr.h, "PyObject preservation"): once Python code has seen a storage *as a
  storage* (``t.untyped_storage()``, ``torch.save``, ``copy.deepcopy``, a ``StorageWeakRef``, the
  library's own overlap check ``_ops._spans_cross`` that banded noise runs on every released
  gradient), that object holds the storage strongly for as long as anything else does, and the
  cache always does: use_count stays 2, the storage is never idle, never reused, never evicted and
  never freed, ``cpu_cache(limit=0)`` included. FOUND: a banded run pins one released weight gradient
  per step until the limit (1 GiB by default) is full of them. Fixed in csrc/cpu/host_cache.cpp (the
  cache lets go of a storage that has a Python object; the touch tests fail on ffd44e2's build until
  it is rebuilt) and in ``_ops._spans_cross`` (no ``untyped_storage()``: the banded test failed before).
* A storage Python moved into shared memory (``share_memory_``, a torch.multiprocessing queue)
  handed out again while another process maps it: that process would see the next step's kept
  per-example gradients. Pinned: the receiver's copy never changes (on ffd44e2 because the storage is
  pinned, after the fix because the cache lets it go; a fix that reused it would fail here).
* An op that reads an entry of its output or scratch it did not write: every op again after its
  own storages were cached and filled with the 0xFF poison, bit for bit against the cache off, over
  the dtypes (the accumulation dtype differs for fp16/bf16/fp64), B = 0, a batch of one, T > 1,
  noise 0, a frozen bias, channels_last, groups, chunked kept rows with a non-finite example; and end
  to end per_layer with a frozen bias and channels_last, a batch of one, flat and backprop fp64, two
  micro-batches with a backward each, zero_grad(set_to_none=False) with the gradients held.
* A storage handed out while the loop still holds it some other way than the existing tests try:
  ``set_`` onto the gradient, ``as_strided``, a list of detached gradients, ``.data``. (Hooks that stash
  a gradient and ``swap_tensors`` on one are refused by the engine before the cache matters.)
* Two threads sharing the cache; a forked child using the storages it inherited.
* Many sizes (Poisson batches): what the cache holds stays within the limit.

How each can fail (review 15's report): the pinned-storage tests fail on ffd44e2's own build. A
scratch extension of host_cache.cpp with the fix passes their scenarios; one whose Linear-release GEMM
accumulates into its output unwritten (``addmm_`` for ``mm_out``) fails the poison comparison; one
that reuses a storage whose only other holder is its own Python object (the tempting fix) changes the
shared-memory receiver's values. None of the other probes failed on ffd44e2."""

from __future__ import annotations

import copy
import gc
import io
import os
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast
from test_host_cache import Net  # the cached sites at batch 8 (here with a grouped conv2)

OPS = torch.ops.bpclip_fast
MB = 1 << 20
ON = 1 << 30
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DT_IDS = ["f32", "f64", "f16", "bf16"]
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(autouse=True)
def _restore_limit():
    gc.collect()
    before = bpclip_fast.cpu_cache()["limit"]
    yield
    gc.collect()
    bpclip_fast.cpu_cache(limit=before)


def _same_bits(a, b):
    """Bit for bit, NaN payloads included: the poison (all ones) is not the NaN an op computes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    bits = _BITS[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def _against_no_cache(call, min_idle=MB):
    """`call()` with the cache off, then with it on after a call that cached its storages (idle again
    once its results are dropped) and the poison: the same bits."""
    bpclip_fast.cpu_cache(limit=0)
    want = [t.clone() for t in call()]
    bpclip_fast.cpu_cache(limit=ON)
    call()
    assert bpclip_fast.cpu_cache(poison=True)["idle_bytes"] >= min_idle, "nothing was cached: the probe is void"
    got = call()
    for a, b in zip(want, got):
        assert _same_bits(a, b)


def _held_when_nothing_is_in_use():
    """What the cache still holds after limit=0 (which frees every idle storage): storages in use,
    or storages it can never free."""
    gc.collect()
    return bpclip_fast.cpu_cache(limit=0)["held_bytes"]


def _linear_release(seed=0, B=8, dtype=torch.float32, std=1.5, key=(5, 0)):
    g = torch.Generator().manual_seed(seed)
    x, go = torch.randn(B, 1024, generator=g).to(dtype), torch.randn(B, 512, generator=g).to(dtype)
    w, f = torch.randn(512, 1024, generator=g).to(dtype), torch.rand(B, generator=g)
    return lambda: OPS.linear_clipped_grads(go, x, f.to(torch.float64 if dtype == torch.float64 else torch.float32),
                                            w, [True, True], list(key), std, None, None)


# --------------------------------------------------------------------- storages Python has seen

def _touch_untyped(t):
    t.untyped_storage()


def _touch_save(t):
    torch.save(t, io.BytesIO())


def _touch_deepcopy(t):
    copy.deepcopy(t)


def _touch_weakref(t):
    StorageWeakRef(t.untyped_storage())


@pytest.mark.parametrize("touch", [_touch_untyped, _touch_save, _touch_deepcopy, _touch_weakref],
                         ids=["untyped_storage", "torch_save", "deepcopy", "StorageWeakRef"])
def test_a_storage_python_has_seen_is_freed_once_nothing_uses_it(touch):
    """A released gradient from the cache that the loop saved, deep-copied or asked for its storage,
    then dropped: limit=0 leaves the cache holding nothing more than before (on ffd44e2 it held the
    2 MB forever: the storage's Python object and the cache kept each other alive)."""
    base = _held_when_nothing_is_in_use()
    bpclip_fast.cpu_cache(limit=ON)
    gw, gb = _linear_release()()
    touch(gw)
    del gw, gb
    assert _held_when_nothing_is_in_use() == base


def test_a_storage_python_has_seen_is_not_kept_out_of_memory():
    """The same through a weak reference: the storage itself is gone once the loop dropped it and the
    cache was emptied (a leak, not just an accounting error)."""
    bpclip_fast.cpu_cache(limit=ON)
    gw, _ = _linear_release()()
    ref = StorageWeakRef(gw.untyped_storage())
    del gw, _
    _held_when_nothing_is_in_use()
    assert ref.expired()


def _banded(bands=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 512), nn.Tanh(), nn.Linear(512, 3))
    ds = TensorDataset(torch.randn(48, 1024), torch.randint(0, 3, (48,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bpclip_fast.PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=8), noise_multiplier=1.0, clipping="flat", max_grad_norm=1.0,
            noise_seed=7, poisson_sampling=True, noise="banded", bands=bands)


def test_banded_noise_does_not_pin_a_released_gradient_per_step():
    """Banded noise checks each layer's weight and bias gradients for shared memory with
    ``untyped_storage()`` every step: on ffd44e2 every step's 2 MB weight gradient stayed in the cache
    for good (held bytes grew each step; limit=0 freed none of them)."""
    base = _held_when_nothing_is_in_use()
    bpclip_fast.cpu_cache(limit=ON)
    model, opt, dl = _banded()
    steps = 0
    for x, y in dl:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        steps += 1
        if steps == 4:
            break
    opt.zero_grad(set_to_none=True)
    assert _held_when_nothing_is_in_use() == base


def test_a_storage_shared_with_another_process_is_never_handed_out_again():
    """``share_memory_`` / a torch.multiprocessing queue moves a released gradient's storage into shared
    memory that a receiver maps (here: a second mapping of the same descriptor). After the sender drops
    it, later releases must not be written there: the receiver would see other steps' values, and a
    kept per-example gradient (also from the cache) is never meant to leave the process."""
    bpclip_fast.cpu_cache(limit=ON)
    gw, gb = _linear_release()()
    fd, size = gw.untyped_storage()._share_fd_cpu_()
    received = torch.empty(0).set_(torch.UntypedStorage._new_shared_fd_cpu(fd, size), 0, gw.shape, gw.stride())
    snapshot = received.clone()
    del gw, gb
    gc.collect()
    for seed in range(1, 4):  # releases of the same size, and kept rows up to 1.5x smaller
        _linear_release(seed=seed, key=(seed, 0))()
        OPS.examples_release(torch.randn(8, 400_000), None, torch.rand(8), [seed, 0], 1.0, 1.0)
    assert torch.equal(received, snapshot)


# --------------------------------------------------------------------- ops reading what they did not write

@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("std", [0.0, 1.5], ids=["std0", "noised"])
@pytest.mark.parametrize("B,T,bias", [(8, 1, True), (1, 1, False), (0, 1, True), (4, 3, True)],
                         ids=["b8", "one_nobias", "empty", "T3"])
def test_the_linear_release_reads_no_poisoned_entry(dtype, std, B, T, bias):
    """Filled at batch 8, called at B (B = 0: the GEMM has no rows, the output is the noise or zeros)."""
    g = torch.Generator().manual_seed(1)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    w = torch.randn(512, 1024, generator=g).to(dtype)

    def make(b):
        x = torch.randn(b, T, 1024, generator=g).to(dtype)
        go = torch.randn(b, T, 512, generator=g).to(dtype)
        f = torch.rand(b, generator=g, dtype=acc)
        return lambda: OPS.linear_clipped_grads(go, x, f, w, [True, bias], [5, 0], std, None, None)

    fill, call = make(8), make(B)
    bpclip_fast.cpu_cache(limit=0)
    want = [t.clone() for t in call()]
    bpclip_fast.cpu_cache(limit=ON)
    fill()
    assert bpclip_fast.cpu_cache(poison=True)["idle_bytes"] >= MB
    for a, b in zip(want, call()):
        assert _same_bits(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_patches_read_no_poisoned_entry(dtype, layout):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 32, 16, 18, generator=g).to(dtype)  # output 8 x 288 x (16 x 16): 2.4 MB in fp32
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    _against_no_cache(lambda: [OPS.conv_patches(x, [3, 3], [1, 1], [1, 0], [1, 2])])


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_chunked_kept_rows_with_a_nonfinite_example_read_no_poisoned_entry(dtype):
    """Grouped conv, kept rows written chunk by chunk (a workspace of about two examples), example 2
    non-finite; then the release from the kept rows with that example's factor 0, noised."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 128, 6, 6, generator=g).to(dtype)  # kept rows 5 x 2 * 64 * 576: 1.5 MB in fp32
    go = torch.randn(5, 128, 6, 6, generator=g).to(dtype)
    x[2, 0, 0, 0] = float("nan")
    w = torch.randn(128, 64, 3, 3, generator=g).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    f = torch.rand(5, generator=g, dtype=acc)
    f[2] = 0.0

    def call():
        sq, bound, kw, kb = OPS.conv2d_grad_norms(go, x, [3, 3], [1, 1], [1, 1], [1, 1], 2, [True, True],
                                                  "instantiate", 2 * 1_200_000, True, None, 1 << 40)
        assert kw.numel() > 0, "the kept path must be taken"
        rw, rb = OPS.conv2d_clipped_grads(go, x, f, w, [1, 1], [1, 1], [1, 1], 2, [True, True], [9, 0], 0.5, kw, kb)
        return [sq, bound, kw, kb, rw, rb]

    _against_no_cache(call)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("B,std", [(8, 1.0), (1, 0.0), (0, 1.0), (0, 0.0)], ids=["b8", "one_std0", "empty", "empty_std0"])
def test_examples_release_reads_no_poisoned_entry(dtype, B, std):
    g = torch.Generator().manual_seed(4)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    fill_rows = torch.randn(8, 300_000, generator=g).to(dtype)
    rows = torch.randn(B, 300_000, generator=g).to(dtype)
    f = torch.rand(B, generator=g, dtype=acc)
    bpclip_fast.cpu_cache(limit=0)
    want = [t.clone() for t in OPS.examples_release(rows, None, f, [3, 1], std, 0.5)]
    bpclip_fast.cpu_cache(limit=ON)
    OPS.examples_release(fill_rows, None, torch.rand(8, generator=g, dtype=acc), [3, 1], std, 0.5)
    if dtype.itemsize * 300_000 >= MB:
        assert bpclip_fast.cpu_cache(poison=True)["idle_bytes"] >= MB
    for a, b in zip(want, OPS.examples_release(rows, None, f, [3, 1], std, 0.5)):
        assert _same_bits(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("layer_norm,groups", [(True, 1), (False, 4)], ids=["layer", "group4"])
def test_norm_layer_rows_read_no_poisoned_entry(dtype, layer_norm, groups):
    g = torch.Generator().manual_seed(5)
    B, D = 4, 65536
    x = torch.randn(B, D, generator=g).to(dtype)
    go = torch.randn(B, D, generator=g).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    xs = x.to(acc).view(B * groups, -1)
    mean = xs.mean(1, keepdim=True)
    rstd = xs.var(1, keepdim=True, unbiased=False).add(1e-5).rsqrt()
    if layer_norm:
        call = lambda: OPS.norm_affine_example_grads(go, x, mean, rstd, B, 1, True)  # noqa: E731
    else:  # GroupNorm over 8 channels of 8192 positions in 4 groups
        xc, gc_ = x.view(B, 8, 8192), go.view(B, 8, 8192)
        call = lambda: OPS.norm_affine_example_grads(gc_, xc, mean, rstd, B, groups, False)  # noqa: E731
    _against_no_cache(call, min_idle=MB if B * (8 if not layer_norm else D) * acc.itemsize >= MB else 0)


# --------------------------------------------------------------------- end to end

def _private(mode, dtype=torch.float32, batch=8, freeze_bias=False):
    torch.manual_seed(0)
    model = Net(groups=2).to(dtype)
    if freeze_bias:
        model.fc.bias.requires_grad_(False)
        model.conv2.bias.requires_grad_(False)
    clip = {"input_clip": 1.0, "grad_clip": 1.0} if mode == "backprop" else {"max_grad_norm": 1.0}
    ds = TensorDataset(torch.randn(3 * batch, 16, 16, 16, dtype=dtype), torch.randint(0, 3, (3 * batch,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bpclip_fast.PrivacyEngine(accountant="zcdp").make_private(
            module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
            data_loader=DataLoader(ds, batch_size=batch), noise_multiplier=1.0, clipping=mode, **clip,
            noise_seed=7, poisson_sampling=False)


def _run(step, cached, **kw):
    """The released gradients of every step (clones) with the cache off, or on and poisoned before each
    backward."""
    bpclip_fast.cpu_cache(limit=ON if cached else 0)
    model, opt, dl = _private(**kw)
    out = []
    for x, y in dl:
        out.append(step(model, opt, x, y, cached))
    return out


def _poisoned_backward(loss, cached):
    if cached:
        bpclip_fast.cpu_cache(poison=True)
    loss.backward()


def _plain_step(model, opt, x, y, cached, channels_last=False):
    opt.zero_grad(set_to_none=True)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    _poisoned_backward(nn.functional.cross_entropy(model(x), y), cached)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    opt.step()
    return grads


def _micro_batches_step(model, opt, x, y, cached):
    """Two micro-batches of unequal rows, a backward each, one step: the second release is added
    into the first (the cached storage of the first is p.grad, in use)."""
    opt.zero_grad(set_to_none=True)
    h = len(x) // 2 + 1
    with opt.accumulate():
        for sl in (slice(0, h), slice(h, None)):
            _poisoned_backward(nn.functional.cross_entropy(model(x[sl]), y[sl], reduction="sum"), cached)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    opt.step()
    return grads


def _keep_grad_step(model, opt, x, y, cached):
    """zero_grad(set_to_none=False) with the loop holding every p.grad from the first step: the held
    tensors are the gradients (AccumulateGrad took the released storage), zeroed and added into."""
    held = getattr(model, "_held", None)
    opt.zero_grad(set_to_none=False)
    _poisoned_backward(nn.functional.cross_entropy(model(x), y), cached)
    if held is None:
        model._held = [p.grad for p in model.parameters()]
    else:
        assert all(h is p.grad for h, p in zip(held, model.parameters()))
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return grads


@pytest.mark.parametrize("name,step,kw", [
    ("per_layer_frozen_bias_channels_last", lambda *a: _plain_step(*a, channels_last=True),
     {"mode": "per_layer", "freeze_bias": True}),
    ("flat_batch_of_one", _plain_step, {"mode": "flat", "batch": 1}),
    ("flat_fp64", _plain_step, {"mode": "flat", "dtype": torch.float64}),
    ("backprop_fp64", _plain_step, {"mode": "backprop", "dtype": torch.float64}),
    ("flat_micro_batches", _micro_batches_step, {"mode": "flat"}),
    ("per_layer_keep_grads", _keep_grad_step, {"mode": "per_layer"}),
])
def test_end_to_end_poisoned_cache_releases_the_same_bits(name, step, kw):
    off, on = _run(step, False, **kw), _run(step, True, **kw)
    for a_step, b_step in zip(off, on):
        for a, b in zip(a_step, b_step):
            assert _same_bits(a, b), name


# --------------------------------------------------------------------- a storage the loop still holds

def _two_flat_steps(hold):
    """Two flat steps; after the first, `hold(model)` returns what the loop keeps and a function that
    reads its values now. Returns the values before and after the second step."""
    bpclip_fast.cpu_cache(limit=ON)
    model, opt, dl = _private("flat")
    batches = iter(dl)
    _plain_step(model, opt, *next(batches), False)
    read = hold(model)
    before = read().clone()
    _plain_step(model, opt, *next(batches), False)
    return before, read()


def _fc(model):
    return model._module.fc if hasattr(model, "_module") else model.fc


def _set_onto(model):
    alias = torch.empty(0).set_(_fc(model).weight.grad)
    return lambda: alias


def _strided(model):
    g = _fc(model).weight.grad
    alias = g.as_strided((100,), (3,), 17)
    return lambda: alias


def _detached_list(model):
    kept = [p.grad.detach() for p in model.parameters()]  # a logger's list of the last gradients
    return lambda: kept[-4]


def _data_attr(model):
    d = _fc(model).weight.grad.data
    return lambda: d


@pytest.mark.parametrize("hold", [_set_onto, _strided, _detached_list, _data_attr],
                         ids=["set_", "as_strided", "detached_list", "data"])
def test_a_gradient_held_another_way_is_never_overwritten(hold):
    before, after = _two_flat_steps(hold)
    assert _same_bits(before, after)


# --------------------------------------------------------------------- threads, fork

def test_two_threads_sharing_the_cache_get_their_own_results():
    """Two threads releasing gradients of one size class at once (the ops drop the GIL): every result
    equals the same call with the cache off, so no storage went to both."""
    calls = [_linear_release(seed=s, key=(s, 0)) for s in range(4)]
    bpclip_fast.cpu_cache(limit=0)
    want = [[t.clone() for t in c()] for c in calls]
    bpclip_fast.cpu_cache(limit=ON)
    bad = []

    def work(ids):
        for _ in range(6):
            for i in ids:
                got = calls[i]()
                if not all(_same_bits(a, b) for a, b in zip(want[i], got)):
                    bad.append(i)

    threads = [threading.Thread(target=work, args=(ids,)) for ids in ([0, 1], [2, 3])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_uses_its_inherited_storages_apart_from_the_parent():
    """A DataLoader worker (fork) inherits the cache with idle storages: a release in the child gets
    the right bits, and the parent's held gradient is untouched by it (copy on write)."""
    call = _linear_release(seed=1)
    bpclip_fast.cpu_cache(limit=0)
    want = call()[0].clone()
    bpclip_fast.cpu_cache(limit=ON)
    held = _linear_release(seed=2, key=(2, 0))()[0]  # in use by the parent across the fork
    snapshot = held.clone()
    call()
    bpclip_fast.cpu_cache(poison=True)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = 0
        try:
            # As a DataLoader worker does: libgomp's thread team does not survive fork, and an op
            # that enters a parallel region the parent's team ran waits for it for good.
            torch.set_num_threads(1)
            got = call()[0]
            ok = int(_same_bits(want, got))
            held.fill_(7.0)
        finally:
            os.write(w, bytes([ok]))
            os._exit(0)
    os.close(w)
    ok = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert ok == b"\x01"
    assert torch.equal(held, snapshot)


# --------------------------------------------------------------------- memory

def test_many_batch_sizes_stay_within_the_limit():
    """Poisson batches: releases of rows of 40 sizes (1.1 MB to 9 MB) under an 8 MB limit above what is
    in use: what the cache holds never passes the limit, and limit=0 frees it all."""
    base = _held_when_nothing_is_in_use()
    limit = base + 8 * MB
    bpclip_fast.cpu_cache(limit=limit)
    f = torch.rand(2)
    for i in range(40):
        n = 300_000 + i * 50_000
        out = OPS.examples_release(torch.randn(2, n), None, f, [i, 0], 1.0, 1.0)
        assert bpclip_fast.cpu_cache()["held_bytes"] <= limit
        del out
        assert bpclip_fast.cpu_cache()["held_bytes"] <= limit
    assert _held_when_nothing_is_in_use() == base
