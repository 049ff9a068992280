"""The CPU storage cache behind the ops' outputs and scratch (csrc/host_cache.h, ``bpclip_fast.cpu_cache``).

What an attacker would try: make a reused storage leak into a release (an op that reads an entry
it did not write gets the poison, NaN, instead of at::empty's arbitrary bytes), or make the cache
hand out a storage the training loop still reads (an old gradient kept by reference, through a
view, a numpy array or a weak reference would change under it)."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast
from bpclip_fast import _ops

MB = 1 << 20


@pytest.fixture(autouse=True)
def _restore_limit():
    gc.collect()  # an earlier test's model in a reference cycle still holds its gradients' storages
    before = bpclip_fast.cpu_cache()["limit"]
    yield
    bpclip_fast.cpu_cache(limit=before)


class Net(nn.Module):
    """Every cached site at >= 1 MB in fp32 at batch 8: the second conv's patches (8 x 576 x 256,
    4.7 MB) and kept per-example gradients (8 x 36864, 1.2 MB; in `groups` groups), the Linear's
    released weight gradient (512 x 1024, 2 MB)."""

    def __init__(self, groups=1):
        super().__init__()
        self.conv1 = nn.Conv2d(16, 64, 3, padding=1)
        self.conv2 = nn.Conv2d(64, 64, 3, padding=1, groups=groups)
        self.fc = nn.Linear(1024, 512)
        self.head = nn.Linear(512, 3)

    def forward(self, x):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        h = nn.functional.avg_pool2d(h, 4).flatten(1)
        return self.head(torch.tanh(self.fc(h)))


def _private(mode):
    torch.manual_seed(0)
    clip = {"input_clip": 1.0, "grad_clip": 1.0} if mode == "backprop" else {"max_grad_norm": 1.0}
    ds = TensorDataset(torch.randn(16, 16, 16, 16), torch.randint(0, 3, (16,)))
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", bpclip_fast.InsecureSeedWarning)
        return bpclip_fast.PrivacyEngine(accountant="zcdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=8), noise_multiplier=1.0, clipping=mode, **clip,
            noise_seed=7, poisson_sampling=False)


def _step(model, opt, x, y, poison=False):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    idle = bpclip_fast.cpu_cache(poison=poison)["idle_bytes"]
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return grads, idle


@pytest.mark.parametrize("mode", ["flat", "per_layer", "backprop"])
def test_a_poisoned_cache_releases_the_same_bits_as_no_cache(mode):
    """Two steps with the cache off, and two with it on and every idle storage filled with NaN
    before each backward: the released gradients agree bit for bit (the same seed, the same
    kernels), so no op reads an entry of a reused storage it did not write. The poison did land:
    the second step had idle storages to fill (the first step's patches, kept rows and gradients)."""
    runs = {}
    for cached in (False, True):
        bpclip_fast.cpu_cache(limit=1 << 30 if cached else 0)
        model, opt, dl = _private(mode)
        runs[cached] = [_step(model, opt, x, y, poison=cached) for x, y in dl]
    assert runs[True][1][1] >= 2 * MB
    for (off, _), (on, _) in zip(runs[False], runs[True]):
        for a, b in zip(off, on):
            assert torch.isfinite(b).all()
            assert torch.equal(a, b)


def test_the_ops_read_no_poisoned_entry_at_any_batch_size():
    """The ops one at a time, each after its own storages were cached and poisoned, at the batch
    that filled them and at a smaller one (which reuses storages up to 1.5x its size): the norms'
    kept rows and patches, the release from kept rows, the Linear release with and without noise,
    and the norm layers' per-example gradients, against the same op with the cache off."""
    g = torch.Generator().manual_seed(3)

    def calls(B):
        x = torch.randn(B, 64, 16, 16, generator=g)
        go = torch.randn(B, 64, 16, 16, generator=g)
        w = torch.randn(64, 64, 3, 3, generator=g)
        xl, gl = torch.randn(B, 1024, generator=g), torch.randn(B, 512, generator=g)
        wl = torch.randn(512, 1024, generator=g)
        factor = torch.rand(B, generator=g)
        rows = torch.randn(B, 512 * 1024, generator=g)
        xn, gn = torch.randn(B, 65536, generator=g), torch.randn(B, 65536, generator=g)
        mean, rstd = xn.mean(1, keepdim=True), xn.var(1, keepdim=True, unbiased=False).add(1e-5).rsqrt()
        ops = torch.ops.bpclip_fast
        return [
            lambda: ops.conv2d_grad_norms(go, x, [3, 3], [1, 1], [1, 1], [1, 1], 1, [True, True], "instantiate",
                                          1 << 30, True, None, 1 << 30),
            lambda: ops.conv_patches(x, [3, 3], [1, 1], [1, 1], [1, 1]),
            lambda: ops.linear_clipped_grads(gl, xl, factor, wl, [True, True], [5, 0], 0.0, None, None),
            lambda: ops.linear_clipped_grads(gl, xl, factor, wl, [True, True], [5, 0], 1.5, None, None),
            lambda: ops.examples_release(rows, None, factor, [5, 0], 1.5, 1.0),
            lambda: ops.norm_affine_example_grads(gn, xn, mean, rstd, B, 1, True),
        ]

    for fill_batch, batch in ((8, 8), (8, 6)):
        for fill, call in zip(calls(fill_batch), calls(batch)):
            bpclip_fast.cpu_cache(limit=0)
            want = call()
            bpclip_fast.cpu_cache(limit=1 << 30)
            fill()  # caches this op's storages (idle again once the results are dropped)
            assert bpclip_fast.cpu_cache(poison=True)["idle_bytes"] >= MB
            got = call()
            for a, b in zip(want, got):
                assert torch.equal(a, b)


def _grad_storage_reuse(keep):
    """Two flat steps; `keep(fc.weight.grad)` is what the loop holds from the first; returns the held
    object's values before and after the second step and whether the second step's gradient took
    the first one's storage."""
    bpclip_fast.cpu_cache(limit=1 << 30)
    model, opt, dl = _private("flat")
    fc = model._module.fc if hasattr(model, "_module") else model.fc
    batches = iter(dl)
    _step(model, opt, *next(batches))
    first_ptr = fc.weight.grad.data_ptr()
    held = keep(fc.weight.grad)
    before = np.array(held(), copy=True) if held is not None else None
    _step(model, opt, *next(batches))
    after = np.array(held(), copy=True) if held is not None else None
    return before, after, fc.weight.grad.data_ptr() == first_ptr


def test_an_unreferenced_gradient_storage_is_reused():
    """The cache works: with nothing held, the second step's weight gradient is written into the
    first one's storage (no fresh pages to fault in)."""
    _, _, reused = _grad_storage_reuse(lambda g: None)
    assert reused


@pytest.mark.parametrize("keep", [
    lambda g: g,
    lambda g: g[3:5],
    lambda g: g.view(-1)[::7],
    lambda g: g.numpy(),
], ids=["tensor", "slice_view", "strided_view", "numpy"])
def test_a_gradient_the_loop_still_holds_is_never_overwritten(keep):
    """`old = p.grad` (or a view of it, or a numpy array of it) held across zero_grad(set_to_none=True):
    its storage is referenced, so the next step's release takes another, and the held values do not
    change."""
    kept = {}

    def hold(g):
        kept["ref"] = keep(g)
        return lambda: kept["ref"].detach().numpy() if torch.is_tensor(kept["ref"]) else kept["ref"]

    before, after, reused = _grad_storage_reuse(hold)
    assert not reused
    assert np.array_equal(before, after)


def test_a_weak_reference_to_a_gradient_storage_keeps_it_out_of_reuse():
    """A StorageWeakRef (torch.multiprocessing's, or a memo keyed by storage) could be promoted after
    a reuse and see another step's bytes: a storage with one is not idle."""
    refs = {}

    def weak(g):
        refs["w"] = StorageWeakRef(g.untyped_storage())
        return None

    _, _, same_address = _grad_storage_reuse(weak)
    # Python saw this storage (untyped_storage()), so the cache lets go of it: it is freed and the weak
    # reference expires, and malloc may then give its address to the next gradient (seen in a full
    # run, after other tests had raised glibc's mmap threshold), which is no reuse. A weak reference
    # still alive must not reach the new gradient's storage.
    assert refs["w"].expired() or not same_address


def test_limit_zero_frees_the_idle_storages_and_stops_caching():
    bpclip_fast.cpu_cache(limit=1 << 30)
    model, opt, dl = _private("flat")
    for x, y in dl:
        _step(model, opt, x, y)
    opt.zero_grad(set_to_none=True)
    assert bpclip_fast.cpu_cache()["idle_bytes"] >= 2 * MB
    stats = bpclip_fast.cpu_cache(limit=0)
    assert stats["limit"] == 0 and stats["idle_bytes"] == 0
    for x, y in dl:
        _step(model, opt, x, y)
    assert bpclip_fast.cpu_cache()["held_bytes"] <= stats["held_bytes"]  # in use elsewhere, if anything


def test_the_limit_caps_what_the_cache_holds():
    """A limit 3 MB above what is in use: the 4.7 MB patches are never cached, and the held bytes
    stay within it."""
    limit = bpclip_fast.cpu_cache(limit=0)["held_bytes"] + 3 * MB
    bpclip_fast.cpu_cache(limit=limit)
    model, opt, dl = _private("flat")
    for x, y in dl:
        _step(model, opt, x, y)
        assert 2 * MB <= bpclip_fast.cpu_cache()["held_bytes"] <= limit


def test_a_negative_limit_is_refused():
    with pytest.raises(ValueError, match="cpu_cache: limit must be >= 0"):
        bpclip_fast.cpu_cache(limit=-1)


def test_a_size_whose_bytes_overflow_is_refused_not_handed_a_short_storage():
    """Patches of a 1 x 2^18 kernel over a row padded by 2^43 + 2^17: 2^18 x (2^44 + 2) = 2^62 + 2^19
    fp32 entries, 2^64 + 2 MB bytes, which wrap in 64 bits to 2 MB. Taken as 2 MB, the storage would
    have been far shorter than the tensor the kernel then writes; it goes to at::empty, which refuses it."""
    x = torch.randn(1, 1, 1, 1)
    with pytest.raises(RuntimeError, match="overflow"):
        torch.ops.bpclip_fast.conv_patches(x, [1, 1 << 18], [1, 1], [0, (1 << 43) + (1 << 17)], [1, 1])


def test_the_patches_of_a_step_share_one_scratch_storage():
    """The patches are scratch the norms op drops before it returns: a larger request replaces the
    idle scratch storages, a smaller one takes the larger storage, so a step's layers of every size
    hold one (an output keeps to storages near its own size: a weight gradient idle between
    zero_grad and its release must stay free for it)."""
    base = bpclip_fast.cpu_cache(limit=0)
    bpclip_fast.cpu_cache(limit=1 << 30)
    sizes = {}
    for channels in (16, 48, 32):  # patches of 16 x (C 9) x 256 fp32: 2.4, 7.1 and 4.7 MB
        out = torch.ops.bpclip_fast.conv_patches(torch.randn(16, channels, 16, 16), [3, 3], [1, 1], [1, 1], [1, 1])
        sizes[channels] = out.numel() * out.element_size()
        del out
    stats = bpclip_fast.cpu_cache()
    assert stats["storages"] == base["storages"] + 1
    assert stats["idle_bytes"] == sizes[48]
