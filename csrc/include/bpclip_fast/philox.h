// Counter-based Philox4x32-10 (Salmon et al., SC'11) and the Box-Muller map to normals.
//
// One header for both backends, so that the CPU and CUDA noise kernels draw the same numbers for
// the same (seed, offset): element i of a buffer uses counter block i/4, lane i%4, with
//   counter = (lo(i/4), hi(i/4), lo(offset), hi(offset)),  key = (lo(seed), hi(seed)).
// The only difference between backends is the rounding of logf/sinf/cosf (a few ulp).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

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
BPCLIP_HD inline float log_pos(float x) {
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
BPCLIP_HD inline void cos_sin_2pi(float u, float* c_out, float* s_out) {
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

// Box-Muller on two 32-bit words. u1 = a*2^-32 + 2^-33 lies in (0, 1] and keeps full relative
// precision near 0 (float is exact there), so the tail reaches sqrt(2*33*ln2) = 6.8 sigma instead
// of the 5.8 sigma of a 24-bit uniform. u2 takes 24 bits: the angle needs no more.
BPCLIP_HD inline void box_muller(uint32_t a, uint32_t b, float* z0, float* z1) {
  const float kTwoPow32Inv = 2.3283064365386963e-10f;  // 2^-32
  const float kTwoPow33Inv = 1.1641532182693481e-10f;  // 2^-33
  const float kTwoPow24Inv = 5.9604644775390625e-08f;  // 2^-24
  // a >> 1 is exact in float's sign range; the dropped bit is below float's precision near 1 and
  // restored exactly near 0, where u1 is small and precision matters.
  const float u1 = static_cast<float>(static_cast<int32_t>(a >> 1)) * (2.0f * kTwoPow32Inv) +
                   static_cast<float>(a & 1u) * kTwoPow32Inv + kTwoPow33Inv;
  const float u2 = static_cast<float>(static_cast<int32_t>(b >> 8)) * kTwoPow24Inv;
  const float l = log_pos(u1 < 1.0f ? u1 : 1.0f);
  const float r = sqrtf(-2.0f * l > 0.0f ? -2.0f * l : 0.0f);
  float c, s;
  cos_sin_2pi(u2, &c, &s);
  *z0 = r * c;
  *z1 = r * s;
}

// The four standard normals of counter block `block`.
BPCLIP_HD inline void philox_normal4(uint64_t seed, uint64_t offset, uint64_t block, float z[4]) {
  const U4 r = philox_block(seed, offset, block);
  box_muller(r.x, r.y, &z[0], &z[1]);
  box_muller(r.z, r.w, &z[2], &z[3]);
}

}  // namespace bpclip
