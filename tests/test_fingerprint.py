"""``bpclip_fast.fingerprint.fingerprint``: the bits' checksum behind the compiled path's sealed-output check (an
in-place write into our op's returned buffer) and eager's partial-pass edit check.

Since issue 25 it sums 64-bit words where the tensor's bytes allow and falls back to the 2- or
4-byte words otherwise; each path must see a change of any single element, at every position,
including the last element of an odd-length tensor and tensors starting at an odd offset.
"""

from __future__ import annotations

import pytest
import torch

from bpclip_fast.fingerprint import fingerprint as _fingerprint

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _tensors(dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2 * 3 * 5 + 1, generator=g).to(dtype)
    yield base[:30].view(5, 6)       # 64-bit words for every dtype
    yield base[:7]                   # an odd length: 2/4-byte words except for float64
    yield base[1:31]                 # an odd storage offset
    yield base[:30].view(5, 6).t()   # not contiguous (reshape copies)


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_single_element_change_changes_the_fingerprint(dtype):
    for t in _tensors(dtype):
        before = _fingerprint(t)
        assert before.dtype == torch.int64 and before.dim() == 0
        for i in range(t.numel()):
            edited = t.contiguous().clone()
            edited.view(-1)[i] += 1
            assert _fingerprint(edited) != before, (dtype, tuple(t.shape), t.storage_offset(), i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fingerprint_depends_on_the_bits_in_order_only(dtype):
    for t in _tensors(dtype):
        # the same values in a fresh contiguous buffer (another offset, other strides): the same sum
        assert _fingerprint(t) == _fingerprint(t.contiguous().clone())
        # +0.0 and -0.0 compare equal but are different bits: an edit the check must see
        for i in range(t.numel()):
            z = torch.zeros_like(t).contiguous()
            before = _fingerprint(z)
            z.view(-1)[i] = -0.0
            assert _fingerprint(z) != before, (dtype, tuple(t.shape), i)


def _exact(words):
    total = sum(w + (w >> 33) for w in words.reshape(-1).tolist()) % (1 << 64)
    return total - (1 << 64) if total >= 1 << 63 else total


@pytest.mark.parametrize("threads", [1, 2])
def test_the_word_sum_is_exact_and_independent_of_the_threads(threads):
    """``word_checksum`` (one pass, split across threads above 2^16 words) against Python's exact
    integers, at sizes below and above one thread's share, extreme words included."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        for n in (0, 1, 7, (1 << 16) + 3, 3 * (1 << 16) + 1):
            words = torch.randint(-(1 << 63), (1 << 63) - 1, (n,), generator=gen, dtype=torch.int64)
            words[:min(n, 3)] = torch.tensor([-(1 << 63), -1, (1 << 63) - 1])[:min(n, 3)]
            got = torch.ops.bpclip_fast.word_checksum(words)
            assert got.dtype == torch.int64 and got.dim() == 0 and int(got) == _exact(words), n
        strided = torch.arange(40, dtype=torch.int64).view(5, 8).t()  # logical order, not storage order
        assert int(torch.ops.bpclip_fast.word_checksum(strided)) == _exact(strided.contiguous())
    finally:
        torch.set_num_threads(before)


def test_the_word_sum_refuses_other_dtypes():
    with pytest.raises(RuntimeError, match="words must be int64"):
        torch.ops.bpclip_fast.word_checksum(torch.zeros(4, dtype=torch.float64))


def test_one_byte_elements_of_an_odd_count_are_fingerprinted():
    """bool/uint8 tensors whose bytes do not fill whole words: summed as 1-byte words (review 16)."""
    t = torch.tensor([True, False, True], dtype=torch.bool)
    before = _fingerprint(t)
    t[1] = True
    assert _fingerprint(t) != before
    u = torch.arange(5, dtype=torch.uint8)
    assert int(_fingerprint(u)) == sum(range(5))
