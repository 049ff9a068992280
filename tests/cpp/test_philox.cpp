// Dependency-free check of csrc/include/bpclip_fast/philox.h (no torch, no test framework):
//   * Philox4x32-10 against the Random123 known-answer vectors (kat_vectors, "philox4x32 10"),
//   * philox_block's documented counter/key layout,
//   * the radius uniform and the Box-Muller extremes (the largest |z|, sqrt(130 ln 2) = 9.4926),
//   * the group layout (8 normals from the blocks g, g + 2^62, g + 2^63), plausible moments.
// Exit status 0 iff every check passed; prints "test_philox: N passed, M failed".
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include <initializer_list>

#include "bpclip_fast/philox.h"

#include "checks.h"

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

  // The radius uniform: (hi 2^32 + lo + 1/2) 2^-64, exactly 2^-65 at the bottom, full relative
  // precision near 0, and monotone across the word boundary.
  {
    check(bpclip::radius_uniform(0u, 0u) == 0x1p-65f, "radius_uniform(0, 0) = 2^-65");
    check(bpclip::radius_uniform(0u, 1u) == 1.5f * 0x1p-64f, "radius_uniform(0, 1) = 1.5 2^-64");
    check(bpclip::radius_uniform(0u, 0xffffffffu) == 0x1p-32f, "radius_uniform(0, ~0) = 2^-32 (rounded)");
    check(bpclip::radius_uniform(1u, 0u) == 0x1p-32f, "radius_uniform(1, 0) = 2^-32 (rounded)");
    check(bpclip::radius_uniform(0xffffffffu, 0xffffffffu) == 1.0f, "radius_uniform(~0, ~0) rounds to 1");
    bool close = true;
    for (uint32_t lo : {1u, 7u, 12345u, 0x80000000u, 0xfffffffeu}) {
      const double exact = (static_cast<double>(lo) + 0.5) * 0x1p-64;
      close = close && fabs(bpclip::radius_uniform(0u, lo) - exact) <= 0x1p-23 * exact;
    }
    check(close, "radius_uniform keeps full relative precision near 0");
  }

  // Box-Muller extremes: radius words 0 give the largest radius sqrt(2 ln 2^65) = sqrt(130 ln 2)
  // = 9.4926 (angle word 0, the first cell's midpoint 2^-24 of a turn: almost all of it on z0, and
  // z1 = 9.4926 sin(2 pi 2^-24), never exactly 0); radius words ~0 give the smallest radius, 3.45e-4.
  {
    float z0, z1;
    bpclip::box_muller(0u, 0u, 0u, &z0, &z1);
    const double z1_want = sqrt(130.0 * log(2.0)) * sin(2.0 * 3.14159265358979323846 * 0x1p-24);
    check(isfinite(z0) && isfinite(z1) && fabs(z0 - sqrt(130.0 * log(2.0))) < 1e-5 && z1 != 0.0f &&
              fabs(z1 - z1_want) < 1e-6 * z1_want,
          "box_muller(0, 0 | 0) = (9.4926, 9.4926 sin(2 pi 2^-24))");
    printf("test_philox: largest |z| = %.6f (sqrt(130 ln 2) = %.6f)\n", z0, sqrt(130.0 * log(2.0)));
    bpclip::box_muller(0u, 0u, 0x40000000u, &z0, &z1);  // angle 1/4 turn: all of it on z1
    check(fabsf(z0) < 1e-5f && z0 != 0.0f && fabs(z1 - sqrt(130.0 * log(2.0))) < 1e-5,
          "box_muller(0, 0 | 1/4) = (~0 but not 0, 9.4926)");
    bpclip::box_muller(0xffffffffu, 0xffffffffu, 0xffffffffu, &z0, &z1);
    check(isfinite(z0) && isfinite(z1) && fabsf(z0) <= 1e-3f && fabsf(z1) <= 1e-3f && (z0 != 0.0f || z1 != 0.0f),
          "box_muller(~0, ~0 | ~0) ~ 0, never both 0");
  }

  // The group layout: group g uses blocks g, g + 2^62, g + 2^63 and the documented pairing.
  {
    const uint64_t seed = 0x0123456789abcdefull, offset = 77, g = 0x1234567890ull;
    const bpclip::U4 b0 = bpclip::philox_block(seed, offset, g), b1 = bpclip::philox_block(seed, offset, g + (1ull << 62)),
                     b2 = bpclip::philox_block(seed, offset, g + (2ull << 62));
    float z[8], e[8];
    bpclip::philox_normal8(seed, offset, g, z);
    bpclip::box_muller(b0.x, b0.y, b2.x, &e[0], &e[1]);
    bpclip::box_muller(b0.z, b0.w, b2.y, &e[2], &e[3]);
    bpclip::box_muller(b1.x, b1.y, b2.z, &e[4], &e[5]);
    bpclip::box_muller(b1.z, b1.w, b2.w, &e[6], &e[7]);
    bool same = true;
    for (int i = 0; i < 8; ++i) same = same && z[i] == e[i];
    check(same, "philox_normal8 layout");
  }

  // Moments of 2^22 normals from one stream (deterministic; tolerances are ~5 standard errors).
  {
    const uint64_t n_groups = 1u << 19;
    double s1 = 0.0, s2 = 0.0, s4 = 0.0, max_abs = 0.0;
    bool finite = true;
    for (uint64_t g = 0; g < n_groups; ++g) {
      float z[8];
      bpclip::philox_normal8(12345u, 7u, g, z);
      for (float v : z) {
        finite = finite && isfinite(v);
        const double d = v;
        s1 += d;
        s2 += d * d;
        s4 += d * d * d * d;
        if (fabs(d) > max_abs) max_abs = fabs(d);
      }
    }
    const double n = 8.0 * n_groups, mean = s1 / n, var = s2 / n - mean * mean, kurt = s4 / n;
    printf("test_philox: %.0f normals: mean %.5f var %.5f E[z^4] %.4f max|z| %.3f\n", n, mean, var, kurt, max_abs);
    check(finite, "normals finite");
    check(fabs(mean) < 5.0 * sqrt(1.0 / n), "normal mean ~ 0");
    check(fabs(var - 1.0) < 5.0 * sqrt(2.0 / n), "normal variance ~ 1");
    check(fabs(kurt - 3.0) < 5.0 * sqrt(96.0 / n), "normal 4th moment ~ 3");
    check(max_abs < 6.8, "2^22 normals stay inside 6.8 sigma (probability of leaving ~4e-5)");
  }

  // The float64 draw (float64 buffers): blocks g, g + 2^62, g + 2^63 as the float one plus g + 3 2^62,
  // whose words give the angles 29 more bits; each normal is the float draw's, refined: the same
  // radius word and angle cell, so |z64 - z32| <= r (pi 2^-23 + 2^-21) (the half cell, float rounding
  // of the trig and product) + |r64 - r32|, where the float u1 carries up to three roundings and its
  // log one (delta r^2 <= 2^-21) and r32 >= 3.45e-4 (the float clamp), so
  // |r64 - r32| <= 2^-21 / (r32 + r64) <= 2^-21 / max(r64, 3.4e-4); the moments of 2^22 of them; and
  // the extremes (the same tail; the clamped top radius 2^-26, never 0).
  {
    const uint64_t seed = 0x0123456789abcdefull, offset = 77, g = 0x1234567890ull;
    bpclip::U4 b[4];
    for (int j = 0; j < 4; ++j) b[j] = bpclip::philox_block(seed, offset, g + (static_cast<uint64_t>(j) << 62));
    double z[8], e[8];
    bpclip::philox_normal8(seed, offset, g, z);
    bpclip::box_muller_f64(b[0].x, b[0].y, b[2].x, b[3].x, &e[0], &e[1]);
    bpclip::box_muller_f64(b[0].z, b[0].w, b[2].y, b[3].y, &e[2], &e[3]);
    bpclip::box_muller_f64(b[1].x, b[1].y, b[2].z, b[3].z, &e[4], &e[5]);
    bpclip::box_muller_f64(b[1].z, b[1].w, b[2].w, b[3].w, &e[6], &e[7]);
    bool same = true;
    for (int i = 0; i < 8; ++i) same = same && z[i] == e[i];
    check(same, "philox_normal8 (double) layout");
    const uint64_t n_groups = 1u << 19;
    double s1 = 0.0, s2 = 0.0, s4 = 0.0, max_gap = 0.0, worst = 0.0;  // worst: gap / its bound
    for (uint64_t q = 0; q < n_groups; ++q) {
      double d[8];
      float f[8];
      bpclip::philox_normal8(12345u, 7u, q, d);
      bpclip::philox_normal8(12345u, 7u, q, f);
      for (int i = 0; i < 8; ++i) {
        s1 += d[i];
        s2 += d[i] * d[i];
        s4 += d[i] * d[i] * d[i] * d[i];
        const double r = hypot(d[i & ~1], d[i | 1]);
        const double gap = fabs(d[i] - f[i]);
        const double bound = r * (3.14159265358979323846 * 0x1p-23 + 0x1p-21) + 0x1p-21 / fmax(r, 3.4e-4);
        if (gap > max_gap) max_gap = gap;
        if (gap / bound > worst) worst = gap / bound;
      }
    }
    const double n = 8.0 * n_groups, mean = s1 / n, var = s2 / n - mean * mean, kurt = s4 / n;
    printf("test_philox: %.0f float64 normals: mean %.5f var %.5f E[z^4] %.4f max|z64 - z32| %.3g\n", n, mean, var,
           kurt, max_gap);
    check(fabs(mean) < 5.0 * sqrt(1.0 / n), "float64 normal mean ~ 0");
    check(fabs(var - 1.0) < 5.0 * sqrt(2.0 / n), "float64 normal variance ~ 1");
    check(fabs(kurt - 3.0) < 5.0 * sqrt(96.0 / n), "float64 normal 4th moment ~ 3");
    printf("test_philox: max |z64 - z32| / its bound %.3f\n", worst);
    check(worst <= 1.0, "the float64 draw refines the float draw (same radius word, same angle cell)");
    double z0, z1;
    bpclip::box_muller_f64(0u, 0u, 0u, 0u, &z0, &z1);
    check(fabs(z0 - sqrt(130.0 * log(2.0))) < 1e-13 && z1 != 0.0, "box_muller_f64(0, 0 | 0, 0): the tail, z1 != 0");
    bpclip::box_muller_f64(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, &z0, &z1);
    check(fabs(hypot(z0, z1) - 0x1p-26) < 1e-12 * 0x1p-26 && z0 != 0.0 && z1 != 0.0,
          "box_muller_f64(~0, ~0 | ~0, ~0): radius 2^-26, never 0");
  }

  return report("test_philox");
}
