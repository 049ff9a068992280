"""Attack review of issue 25's fused ops (round 5): what the fused forms must not allow that the
separate calls they replace could not do either."""

from __future__ import annotations

import pytest
import torch

from bpclip_fast import _ops


def _two_calls(w, b, seed, offset, std, acc_w, acc_b):
    w2, b2 = w.clone(), b.clone()
    _ops.philox_noise_(w2, seed, offset, std, acc_w)
    _ops.philox_noise_(b2, seed, offset + 1, std, acc_b)
    return w2, b2


# philox_noise2_ runs both draws in ONE launch on a GPU, its buffers __restrict__ and a
# non-contiguous one copied before the launch and back after it: with w and b sharing memory the
# lanes race on the shared elements, or one buffer's copy-back overwrites the other's draw there,
# so the result is not the two calls it documents (on the CPU it happens to be). Overlapping
# buffers are refused, as ATen refuses overlapping in-place outputs.
@pytest.mark.parametrize("views", ["same", "partial", "strided_partial"])
def test_noise2_refuses_buffers_that_share_memory(views):
    t = torch.zeros(32)
    w, b = {"same": (t, t), "partial": (t[:20], t[10:]), "strided_partial": (t[::2], t[4:12])}[views]
    with pytest.raises(ValueError, match="philox_noise2_: .*overlap"):
        _ops.philox_noise2_(w, b, 1, 2, 1.0, True, True)
    assert torch.count_nonzero(t) == 0, "refused, so nothing was drawn"


def test_noise2_accepts_disjoint_views_of_one_storage_as_two_calls():
    t = torch.randn(40, dtype=torch.float64)
    w, b = t[:24].view(4, 6), t[24:]
    rw, rb = _two_calls(w, b, 7, 10, 0.5, True, True)
    _ops.philox_noise2_(w, b, 7, 10, 0.5, True, True)
    assert torch.equal(w, rw) and torch.equal(b, rb)


def test_noise2_refuses_interleaved_views_conservatively():
    # No element in common, but the spans of memory cross: refused too (the rule is on spans, which
    # is cheap; a layer's weight and bias gradients are separate buffers and never meet it).
    t = torch.zeros(40)
    with pytest.raises(ValueError, match="philox_noise2_: .*overlap"):
        _ops.philox_noise2_(t[0::2], t[1::2], 7, 10, 0.5, True, False)


@pytest.mark.parametrize("views", ["same", "partial", "strided_partial", "interleaved"])
def test_the_noise2_op_itself_refuses_buffers_that_share_memory(views):
    """The op behind the wrapper (``torch.ops`` callers, and the GPU, where the one launch races)."""
    if not _ops.extension_loaded():
        pytest.skip("the bpclip_fast extension is not built")
    t = torch.zeros(32)
    w, b = {"same": (t, t), "partial": (t[:20], t[10:]), "strided_partial": (t[::2], t[4:12]),
            "interleaved": (t[0::2], t[1::2])}[views]
    with pytest.raises(RuntimeError, match="philox_noise2_: .*overlap"):
        torch.ops.bpclip_fast.philox_noise2_(w, b, 1, 2, 1.0, True, True)
    assert torch.count_nonzero(t) == 0, "refused, so nothing was drawn"


def test_the_fingerprint_sees_abs_of_two_negatives_in_the_words_high_halves():
    """fp32 pairs fill 64-bit words; abs_ flips the sign bit of the two negatives, each in a word's
    high half: +2^63 twice, 0 mod 2^64 for a plain word sum."""
    from bpclip_fast.fingerprint import fingerprint as _fingerprint

    g = torch.tensor([0.5, -0.1, 0.3, -0.2])
    before = _fingerprint(g).item()
    g.abs_()
    assert _fingerprint(g).item() != before
