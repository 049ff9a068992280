// Dependency-free check of csrc/include/bpclip_fast/philox.h (no torch, no test framework):
//   * Philox4x32-10 against the Random123 known-answer vectors (kat_vectors, "philox4x32 10"),
//   * philox_block's documented counter/key layout,
//   * Box-Muller normals: finite, inside the documented 6.8-sigma tail, plausible moments.
// Exit status 0 iff every check passed; prints "test_philox: N passed, M failed".
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "bpclip_fast/philox.h"

static int g_passed = 0, g_failed = 0;

static void check(bool ok, const char* what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    fprintf(stderr, "FAIL: %s\n", what);
  }
}

static bool eq(const bpclip::U4& a, const uint32_t b[4]) {
  return a.x == b[0] && a.y == b[1] && a.z == b[2] && a.w == b[3];
}

static void kat(const uint32_t ctr[4], const uint32_t key[2], const uint32_t expect[4], const char* name) {
  const bpclip::U4 out = bpclip::philox4x32_10(bpclip::U4{ctr[0], ctr[1], ctr[2], ctr[3]}, key[0], key[1]);
  if (!eq(out, expect)) {
    fprintf(stderr, "  %s: got %08x %08x %08x %08x, want %08x %08x %08x %08x\n", name, out.x, out.y, out.z,
            out.w, expect[0], expect[1], expect[2], expect[3]);
  }
  check(eq(out, expect), name);
}

int main() {
  // Random123 kat_vectors, Philox4x32-10.
  {
    const uint32_t c[4] = {0u, 0u, 0u, 0u}, k[2] = {0u, 0u};
    const uint32_t e[4] = {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u};
    kat(c, k, e, "KAT zero counter, zero key");
  }
  {
    const uint32_t c[4] = {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, k[2] = {0xffffffffu, 0xffffffffu};
    const uint32_t e[4] = {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu};
    kat(c, k, e, "KAT all-ones counter and key");
  }
  {
    const uint32_t c[4] = {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, k[2] = {0xa4093822u, 0x299f31d0u};
    const uint32_t e[4] = {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u};
    kat(c, k, e, "KAT pi digits");
  }

  // philox_block(seed, offset, block): counter = (lo(block), hi(block), lo(offset), hi(offset)),
  // key = (lo(seed), hi(seed)).
  {
    const uint64_t seed = 0x299f31d0a4093822ull, offset = 0x0370734413198a2eull, block = 0x85a308d3243f6a88ull;
    const uint32_t e[4] = {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u};
    check(eq(bpclip::philox_block(seed, offset, block), e), "philox_block counter/key layout");
  }

  // Box-Muller extremes: a = 0 gives the largest radius sqrt(2*33*ln 2) ~ 6.77; a = ~0 gives 0.
  {
    float z0, z1;
    bpclip::box_muller(0u, 0u, &z0, &z1);
    check(isfinite(z0) && isfinite(z1) && fabsf(z0 - sqrtf(66.0f * logf(2.0f))) < 1e-3f && fabsf(z1) < 1e-6f,
          "box_muller(0, 0) = (6.77, 0)");
    bpclip::box_muller(0xffffffffu, 0xffffffffu, &z0, &z1);
    check(isfinite(z0) && isfinite(z1) && fabsf(z0) <= 1e-3f && fabsf(z1) <= 1e-3f, "box_muller(~0, ~0) ~ 0");
  }

  // Moments of 2^22 normals from one stream (deterministic; tolerances are ~5 standard errors).
  {
    const uint64_t n_blocks = 1u << 20;
    double s1 = 0.0, s2 = 0.0, s4 = 0.0, max_abs = 0.0;
    bool finite = true;
    for (uint64_t b = 0; b < n_blocks; ++b) {
      float z[4];
      bpclip::philox_normal4(12345u, 7u, b, z);
      for (float v : z) {
        finite = finite && isfinite(v);
        const double d = v;
        s1 += d;
        s2 += d * d;
        s4 += d * d * d * d;
        if (fabs(d) > max_abs) max_abs = fabs(d);
      }
    }
    const double n = 4.0 * n_blocks, mean = s1 / n, var = s2 / n - mean * mean, kurt = s4 / n;
    printf("test_philox: %.0f normals: mean %.5f var %.5f E[z^4] %.4f max|z| %.3f\n", n, mean, var, kurt, max_abs);
    check(finite, "normals finite");
    check(fabs(mean) < 5.0 * sqrt(1.0 / n), "normal mean ~ 0");
    check(fabs(var - 1.0) < 5.0 * sqrt(2.0 / n), "normal variance ~ 1");
    check(fabs(kurt - 3.0) < 5.0 * sqrt(96.0 / n), "normal 4th moment ~ 3");
    check(max_abs < 6.8, "normals inside the 6.8-sigma tail");
  }

  printf("test_philox: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
