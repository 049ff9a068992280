// Bit-exact IEEE conversions between float and the 16-bit formats, for the emulator's
// cuda_fp16.h / cuda_bf16.h. Checked against torch's conversions by tests/test_emulator.py.
#pragma once

#include <stdint.h>
#include <string.h>

#include "../simt.h"

namespace simt {

inline uint32_t f32_bits(float f) { return bit_cast<uint32_t>(f); }
inline float bits_f32(uint32_t u) { return bit_cast<float>(u); }

// Shift right by s (1..31) rounding to nearest even (rz = false) or toward zero (rz = true).
inline uint32_t shift_round(uint32_t v, int s, bool rz) {
  const uint32_t q = v >> s, rem = v & ((1u << s) - 1u), half = 1u << (s - 1);
  if (rz) return q;
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

inline uint16_t f32_to_f16_bits(float f, bool rz) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return 0x7fffu;  // NaN: CUDA's canonical half NaN
  if (ax == 0x7f800000u) return sign | 0x7c00u;
  const int e = static_cast<int>(ax >> 23);  // biased float exponent
  const uint32_t m = (ax & 0x7fffffu) | (e ? 0x800000u : 0u);
  if (e >= 113) {  // a normal half, or overflow
    // Keep 10 mantissa bits: drop 13, adding the rounding carry into the exponent field.
    const uint32_t h = shift_round(((static_cast<uint32_t>(e - 112)) << 23) | (ax & 0x7fffffu), 13, rz);
    if (h >= 0x7c00u) return sign | (rz ? 0x7bffu : 0x7c00u);  // rz saturates at the largest finite
    return sign | static_cast<uint16_t>(h);
  }
  // A half subnormal (or zero): value = m * 2^(e-150) in units of 2^-24 is m >> (126 - e).
  const int s = 126 - (e ? e : 1);
  if (s >= 32) return sign;
  return sign | static_cast<uint16_t>(shift_round(m, s, rz));
}

inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return bits_f32(sign | 0x7f800000u | (m << 13));
  if (e != 0) return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
  // Subnormal: m * 2^-24, exact in float.
  const float v = static_cast<float>(m) * bits_f32(0x33800000u);
  return sign ? -v : v;
}

inline uint16_t f32_to_bf16_bits(float f, bool rz) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN: CUDA's canonical bf16 NaN
  if (rz) return static_cast<uint16_t>(x >> 16);
  // Round to nearest even on the low 16 bits; a carry moves into the exponent (and to inf).
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bf16_bits_to_f32(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

}  // namespace simt
