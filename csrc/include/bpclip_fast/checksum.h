// The word checksum behind the step boundary's bit checks (bpclip_fast/boundary.py, _fingerprint:
// the compiled path's sealed outputs and eager's partial-pass edit check), one home for the CPU
// kernel and the CUDA one: the sum over a tensor's 64-bit words w of w + (w >> 33), the shift
// arithmetic (C++20), modulo 2^64. Changing any one word changes its term, hence the sum; the
// shifted part keeps two sign flips in the words' high halves (abs_ of two negative fp32 there)
// from cancelling, as their 2^63 steps would. Integer addition modulo 2^64 is associative and
// commutative, so every order of summation (threads, blocks, atomics) gives the same bits.
#pragma once

#include <stdint.h>

#include "bpclip_fast/macros.h"

namespace bpclip {

BPCLIP_HD_INLINE uint64_t checksum_term(int64_t w) {
  return static_cast<uint64_t>(w) + static_cast<uint64_t>(w >> 33);
}

}  // namespace bpclip
