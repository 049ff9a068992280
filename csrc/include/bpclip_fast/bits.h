// Bit casts shared by the CPU and CUDA backends (and the test emulator): memcpy, which is defined
// behaviour everywhere and compiles to a register move.
#pragma once

#include <stdint.h>
#include <string.h>

#include "bpclip_fast/macros.h"

namespace bpclip {

BPCLIP_HD inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

BPCLIP_HD inline float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

BPCLIP_HD inline uint64_t double_bits(double d) {
  uint64_t u;
  memcpy(&u, &d, sizeof u);
  return u;
}

BPCLIP_HD inline double bits_double(uint64_t u) {
  double d;
  memcpy(&d, &u, sizeof d);
  return d;
}

}  // namespace bpclip
