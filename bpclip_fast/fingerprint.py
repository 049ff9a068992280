"""The bits' fingerprint behind the step boundary's checks of gradients between passes and of the
compiled ops' sealed outputs (:mod:`bpclip_fast.boundary`)."""

from __future__ import annotations

import torch


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The wrapping sum of the tensor's bit patterns (device scalar): any ordinary edit changes it.

    Summed as 64-bit words (mod 2^64) whenever the tensor's bytes fill whole words: widening each
    fp32/fp16 word to int64 first made this two thirds of a compiled MLP step's overhead (issue 25),
    and the word sum is one op (``word_checksum``), one pass without temporaries.
    Changing any one element changes one word, hence the sum. Like the exact sum of 32-bit words
    it replaces, it is a linear checksum, blind to edits whose deltas cancel (both: negating one
    positive and one negative fp32; each word is summed with itself shifted right by 33 bits, so two
    sign flips in the words' high halves, e.g. ``abs_``, do not cancel) — it catches an ordinary
    in-place write, not a forgery. The value depends on the bits in logical order only (a
    misaligned or strided view is copied first), so equal tensors fingerprint equal whatever their layout."""
    flat = t.detach().reshape(-1)
    size = flat.element_size()
    if (flat.numel() * size) % 8 == 0:
        # view(int64) of 2- or 4-byte elements needs stride 1, and reshape(-1) keeps a stepped or
        # expanded 1-D view's stride (a .grad assigned as one raised out of backward()).
        if (flat.storage_offset() * size) % 8 or not flat.is_contiguous():
            flat = flat.clone(memory_format=torch.contiguous_format)
        # Σ w + (w >> 33) in one pass (csrc/include/bpclip_fast/checksum.h): the shifted part keeps two
        # sign flips in the words' high halves (abs_ of two negative fp32 there) from cancelling.
        return torch.ops.bpclip_fast.word_checksum(flat.view(torch.int64))
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[size]
    return flat.view(bits).sum(dtype=torch.int64)
