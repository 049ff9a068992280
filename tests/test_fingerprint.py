"""``boundary._fingerprint``: the bits' checksum behind the compiled path's sealed-output check (an
in-place write into our op's returned buffer) and eager's partial-pass edit check.

Since issue 25 it sums 64-bit words where the tensor's bytes allow and falls back to the 2- or
4-byte words otherwise; each path must see a change of any single element, at every position,
including the last element of an odd-length tensor and tensors starting at an odd offset.
"""

from __future__ import annotations

import pytest
import torch

from bpclip_fast.boundary import _fingerprint

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
