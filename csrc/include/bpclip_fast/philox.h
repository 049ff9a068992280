// Counter-based Philox4x32-10 (Salmon et al., SC'11) and the Box-Muller map to normals.
//
// One header for both backends, so that the CPU and CUDA noise kernels draw the same numbers for
// the same (seed, offset). Layout: the elements of a buffer come in groups of 8; group g
// (elements 8g..8g+7) draws the three counter blocks g, g + 2^62 and g + 2^63, with
//   counter = (lo(block), hi(block), lo(offset), hi(offset)),  key = (lo(seed), hi(seed)),
// and turns their 12 words into four Box-Muller pairs (philox_normal8). Any buffer has fewer than
// 2^62 groups, so every (offset, element) has its own counters.
// The only difference between backends is FMA contraction on the GPU (a few ulp).
//
// The Gaussian tail. A pair takes a 64-bit radius word K = hi 2^32 + lo and a 23-bit angle.
// radius_uniform(hi, lo) = u1 = (K + 1/2) 2^-64, evaluated in float with full relative precision
// near 0: its smallest value, for K = 0, is exactly 2^-65, so |z| <= r(2^-65) = sqrt(2 ln 2^65) =
// sqrt(130 ln 2) = 9.4926 (the former 33-bit uniform stopped at 6.76, truncating 2^-32 per pair).
// Truncation: couple u1 with an ideal uniform U in (0, 1] by K = floor(2^64 U) (K is uniform on
// {0, .., 2^64 - 1} when Philox is). For K >= 1 the ideal radius sqrt(-2 ln U) is at most
// sqrt(2 ln 2^64) = 9.4193 < 9.4926 and the construction gives the radius of the cell's midpoint
// (rounded to float): a discretisation, not a truncation. Only the cell K = 0 (U < 2^-64) holds
// ideal radii beyond every value the construction can produce; it has probability 2^-64 = 5.4e-20
// per pair, so the truncated mass is at most 2^-64 per draw (< 1e-15 with a wide margin). In terms
// of the ideal normal: P(|Z| > 9.4926) = erfc(9.4926 / sqrt 2) = 2.3e-21 per draw.
#pragma once

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

// The float and double draws are bit-for-bit specified (the CPU, CUDA and emulated streams and the
// tests' replicas agree) only where every operation rounds to its own type: x87 arithmetic, which
// keeps intermediates in 80 bits (FLT_EVAL_METHOD 2), would give other bits (review 45 F8). 16 (GCC on
// AArch64 with half-precision arithmetic: only _Float16 is widened, to float) is as good as 0.
#if !defined(__CUDA_ARCH__) && defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0 && FLT_EVAL_METHOD != 16
#error "bpclip_fast: the noise's arithmetic needs FLT_EVAL_METHOD == 0 (SSE2 or AVX, not x87); build for x86-64, or with -mfpmath=sse -msse2"
#endif

#include "bpclip_fast/bits.h"
#include "bpclip_fast/macros.h"

namespace bpclip {

struct U4 {
  uint32_t x, y, z, w;
};

BPCLIP_HD inline uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Ten rounds, the key bumped between rounds: the Random123 reference definition.
BPCLIP_HD inline U4 philox4x32_10(U4 ctr, uint32_t k0, uint32_t k1) {
  const uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  const uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(kM0, ctr.x, &hi0);
    const uint32_t lo1 = mulhilo32(kM1, ctr.z, &hi1);
    ctr = U4{hi1 ^ ctr.y ^ k0, lo1, hi0 ^ ctr.w ^ k1, lo0};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

BPCLIP_HD inline U4 philox_block(uint64_t seed, uint64_t offset, uint64_t block) {
  const U4 ctr{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
               static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)};
  return philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Branch-free float log and sin/cos (Cephes-style minimax polynomials, about 1 ulp), written so
// that a compiler can vectorise a loop of them, and shared by both backends so that the CPU and
// CUDA streams agree to rounding (the only difference left is FMA contraction).
// log(x) for a positive normal float x.
BPCLIP_HD_INLINE float log_pos(float x) {
  const uint32_t bits = float_bits(x);
  float e = static_cast<float>(static_cast<int>((bits >> 23) & 0xffu) - 126);
  float m = bits_float((bits & 0x007fffffu) | 0x3f000000u);  // x = m * 2^e, m in [0.5, 1)
  const float small = static_cast<float>(m < 0.70710678118654752f);  // arithmetic, not a branch
  e -= small;
  m = m + m * small - 1.0f;  // m in [sqrt(1/2) - 1, sqrt(2) - 1)
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return m + y + 0.693359375f * e;
}

// (cos, sin) of 2*pi*u for u in [0, 1): u*4 splits exactly into a quadrant j and a remainder r in
// [-1/2, 1/2], so the polynomials only ever see |phi| <= pi/4.
BPCLIP_HD_INLINE void cos_sin_2pi(float u, float* c_out, float* s_out) {
  const float q = u * 4.0f;
  const float j = static_cast<float>(static_cast<int>(q + 0.5f));
  const float phi = (q - j) * 1.57079632679489662f;
  const float p2 = phi * phi;
  float s = -1.9515295891e-4f;
  s = s * p2 + 8.3321608736e-3f;
  s = s * p2 - 1.6666654611e-1f;
  s = phi + phi * p2 * s;
  float c = 2.443315711809948e-5f;
  c = c * p2 - 1.388731625493765e-3f;
  c = c * p2 + 4.166664568298827e-2f;
  c = 1.0f - 0.5f * p2 + p2 * p2 * c;
  // cos(j pi/2 + phi), sin(j pi/2 + phi): odd quadrants swap the pair, then sign bits flip.
  const uint32_t quadrant = static_cast<uint32_t>(static_cast<int>(j)) & 3u;
  const bool swap = (quadrant & 1u) != 0u;
  const float base_c = swap ? s : c;
  const float base_s = swap ? c : s;
  const float cq = bits_float(float_bits(base_c) ^ (((quadrant + 1u) & 2u) << 30));
  const float sq = bits_float(float_bits(base_s) ^ ((quadrant & 2u) << 30));
  *c_out = cq;
  *s_out = sq;
}

// u1 = (hi 2^32 + lo + 1/2) 2^-64 in (0, 1] (1 after rounding near the top). Each word enters as
// a signed int32 of its upper 31 bits (exact in float's range; the vectorised conversion) plus its
// low bit; the small terms are added first, so near 0 (hi = 0) u1 keeps full relative precision,
// and u1 = 2^-65 exactly for hi = lo = 0.
BPCLIP_HD_INLINE float radius_uniform(uint32_t hi, uint32_t lo) {
  const float a = static_cast<float>(static_cast<int32_t>(hi >> 1)) * 0x1p-31f +
                  static_cast<float>(hi & 1u) * 0x1p-32f;
  const float b = static_cast<float>(static_cast<int32_t>(lo >> 1)) * 0x1p-63f +
                  static_cast<float>(lo & 1u) * 0x1p-64f;
  return a + (b + 0x1p-65f);
}

// Box-Muller on a 64-bit radius word (hi, lo) and an angle word, of which 23 bits are used (float's
// precision; not enough against a floating-point attack, which no number of bits ends: the pairs lie on
// a lattice, review 44 F1, docs/design.md): z0 = r cos(2 pi u2), z1 = r sin(2 pi u2), r = sqrt(-2 ln u1).
// No draw is exactly 0 (review 40 F1: one was on ~1.5e-7 of the coordinates, which then released the
// clipped sum itself). The angle is the midpoint of one of 2^23 equal cells, u2 = (2k + 1) 2^-24
// (exact in float), so 4 u2 is never an integer: |phi| >= 2^-22 pi/2 and cos_sin_2pi's pair is never
// 0 (at the cells' left ends four angles gave sin or cos exactly 0). u1 rounds to 1 for the top
// cells of the radius word (K >= 2^64 (1 - 2^-25), probability 2^-25), where log would give r = 0:
// those take the largest float below 1, r = 3.45e-4 (their ideal radii are below 2.4e-4: a
// discretisation of the same kind as every cell's midpoint, not a truncation of the tail).
BPCLIP_HD_INLINE void box_muller(uint32_t hi, uint32_t lo, uint32_t angle, float* z0, float* z1) {
  const float u1 = radius_uniform(hi, lo);
  const float u2 = static_cast<float>(static_cast<int32_t>(((angle >> 9) << 1) | 1u)) * 0x1p-24f;
  const float l = log_pos(u1 < 1.0f ? u1 : 0x1.fffffep-1f);
  const float r = sqrtf(-2.0f * l > 0.0f ? -2.0f * l : 0.0f);
  float c, s;
  cos_sin_2pi(u2, &c, &s);
  *z0 = r * c;
  *z1 = r * s;
}

constexpr int kNormalsPerGroup = 8;
constexpr int kBlocksPerGroup = 3;

// Counter block j (0, 1, 2) of group g.
BPCLIP_HD inline uint64_t group_block(uint64_t group, int j) { return group + (static_cast<uint64_t>(j) << 62); }

// The eight normals of a group from its three blocks: pairs (b0.x b0.y | b2.x), (b0.z b0.w | b2.y),
// (b1.x b1.y | b2.z), (b1.z b1.w | b2.w) as (radius hi lo | angle), each giving (cos, sin).
BPCLIP_HD_INLINE void normals_of_group(const U4& b0, const U4& b1, const U4& b2, float z[8]) {
  box_muller(b0.x, b0.y, b2.x, &z[0], &z[1]);
  box_muller(b0.z, b0.w, b2.y, &z[2], &z[3]);
  box_muller(b1.x, b1.y, b2.z, &z[4], &z[5]);
  box_muller(b1.z, b1.w, b2.w, &z[6], &z[7]);
}

// The eight standard normals of group `group` (elements 8 group .. 8 group + 7).
BPCLIP_HD inline void philox_normal8(uint64_t seed, uint64_t offset, uint64_t group, float z[8]) {
  normals_of_group(philox_block(seed, offset, group_block(group, 0)), philox_block(seed, offset, group_block(group, 1)),
                   philox_block(seed, offset, group_block(group, 2)), z);
}

// ---- float64 normals, for float64 buffers ------------------------------------------------------
// Why: a float64 release noised with float32 normals times a float32 std differs from the clipped sum
// by a float32 number on every coordinate, which the neighbouring data set's sum almost never does, so
// one coordinate tells the two apart (review 40 F2, Mironov's floating-point attack in its strongest
// form). Float64 draws end that form, not the attack: a pair's two normals share (u1, angle), so the
// pairs a release can hold are a sparse lattice of double pairs (review 44 F1; open, docs/design.md). A float64 buffer therefore draws its normals in double, with a 52-bit angle, from the same
// counters: the float draw's three blocks plus a fourth, group_block(g, 3), whose words give each
// pair's angle 29 more bits. The draw refines the float one: the same radius word, the angle inside
// the float draw's angle cell (tests/cpp/test_philox.cpp bounds |z64 - z32|).
//
// Radius: u1 = (K + 1/2) 2^-64 as in radius_uniform, rounded once to double (the smallest value, K = 0,
// is 2^-65 exactly: the same tail, |z| <= 9.4926, and the same truncation argument as above). u1
// rounds to 1 for K >= 2^64 (1 - 2^-54); those take the largest double below 1, r = 2^-26.
// Angle: u2 = (2k + 1) 2^-53 for the 52-bit k = (angle >> 9) 2^29 + (angle_lo >> 3), the midpoint of
// one of 2^52 cells (exact in double; 4 u2 is never an integer, so no draw is exactly 0: review 40 F1).
// Smallest nonzero |z|: 2^-26 sin(2 pi 2^-53) > 2^-77, times the std floor 2^-80 a normal double.
// log, cos and sin are series written out here (both backends, as the float ones) and are within a
// few double ulp: log m = 2 atanh s, s = (m - 1) / (m + 1), |s| <= 3 - 2 sqrt 2, truncated after s^21
// (remainder below s^23 / 23 < 2^-60 relative); sin and cos of |phi| <= pi/4 by Taylor series to
// phi^17 and phi^16 (remainders below (pi/4)^18 / 18! < 2^-58).

// Written, like the float versions, so that a lane loop of them vectorises with AVX2 or AVX-512F
// alone: 64-bit integer conversions (AVX-512DQ) are avoided by exact tricks (an integer below 2^52 is
// read out of 2^52 + it, and words enter as int32 halves), which give the same values.

// log(x) for a positive normal double x.
BPCLIP_HD_INLINE double log_pos_f64(double x) {
  const uint64_t bits = double_bits(x);
  // the exponent field as a double: the low bits of 2^52 + field, read back exactly
  double e = bits_double((bits >> 52) | 0x4330000000000000ull) - (0x1p52 + 1022.0);
  double m = bits_double((bits & 0x000fffffffffffffull) | 0x3fe0000000000000ull);  // x = m 2^e, m in [0.5, 1)
  const double small = static_cast<double>(m < 0.70710678118654752440);
  e -= small;
  m = m + m * small;  // m in [sqrt(1/2), sqrt(2)): m - 1 is exact (Sterbenz)
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  double p = 1.0 / 21.0;
  p = p * s2 + 1.0 / 19.0;
  p = p * s2 + 1.0 / 17.0;
  p = p * s2 + 1.0 / 15.0;
  p = p * s2 + 1.0 / 13.0;
  p = p * s2 + 1.0 / 11.0;
  p = p * s2 + 1.0 / 9.0;
  p = p * s2 + 1.0 / 7.0;
  p = p * s2 + 1.0 / 5.0;
  p = p * s2 + 1.0 / 3.0;
  const double log_m = 2.0 * s + 2.0 * s * (s2 * p);
  // ln 2 split so that e ln2_hi is exact (ln2_hi has 14 significant bits, |e| < 2^11).
  return e * 0.693145751953125 + (log_m + e * 1.42860682030941723212e-6);
}

// (cos, sin) of 2 pi u for u in [0, 1), as cos_sin_2pi: 4u splits exactly into a quadrant and a
// remainder in [-1/2, 1/2].
// j = the integer nearest 4u: 4u is never a half-integer here (box_muller_f64's u), so rounding to
// nearest (2^52 + q, in which j is the low bits) is the float version's floor(q + 1/2).
BPCLIP_HD_INLINE void cos_sin_2pi_f64(double u, double* c_out, double* s_out) {
  const double q = u * 4.0;
  const double shifted = q + 0x1p52;
  const double j = shifted - 0x1p52;
  const double phi = (q - j) * 1.5707963267948966192;
  const double p2 = phi * phi;
  double s = -1.0 / 355687428096000.0;                       // -1/17!
  s = s * p2 + 1.0 / 1307674368000.0;                        // 1/15!
  s = s * p2 - 1.0 / 6227020800.0;                           // -1/13!
  s = s * p2 + 1.0 / 39916800.0;                             // 1/11!
  s = s * p2 - 1.0 / 362880.0;                               // -1/9!
  s = s * p2 + 1.0 / 5040.0;                                 // 1/7!
  s = s * p2 - 1.0 / 120.0;                                  // -1/5!
  s = s * p2 + 1.0 / 6.0;                                    // 1/3!
  s = phi - phi * p2 * s;
  double c = 1.0 / 20922789888000.0;                         // 1/16!
  c = c * p2 - 1.0 / 87178291200.0;                          // -1/14!
  c = c * p2 + 1.0 / 479001600.0;                            // 1/12!
  c = c * p2 - 1.0 / 3628800.0;                              // -1/10!
  c = c * p2 + 1.0 / 40320.0;                                // 1/8!
  c = c * p2 - 1.0 / 720.0;                                  // -1/6!
  c = c * p2 + 1.0 / 24.0;                                   // 1/4!
  c = 1.0 - 0.5 * p2 + p2 * p2 * c;
  const uint64_t quadrant = double_bits(shifted) & 3u;
  const bool swap = (quadrant & 1u) != 0u;
  const double base_c = swap ? s : c;
  const double base_s = swap ? c : s;
  *c_out = bits_double(double_bits(base_c) ^ (((quadrant + 1u) & 2u) << 62));
  *s_out = bits_double(double_bits(base_s) ^ ((quadrant & 2u) << 62));
}

// A 32-bit word as a double, exactly, through int32 conversions (its upper 31 bits, then its low bit).
BPCLIP_HD_INLINE double word_f64(uint32_t w) {
  return static_cast<double>(static_cast<int32_t>(w >> 1)) * 2.0 + static_cast<double>(static_cast<int32_t>(w & 1u));
}

// u1 = (hi 2^32 + lo + 1/2) 2^-64 rounded once to double: hi 2^-32 and (2 lo + 1) 2^-65 are exact.
BPCLIP_HD_INLINE double radius_uniform_f64(uint32_t hi, uint32_t lo) {
  return word_f64(hi) * 0x1p-32 + (word_f64(lo) * 0x1p-64 + 0x1p-65);
}

BPCLIP_HD_INLINE void box_muller_f64(uint32_t hi, uint32_t lo, uint32_t angle, uint32_t angle_lo, double* z0,
                                     double* z1) {
  const double u1 = radius_uniform_f64(hi, lo);
  // u2 = (2k + 1) 2^-53, k = (angle >> 9) 2^29 + (angle_lo >> 3): the two parts' bits do not overlap,
  // so their sum is exact
  const double u2 = static_cast<double>(static_cast<int32_t>(angle >> 9)) * 0x1p-23 +
                    static_cast<double>(static_cast<int32_t>(((angle_lo >> 3) << 1) | 1u)) * 0x1p-53;
  const double l = log_pos_f64(u1 < 1.0 ? u1 : 0x1.fffffffffffffp-1);
  const double r = sqrt(-2.0 * l > 0.0 ? -2.0 * l : 0.0);
  double c, s;
  cos_sin_2pi_f64(u2, &c, &s);
  *z0 = r * c;
  *z1 = r * s;
}

constexpr int kBlocksPerGroupF64 = 4;

// The float pairs' words, and block 3's word q as pair q's low angle bits.
BPCLIP_HD_INLINE void normals_of_group(const U4& b0, const U4& b1, const U4& b2, const U4& b3, double z[8]) {
  box_muller_f64(b0.x, b0.y, b2.x, b3.x, &z[0], &z[1]);
  box_muller_f64(b0.z, b0.w, b2.y, b3.y, &z[2], &z[3]);
  box_muller_f64(b1.x, b1.y, b2.z, b3.z, &z[4], &z[5]);
  box_muller_f64(b1.z, b1.w, b2.w, b3.w, &z[6], &z[7]);
}

// The eight float64 normals of group `group`; float64 buffers draw these (same element layout).
BPCLIP_HD inline void philox_normal8(uint64_t seed, uint64_t offset, uint64_t group, double z[8]) {
  normals_of_group(philox_block(seed, offset, group_block(group, 0)), philox_block(seed, offset, group_block(group, 1)),
                   philox_block(seed, offset, group_block(group, 2)), philox_block(seed, offset, group_block(group, 3)),
                   z);
}

// The normals' type for a buffer of T: double for double, float for every other dtype.
template <typename T>
struct NormalOf {
  using type = float;
};
template <>
struct NormalOf<double> {
  using type = double;
};
template <typename T>
using normal_t = typename NormalOf<T>::type;

}  // namespace bpclip
