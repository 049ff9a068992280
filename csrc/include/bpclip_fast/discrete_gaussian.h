// Exact sampling of the discrete Gaussian N_Z(0, s^2), P(y) proportional to exp(-y^2 / (2 s^2)) on
// the integers, for an integer s >= 1, from Philox4x32-10 words with integer arithmetic only
// (Canonne, Kamath and Steinke, "The Discrete Gaussian for Differential Privacy", NeurIPS 2020,
// Algorithms 1-3). The first stage of the integer release (docs/design.md, "Integer noise"): no
// float enters the draw, so the value a coordinate receives has exactly the discrete Gaussian's
// probability (but for the caps below), and the CPU, CUDA and emulated builds give the same bits
// with no rounding to agree on.
//
// Stream. Element i of a draw at (seed, offset) reads its own words: block j (j = 0, 1, ...) is
//   philox4x32_10(counter = (j, lo(i), lo(offset), hi(offset)),
//                 key = (lo(seed) ^ (tag << 24 | bits 32..55 of i), hi(seed))),
// four 32-bit words each, consumed in order; a 64-bit word is (first << 32 | second), and single
// bits come from a reservoir of whole words, low bit first. The tag (1:
// this noise, 2: the rounding words of the release) is never 0, so no key equals the float draw's
// (lo(seed), hi(seed)) and no two (tag, i) share a key. i < 2^56.
//
// Construction (CKS). All Bernoulli trials take fresh words and are exact:
//  - uniform_below(m): Lemire's multiply-and-reject, uniform on {0, .., m - 1} for 1 <= m <= 2^53,
//    from one 32-bit word per try for m <= 2^28 and one 64-bit word otherwise.
//  - bernoulli_ratio(n, d) = [uniform_below(d) < n], P = n/d exactly; d = 2 takes one bit.
//  - bernoulli_exp_frac(n, d), P = exp(-g) for g = n/d in [0, 1] (CKS Algorithm 1): K = 1, 2, ...
//    while Bernoulli(g/K) succeeds; return [K odd]. P(stop at K) = g^(K-1)/(K-1)! - g^K/K!, and the
//    odd K sum to sum_j (-g)^j / j! = exp(-g). Bernoulli(g/K) is Bernoulli(1/K) and Bernoulli(n/d),
//    independent, so every number stays below 2^64.
//  - A trial: U = uniform_below(s), accepted with Bernoulli(exp(-U/s)); V counts the successes of
//    Bernoulli(exp(-1)) before the first failure; X = U + sV, so P(X = x) is proportional to
//    exp(-x/s) (one (U, V) per x); a fair bit B gives the sign, B = 1 with X = 0 rejected (0 would
//    be counted twice): Y is discrete Laplace with scale s (CKS Algorithm 2). Y is accepted with
//    Bernoulli(exp(-(|Y| - s)^2 / (2 s^2))) (CKS Algorithm 3 with sigma = t = s): the product of
//    the two is proportional to exp(-|y|/s - (|y| - s)^2/(2 s^2)) = exp(-y^2/(2 s^2) - 1/2). Any
//    rejection starts a new trial, which leaves the accepted value's law unchanged.
//  - The acceptance exponent in integers: a = ||Y| - s|, q = a / s, r = a % s, and
//    (a/s)^2/2 = floor(q^2/2) + floor(qr/s) + (q mod 2)/2 + (qr mod s)/s + r^2/(2 s^2),
//    so the trial is Bernoulli(exp(-1)) floor(q^2/2) + floor(qr/s) times, then Bernoulli(exp(-1/2))
//    if q is odd, bernoulli_exp_frac(qr mod s, s), and the loop of Algorithm 1 for g = r^2/(2 s^2)
//    with Bernoulli(g/K) = Bernoulli(1/(2K)) Bernoulli(r/s) Bernoulli(r/s); every factor is
//    exp(-(its part)), the parts sum to the exponent, and the trials are independent.
//
// Caps (the only departure from the exact law). The loops are capped so that a GPU thread's work
// is bounded; a capped draw returns 0 (any value would do). On the complement of the event "some
// cap is reached", the capped sampler's value equals the uncapped one's, so its law is within total
// variation P(event) of N_Z(0, s^2), per element, under ideal Philox words:
//  - kDgTrials = 512 trials. A trial yields a value with probability at least
//    (1 - e^-1) * 1/2 * e^-1/2 (1 - e^-2) = 0.1658: the average of exp(-u/s) over u < s is at least
//    the integral of exp(-x) over [0, 1]; the zero rejection takes at most half; and the acceptance
//    is at least e^-1/2 wherever |Y| <= 2s, which Y misses with probability
//    2 e^(-2 - 1/s)/(1 + e^(-1/s)) < e^-2. So P(512 trials fail) < 0.8342^512 < 2^-133.
//  - kDgMaxV = 96: V reaches it with probability e^-96 < 2^-138 per trial, < 2^-129.5 per element.
//    So V <= 95, X < 96s, a < 95s and q <= 94: a trial runs at most 1 + 96 + (94^2/2 + 94) + 3 =
//    4612 loops of Algorithm 1, an element fewer than 512 * 4612 < 2^22.
//  - kDgMaxK = 40 steps of Algorithm 1's loop: reached with probability at most 1/40! < 2^-159 per
//    loop, < 2^-137 per element.
//  - Lemire's rejections in a row, each with probability below m 2^-32 <= 2^-4 for the 32-bit words
//    (m <= 2^28; kDgLemireRetries32 = 48) and m 2^-64 <= 2^-11 for the 64-bit ones (m <= 2^53;
//    kDgLemireRetries = 16): below 2^-176 per call, with fewer than 2^22 * 40 * 3 < 2^29 calls.
//  Together under 2^-129 per element: a run of d elements over T steps departs from the exact
//  mechanism with probability below d T 2^-129, which an (epsilon, delta) statement absorbs into delta
//  (total variation eta adds (1 + e^epsilon) eta to delta).
// Word budget: a uniform or a bit reads at most max(49, 17 * 2) = 49 words and a loop step draws at
// most 3 of them, so an element reads at most 512 * (4612 * 40 * 3 * 49 + 49 + 1) < 1.39e10 words,
// 3.5e9 < 2^32 blocks: the 32-bit block counter never wraps (dg_word32 still marks the last block
// as capped, should the caps change).
#pragma once

#include <stdint.h>

#include "bpclip_fast/macros.h"
#include "bpclip_fast/philox.h"

namespace bpclip {

constexpr int kDgTrials = 512;
constexpr int kDgMaxV = 96;
constexpr int kDgMaxK = 40;
constexpr int kDgLemireRetries = 16;
constexpr int kDgLemireRetries32 = 48;
constexpr uint64_t kDgSmallRange = uint64_t{1} << 28;  // uniform_below takes 32-bit words up to here
constexpr uint64_t kDgMaxSigma = uint64_t{1} << 52;  // s <= 2^52: every product below stays < 2^64
constexpr uint32_t kDgTagNoise = 1u;
constexpr uint32_t kDgTagRounding = 2u;

// 64 x 64 -> 128-bit product from 32-bit halves: one definition for the CPU, CUDA and emulated
// builds (no __int128 or __umul64hi), so the emulator runs the device's arithmetic.
BPCLIP_HD inline void mul_64x64(uint64_t a, uint64_t b, uint64_t* hi, uint64_t* lo) {
  const uint64_t a0 = a & 0xffffffffu, a1 = a >> 32, b0 = b & 0xffffffffu, b1 = b >> 32;
  const uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
  const uint64_t mid = (p00 >> 32) + (p01 & 0xffffffffu) + (p10 & 0xffffffffu);
  *lo = (mid << 32) | (p00 & 0xffffffffu);
  *hi = p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
}

// The words of one element (see the header comment for the counters and the key).
struct DgStream {
  uint32_t k0, k1, elem_lo, off_lo, off_hi;
  uint32_t block;  // the next block to draw
  uint32_t words[4];
  int pos;       // next word in `words`; 4: draw a block first
  uint32_t bits;  // the bit reservoir: its unused bits, low first
  int nbits;
  bool capped;  // a cap was reached (the value is then 0)
};

BPCLIP_HD inline DgStream dg_stream(uint64_t seed, uint64_t offset, uint64_t element, uint32_t tag) {
  DgStream st;
  st.k0 = static_cast<uint32_t>(seed) ^ ((tag << 24) | static_cast<uint32_t>((element >> 32) & 0xffffffu));
  st.k1 = static_cast<uint32_t>(seed >> 32);
  st.elem_lo = static_cast<uint32_t>(element);
  st.off_lo = static_cast<uint32_t>(offset);
  st.off_hi = static_cast<uint32_t>(offset >> 32);
  st.block = 0;
  st.pos = 4;
  st.bits = 0;
  st.nbits = 0;
  st.capped = false;
  return st;
}

BPCLIP_HD inline uint32_t dg_word32(DgStream& st) {
  if (st.pos == 4) {
    if (st.block == 0xffffffffu) st.capped = true;  // see "Word budget": never reached in practice
    const U4 w = philox4x32_10(U4{st.block, st.elem_lo, st.off_lo, st.off_hi}, st.k0, st.k1);
    st.words[0] = w.x;
    st.words[1] = w.y;
    st.words[2] = w.z;
    st.words[3] = w.w;
    st.block += st.block != 0xffffffffu ? 1u : 0u;
    st.pos = 0;
  }
  return st.words[st.pos++];
}

BPCLIP_HD inline uint64_t dg_word64(DgStream& st) {
  const uint64_t hi = dg_word32(st);
  return (hi << 32) | dg_word32(st);
}

BPCLIP_HD inline bool dg_bit(DgStream& st) {
  if (st.nbits == 0) {
    st.bits = dg_word32(st);
    st.nbits = 32;
  }
  const bool b = (st.bits & 1u) != 0u;
  st.bits >>= 1;
  --st.nbits;
  return b;
}

// Uniform on {0, .., m - 1} (Lemire 2019): x m = hi 2^W + lo for a uniform W-bit x; the values of x
// with lo < (2^W - m) mod m are rejected, leaving exactly floor(2^W / m) per value of hi. W = 32 for
// m <= 2^28, W = 64 for 2^28 < m <= 2^53.
BPCLIP_HD inline uint64_t uniform_below(DgStream& st, uint64_t m) {
  if (m <= kDgSmallRange) {
    const uint32_t m32 = static_cast<uint32_t>(m);
    uint64_t p = static_cast<uint64_t>(dg_word32(st)) * m32;
    if (static_cast<uint32_t>(p) < m32) {
      const uint32_t threshold = (0u - m32) % m32;
      for (int retry = 0; static_cast<uint32_t>(p) < threshold; ++retry) {
        if (retry == kDgLemireRetries32) {
          st.capped = true;
          return 0;
        }
        p = static_cast<uint64_t>(dg_word32(st)) * m32;
      }
    }
    return p >> 32;
  }
  uint64_t hi, lo;
  mul_64x64(dg_word64(st), m, &hi, &lo);
  if (lo < m) {
    const uint64_t threshold = (0u - m) % m;
    for (int retry = 0; lo < threshold; ++retry) {
      if (retry == kDgLemireRetries) {
        st.capped = true;
        return 0;
      }
      mul_64x64(dg_word64(st), m, &hi, &lo);
    }
  }
  return hi;
}

// P = n/d, 0 <= n <= d, 1 <= d <= 2^53.
BPCLIP_HD inline bool bernoulli_ratio(DgStream& st, uint64_t n, uint64_t d) {
  if (n == 0) return false;
  if (n == d) return true;
  if (d == 2) return dg_bit(st);
  return uniform_below(st, d) < n;
}

// P = exp(-n/d), 0 <= n <= d (CKS Algorithm 1, Bernoulli(g/K) as Bernoulli(1/K) Bernoulli(n/d)).
BPCLIP_HD inline bool bernoulli_exp_frac(DgStream& st, uint64_t n, uint64_t d) {
  int k = 1;
  while (true) {
    const bool a = (k == 1 || bernoulli_ratio(st, 1, static_cast<uint64_t>(k))) && bernoulli_ratio(st, n, d);
    if (!a) break;
    if (++k > kDgMaxK) {
      st.capped = true;
      return false;
    }
  }
  return (k & 1) != 0;
}

// P = exp(-r^2 / (2 s^2)), 0 <= r < s: Algorithm 1 with Bernoulli(g/K) as
// Bernoulli(1/(2K)) Bernoulli(r/s) Bernoulli(r/s).
BPCLIP_HD inline bool bernoulli_exp_square(DgStream& st, uint64_t r, uint64_t s) {
  int k = 1;
  while (true) {
    const bool a = bernoulli_ratio(st, 1, 2 * static_cast<uint64_t>(k)) && bernoulli_ratio(st, r, s) &&
                   bernoulli_ratio(st, r, s);
    if (!a) break;
    if (++k > kDgMaxK) {
      st.capped = true;
      return false;
    }
  }
  return (k & 1) != 0;
}

// One trial (see the header comment); true with *y set when it yields a value.
BPCLIP_HD inline bool discrete_gaussian_trial(DgStream& st, uint64_t s, int64_t* y) {
  const uint64_t u = uniform_below(st, s);
  if (!bernoulli_exp_frac(st, u, s)) return false;
  uint64_t v = 0;
  while (bernoulli_exp_frac(st, 1, 1)) {
    if (++v == kDgMaxV) {
      st.capped = true;
      return false;
    }
  }
  const uint64_t x = u + s * v;
  const bool negative = dg_bit(st);
  if (negative && x == 0) return false;
  // q, r = divmod(a, s) and divmod(q r, s) by subtraction: a < 95s and q r < 94s, and q is 0 or 1 for
  // most trials, where a 64-bit division would cost more than the rest of the trial.
  const uint64_t a = x >= s ? x - s : s - x;
  uint64_t q = 0, r = a;
  while (r >= s) {
    r -= s;
    ++q;
  }
  uint64_t qr_whole = 0, qr_rest = q * r;
  while (qr_rest >= s) {
    qr_rest -= s;
    ++qr_whole;
  }
  for (uint64_t i = (q * q) / 2 + qr_whole; i > 0; --i) {
    if (!bernoulli_exp_frac(st, 1, 1)) return false;
  }
  if ((q & 1u) != 0u && !bernoulli_exp_frac(st, 1, 2)) return false;
  if (!bernoulli_exp_frac(st, qr_rest, s)) return false;
  if (!bernoulli_exp_square(st, r, s)) return false;
  *y = negative ? -static_cast<int64_t>(x) : static_cast<int64_t>(x);
  return true;
}

// N_Z(0, s^2) for element `element` of the draw at (seed, offset); s = 0 gives 0 (no noise).
// 0 <= s <= kDgMaxSigma (the caller checks).
BPCLIP_HD inline int64_t discrete_gaussian(uint64_t seed, uint64_t offset, uint64_t element, uint64_t s) {
  if (s == 0) return 0;
  DgStream st = dg_stream(seed, offset, element, kDgTagNoise);
  for (int t = 0; t < kDgTrials && !st.capped; ++t) {
    int64_t y;
    if (discrete_gaussian_trial(st, s, &y)) return st.capped ? 0 : y;
  }
  return 0;
}

}  // namespace bpclip
