// Counter-based Philox4x32-10 (Salmon et al., SC'11) and the Box-Muller map to normals.
//
// One header for both backends, so that the CPU and CUDA noise kernels draw the same numbers for
// the same (seed, offset): element i of a buffer uses counter block i/4, lane i%4, with
//   counter = (lo(i/4), hi(i/4), lo(offset), hi(offset)),  key = (lo(seed), hi(seed)).
// The only difference between backends is the rounding of logf/sinf/cosf (a few ulp).
#pragma once

#include <stdint.h>

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

// Box-Muller on two 32-bit words. u1 = a*2^-32 + 2^-33 lies in (0, 1] and keeps full relative
// precision near 0 (float is exact there), so the tail reaches sqrt(2*33*ln2) = 6.8 sigma instead
// of the 5.8 sigma of a 24-bit uniform. u2 takes 24 bits: the angle needs no more.
BPCLIP_HD inline void box_muller(uint32_t a, uint32_t b, float* z0, float* z1) {
  const float kTwoPow32Inv = 2.3283064365386963e-10f;  // 2^-32
  const float kTwoPow33Inv = 1.1641532182693481e-10f;  // 2^-33
  const float kTwoPow24Inv = 5.9604644775390625e-08f;  // 2^-24
  const float kTwoPi = 6.2831853071795864769f;
  const float u1 = static_cast<float>(a) * kTwoPow32Inv + kTwoPow33Inv;
  const float u2 = static_cast<float>(b >> 8) * kTwoPow24Inv;
  const float r = sqrtf(-2.0f * logf(u1 < 1.0f ? u1 : 1.0f));
  const float theta = kTwoPi * u2;
  *z0 = r * cosf(theta);
  *z1 = r * sinf(theta);
}

// The four standard normals of counter block `block`.
BPCLIP_HD inline void philox_normal4(uint64_t seed, uint64_t offset, uint64_t block, float z[4]) {
  const U4 r = philox_block(seed, offset, block);
  box_muller(r.x, r.y, &z[0], &z[1]);
  box_muller(r.z, r.w, &z[2], &z[3]);
}

}  // namespace bpclip
