"""Attack review 16 of ``word_checksum`` (commit 77867a9): the step boundary's bit fingerprint
(``fingerprint.fingerprint``) moved from ATen's ``(w + (w >> 33)).sum()`` to one op with a CPU
kernel and a CUDA one. Every probe compares with Python's exact integers over the tensor's bytes
(the truth) and with the old ATen formula (which the op replaces value for value), and the two
refusals that rest on the fingerprint are driven end to end."""

from __future__ import annotations

import struct
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine, StepRefused, boundary, layer_hooks
from bpclip_fast.fingerprint import fingerprint as _fingerprint
from test_attack_review3 import _private_plain_use  # review 3's weight used in plain code

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OP = torch.ops.bpclip_fast.word_checksum

pytestmark = pytest.mark.skipif(sys.byteorder != "little", reason="the truth below reads little-endian bytes")


# ------------------------------------------------------------------------------------ the truth

def _signed(total: int) -> int:
    total %= 1 << 64
    return total - (1 << 64) if total >= 1 << 63 else total


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def _truth(t: torch.Tensor) -> int:
    """The fingerprint's definition over the bytes in logical order, in Python's integers: 64-bit
    words w summed as w + floor(w / 2^33) mod 2^64 where the bytes fill whole words, else the
    element-sized words' exact (sign-extended) sum."""
    b = _bytes(t)
    if len(b) % 8 == 0:
        words = struct.unpack(f"<{len(b) // 8}q", b)
        return _signed(sum(words) + sum(w >> 33 for w in words))
    size = t.element_size()
    fmt = {1: "b", 2: "h", 4: "i", 8: "q"}[size]
    return _signed(sum(struct.unpack(f"<{len(b) // size}{fmt}", b)))


def _old(t: torch.Tensor) -> torch.Tensor:
    """``_fingerprint`` as it was before 77867a9 (ATen ops, int64 arithmetic)."""
    flat = t.detach().reshape(-1)
    size = flat.element_size()
    if (flat.numel() * size) % 8 == 0:
        if (flat.storage_offset() * size) % 8:
            flat = flat.clone()
        words = flat.view(torch.int64)
        return (words + (words >> 33)).sum()
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[size]
    return flat.view(bits).sum(dtype=torch.int64)


def _layouts(dtype):
    g = torch.Generator().manual_seed(16)
    base = (torch.randn(4 * 64 + 5, generator=g) * 3).to(dtype)
    n8 = 8 // base.element_size()  # elements per 8 bytes
    return {
        "contiguous": base[:64].view(8, 8),
        "offset_one_element": base[1:65],
        "offset_8_bytes": base[n8:n8 + 64],
        "offset_3_elements_odd_length": base[3:10],
        "transposed": base[:64].view(8, 8).t(),
        "expanded_2d": base[:8].view(1, 8).expand(5, 8),
        "stepped_2d": base[:64].view(8, 8)[::2, ::3],
        "stepped_rows": base[:64].view(8, 8)[1::3],
        "zero_size": base[:0],
        "zero_size_2d": base[3:3].view(0, 5),
        "zero_dim": base[5],
        "zero_dim_offset_0": base[0],
        "odd_length": base[:7],
        "large": (torch.randn(2 * (1 << 16) * n8 + 3 * n8, generator=g) * 3).to(dtype),
    }


LAYOUT_NAMES = list(_layouts(torch.float32))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fingerprint_is_the_exact_sum_for_every_layout(dtype, layout, threads):
    """Probe: every dtype and view a caller may pass (offsets odd and 8-byte aligned, transposed,
    expanded, stepped, empty, 0-dim, more than two CPU grains of 2^16 words), with one and two
    threads: the new op's fingerprint equals the exact integer truth and the old ATen formula."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = _layouts(dtype)[layout]
        got = _fingerprint(t)
        assert got.dtype == torch.int64 and got.dim() == 0 and got.device == t.device
        assert int(got) == _truth(t), (dtype, layout)
        assert int(got) == int(_old(t)), (dtype, layout)
    finally:
        torch.set_num_threads(before)


EXTREMES = [-(1 << 63), -1, (1 << 63) - 1, 0, 1, -(1 << 33), (1 << 33) - 1, 1 << 33, -(1 << 33) - 1]


def _planted_words(n):
    """``n`` random words with the extremes at both ends (each thread's first and last share), and
    their exact sum."""
    gen = torch.Generator().manual_seed(n)
    words = torch.randint(-(1 << 63), (1 << 63) - 1, (n,), generator=gen, dtype=torch.int64)
    k = len(EXTREMES)
    words[:k] = torch.tensor(EXTREMES)
    words[-k:] = torch.tensor(EXTREMES[::-1])
    return words, _signed(sum(w + (w >> 33) for w in words.tolist()))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [len(EXTREMES), (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 5 * (1 << 16) + 7])
def test_extreme_words_and_thread_splits_are_exact(n, threads):
    """Probe: words INT64_MIN, -1, INT64_MAX and the shift's boundaries 2^33 around the CPU grain
    (2^16 words), the extremes planted at both ends (each thread's first and last share), through
    ``_fingerprint`` of the float64 bits and the op on the words directly."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        words, want = _planted_words(n)
        assert int(OP(words)) == want
        assert int(_fingerprint(words.view(torch.float64))) == want
        assert int(_fingerprint(words.view(torch.float32))) == want  # 2n fp32, whole words
        all_min = torch.full((n,), -(1 << 63), dtype=torch.int64)
        assert int(OP(all_min)) == _signed(n * (-(1 << 63) + (-(1 << 63) >> 33)))
        all_neg1 = torch.full((n,), -1, dtype=torch.int64)
        assert int(OP(all_neg1)) == _signed(-2 * n)
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------ edits

def _edits(dtype):
    """(name, edit) pairs of ordinary in-place edits on a contiguous 1-D tensor at index i."""
    bits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}[dtype]

    def payload(t, i):  # a NaN, then the same NaN with another payload bit
        t[i] = float("nan")
        before = _fingerprint(t)
        t.view(bits)[i] ^= 1
        return before

    def nan_sign(t, i):
        t[i] = float("nan")
        before = _fingerprint(t)
        t.view(bits)[i] ^= torch.iinfo(bits).min
        return before

    def neg_zero(t, i):
        t.zero_()
        before = _fingerprint(t)
        t[i] = -0.0
        return before

    def one_ulp(t, i):
        before = _fingerprint(t)
        t.view(bits)[i] += 1
        return before

    def abs_one(t, i):
        t[i] = -t[i].abs() - 1
        before = _fingerprint(t)
        t[i : i + 1].abs_()
        return before

    def abs_pair(t, i):  # two negatives with the same position in their words: their sign steps alike
        j = (i + 8 // t.element_size()) % t.numel()
        t[i] = -t[i].abs() - 1
        t[j] = -t[j].abs() - 1
        before = _fingerprint(t)
        t[i : i + 1].abs_()
        t[j : j + 1].abs_()
        return before

    return [("nan_payload", payload), ("nan_sign", nan_sign), ("neg_zero", neg_zero), ("one_ulp", one_ulp),
            ("abs_one", abs_one), ("abs_pair_same_half", abs_pair)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ordinary_edits_at_every_position_are_seen(dtype):
    """Probe: a NaN's payload or sign, ±0, one ulp, ``abs_`` of one negative and of two negatives in
    the same half of their words (the case the shifted term exists for), at every position of a
    whole-words tensor and of an odd-length one: the fingerprint changes, and it equals the truth
    and the old formula after each edit."""
    g = torch.Generator().manual_seed(7)
    for n in (16, 7):
        for name, edit in _edits(dtype):
            for i in range(n):
                t = (torch.randn(n, generator=g) + 0.5).to(dtype)
                before = edit(t, i)
                after = _fingerprint(t)
                assert int(after) == _truth(t) == int(_old(t)), (dtype, n, name, i)
                assert int(after) != int(before), (dtype, n, name, i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_blind_spots_are_those_of_the_old_formula(dtype):
    """Probe (known limits of any linear checksum, unchanged by the op): negating a positive and a
    negative at the same position of two words, and swapping two elements across words, leave the
    fingerprint as the old one left it; swapping within a word is seen. Values asserted against the
    truth, the blindness against the old formula (the op did not make it worse)."""
    per_word = 8 // torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(32, generator=g).abs() + 0.5).to(dtype)
    t[per_word] = -t[per_word]
    def permute(order):
        return lambda u: u.copy_(u[torch.tensor(order)])

    rest = list(range(per_word + 1, 32))
    cases = {
        "neg_pair": lambda u: (u[0:1].neg_(), u[per_word:per_word + 1].neg_()),
        "swap_across_words": permute([per_word, *range(1, per_word), 0, *rest]),
    }
    if per_word > 1:
        cases["swap_within_word"] = permute([1, 0, *range(2, 32)])
    for name, edit in cases.items():
        u = t.clone()
        edit(u)
        assert not torch.equal(u.view(torch.uint8), t.view(torch.uint8)), name
        new_blind = int(_fingerprint(u)) == int(_fingerprint(t))
        old_blind = int(_old(u)) == int(_old(t))
        assert int(_fingerprint(u)) == _truth(u), name
        assert new_blind == old_blind, name
        if name == "swap_within_word":
            assert not new_blind


# ------------------------------------------------------------------------------------ the op itself

@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.float32, torch.bool, torch.uint8,
                                   torch.complex64, torch.int16])
def test_the_op_refuses_other_dtypes_naming_itself(dtype):
    with pytest.raises(RuntimeError, match=r"bpclip_fast\.word_checksum: words must be int64"):
        OP(torch.zeros(4, dtype=dtype))


def test_the_op_under_grad_modes_autocast_and_on_cpu_without_cuda():
    """Probe: no_grad, inference_mode (an inference tensor too), autocast (the op has no autocast
    kernel: int64 passes through), a tensor that requires grad fingerprinted through ``_fingerprint``
    (detached there), and the CPU kernel with CUDA absent: every value exact, on the CPU, without grad."""
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(-(1 << 63), (1 << 63) - 1, (1000,), generator=gen, dtype=torch.int64)
    want = _signed(sum(w + (w >> 33) for w in words.tolist()))
    with torch.no_grad():
        assert int(OP(words)) == want
    with torch.inference_mode():
        inf = words.clone()
        got = OP(inf)
        assert int(got) == want and int(_fingerprint(inf.view(torch.float64))) == want
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            got = OP(words)
            assert got.dtype == torch.int64 and int(got) == want
    p = nn.Parameter(words.view(torch.float64).clone())
    got = _fingerprint(p)
    assert not got.requires_grad and got.grad_fn is None and int(got) == want
    got = OP(words)
    assert got.device.type == "cpu" and not got.requires_grad


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.int32, torch.int64])
def test_fingerprint_of_other_dtypes_is_exact(dtype):
    """Probe: dtypes a parameter's gradient cannot have in this library (complex, integer) still
    fingerprint exactly, as before (the word path views any whole-words tensor as int64)."""
    gen = torch.Generator().manual_seed(2)
    raw = torch.randint(-(1 << 63), (1 << 63) - 1, (12,), generator=gen, dtype=torch.int64)
    t = raw.view(dtype) if dtype.is_complex or dtype == torch.int64 else raw.view(torch.int32)
    for v in (t, t[1:], t[:5]):
        assert int(_fingerprint(v)) == _truth(v) == int(_old(v))


def test_the_op_is_traceable_and_fake_gives_a_cpu_int64_scalar():
    """The fake kernel (a trace of ``_fingerprint``, should one ever happen): an int64 0-dim tensor on the
    words' device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = torch.empty(10, dtype=torch.int64)
        out = OP(w)
    assert out.dtype == torch.int64 and out.dim() == 0 and out.device.type == "cpu"


# ------------------------------------------------------------------------------------ end to end

class _Spy:
    """Counts ``_fingerprint`` calls made by the step boundary and its hooks; asserts none runs while
    tracing."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = boundary.fingerprint

        def spy(t):
            from torch._subclasses.fake_tensor import FakeTensor

            assert not torch.compiler.is_compiling() and not isinstance(t, FakeTensor), "traced"
            self.calls += 1
            return real(t)

        for module in (boundary, layer_hooks):  # the step's records and its parameter hooks
            monkeypatch.setattr(module, "fingerprint", spy)


def _private_mlp(batch=4, mode="flat", model=None):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch),
            noise_multiplier=1.0, max_grad_norm=1.0, clipping=mode, noise_seed=1, probe=False)


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("autocast", [False, True])
def test_an_edit_through_data_between_micro_batches_is_refused(mode, autocast, monkeypatch):
    """End to end (eager): one ulp written through ``p.grad.data`` between the two micro-batch passes
    of a batch (no version counter moves) was caught by the fingerprint. Since declared accumulation
    there is nothing to write between them: inside ``optimizer.accumulate()`` ``.grad`` is zero until
    the block ends (and the step goes through), and outside it the second pass is refused
    before it runs (``accumulate``) whatever was written. Under CPU autocast too; no fingerprint is
    ever taken while tracing."""
    _Spy(monkeypatch)
    for block in (True, False):
        model, opt, loader = _private_mlp(mode=mode)
        x, y = next(iter(loader))
        opt.zero_grad()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
        first = model[0].weight if hasattr(model, "__getitem__") else model._module[0].weight
        if block:
            with opt.accumulate():
                with ctx:
                    F.cross_entropy(model(x[:2]), y[:2]).backward()
                assert not first.grad.any()  # the block's passes land zeros; the engine keeps their sums
                with ctx:
                    F.cross_entropy(model(x[2:]), y[2:]).backward()
            opt.step()
            continue
        with ctx:
            F.cross_entropy(model(x[:2]), y[:2]).backward()
        first.grad.data.view(torch.int32)[1, 2] += 1
        with pytest.raises(StepRefused) as exc:
            with ctx:
                F.cross_entropy(model(x[2:]), y[2:]).backward()
        assert exc.value.rule == "accumulate"


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_compiled_weight_reuse_is_refused_and_the_checksum_runs_only_at_run_time(mode, monkeypatch):
    """End to end (compiled, weight-reuse): inductor writes the plain use's gradient into our op's
    output buffer in place; the sealed fingerprint catches it at AccumulateGrad. The fingerprint is
    computed at run time only (never on a FakeTensor nor while dynamo compiles)."""
    torch._dynamo.reset()
    spy = _Spy(monkeypatch)
    try:
        model, opt, loader = _private_plain_use(mode, "linear")
        run = torch.compile(model, backend="inductor")
        x, y = next(iter(loader))
        opt.zero_grad()
        with pytest.raises(StepRefused) as exc:
            F.cross_entropy(run(x), y).backward()
            opt.step()
        assert exc.value.rule == "weight-reuse"
        assert spy.calls >= 2  # sealed in the op, compared at AccumulateGrad
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------------------------ findings

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["stepped_1d", "expanded_1d", "expanded_1d_odd_offset",
                                    "stepped_1d_offset_8_elements", "stepped_1d_odd_offset"])
def test_finding_a_stepped_or_expanded_1d_tensor_is_fingerprinted(dtype, layout):
    """Finding 1 (low, before 77867a9 too). ``reshape(-1)`` keeps a 1-D view's stride, and ``view(int64)``
    of a 2- or 4-byte dtype needs stride 1: ``_fingerprint`` of a stepped or expanded 1-D tensor
    whose bytes fill whole words raised "self.stride(-1) must be 1 to view Float as Long" — from
    inside ``backward()`` when such a tensor is ``.grad`` between micro-batch passes."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(70, generator=g).to(dtype)
    t = {"stepped_1d": base[:32:2], "expanded_1d": base[0:1].expand(16), "expanded_1d_odd_offset": base[3:4].expand(16),
         "stepped_1d_offset_8_elements": base[8:69:4], "stepped_1d_odd_offset": base[1:65:4]}[layout]
    assert t.dim() == 1 and t.stride(0) != 1 and (t.numel() * t.element_size()) % 8 == 0
    assert int(_fingerprint(t)) == _truth(t)


def _strided_zeros_like(p):
    return torch.zeros(2 * p.numel(), dtype=p.dtype).view(2, *p.shape).select(0, 0) if p.dim() != 1 \
        else torch.zeros(2 * p.numel(), dtype=p.dtype)[::2]


@pytest.mark.parametrize("edit", [False, True])
def test_finding_a_strided_zeroed_grad_between_micro_batches_is_still_checked(edit):
    """Finding 1, end to end. Zeroing the gradients by assigning zeros (allowed before the step's
    first backward; between two passes of a step it is now refused, ``redraw``, review 48 G1) where a
    bias's zeros are a stepped view: the next partial pass's fingerprint raised a RuntimeError out of
    ``backward()``. A partial pass over such zeros is fingerprinted without error; a one-ulp edit
    through ``.data`` before the last pass, outside ``optimizer.accumulate()``, is refused before that
    pass runs (``accumulate``: the rule of any second landing pass there); inside the block the
    stepped zeros are accumulated into, held, and the step goes through."""
    model, opt, loader = _private_mlp(batch=6)
    x, y = next(iter(loader))
    opt.zero_grad()
    for p in model.parameters():
        p.grad = _strided_zeros_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the gradient layout contract
        if not edit:
            with opt.accumulate():
                F.cross_entropy(model(x[:3]), y[:3]).backward()
                F.cross_entropy(model(x[3:]), y[3:]).backward()
            opt.step()
            return
        F.cross_entropy(model(x[:3]), y[:3]).backward()
        bias = [p for p in model.parameters() if p.dim() == 1][0]
        assert bias.grad.stride() == (2,)
        bias.grad.data.view(torch.int32)[::2][0] += 1  # one ulp of element 0
        with pytest.raises(StepRefused) as exc:
            F.cross_entropy(model(x[3:]), y[3:]).backward()
        assert exc.value.rule == "accumulate"


# ------------------------------------------------------------------------------------ the emulated CUDA kernel

@pytest.mark.parametrize("sm_count", [1, 0])
@pytest.mark.parametrize("n", [8 * 256 * 3 + 5, 8 * 256])
def test_the_emulated_launch_at_its_grid_cap_is_exact(n, sm_count):
    """Probe: the launcher's own grid when it is capped (8 blocks per SM; sm_count 0 read as 1), so
    every thread loops over several words and the last block's tail threads hold none but still join
    the full-mask shuffle; extremes planted at both ends. The emulated kernel against the exact sum."""
    sys.path.insert(0, str(Path(__file__).parent / "emulator"))
    import harness  # noqa: E402  (as tests/test_emulator.py imports it)

    sim = harness.Simt(harness.build_library())
    sim.schedule("random", n + sm_count)
    words, want = _planted_words(n)
    assert int(sim.word_checksum(words, 0, sm_count)) == want
