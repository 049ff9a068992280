// The shared clip-factor, clipping-Jacobian and rounding functions (bpclip_fast/clip.h), checked
// against closed forms, a finite-difference Jacobian in double precision and hand-made roundings.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>

#include "bpclip_fast/clip.h"

#include "checks.h"

static bool near(double a, double b, double tol) { return std::fabs(a - b) <= tol * (1.0 + std::fabs(b)); }

// Exact VJP of x -> x * s(x) by central differences, for a 3-vector (bound_eff: the bound the
// kernels apply).
static void fd_vjp(const double x[3], const double g[3], double bound_eff, int fn, double gamma, double out[3]) {
  auto map = [&](const double* v, double* y) {
    const double n = std::sqrt(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
    const double s = bpclip::clip_factor(n, bound_eff, fn, gamma);
    for (int i = 0; i < 3; ++i) y[i] = v[i] * s;
  };
  const double h = 1e-6;
  for (int j = 0; j < 3; ++j) {
    double xp[3] = {x[0], x[1], x[2]}, xm[3] = {x[0], x[1], x[2]}, yp[3], ym[3];
    xp[j] += h;
    xm[j] -= h;
    map(xp, yp);
    map(xm, ym);
    out[j] = 0;
    for (int i = 0; i < 3; ++i) out[j] += g[i] * (yp[i] - ym[i]) / (2 * h);
  }
}

static uint32_t fbits(float f) { return bpclip::float_bits(f); }

int main() {
  using bpclip::clip_factor;
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();

  check(clip_factor(0.5, 1.0, bpclip::kClip, 0.01) == 1.0, "clip under the bound is 1");
  check(near(clip_factor(4.0, 1.0, bpclip::kClip, 0.01), 0.25, 1e-15), "clip over the bound is C/n");
  check(clip_factor(1.0, 1.0, bpclip::kGlobal, 0.01) == 1.0, "global keeps n == C");
  check(clip_factor(1.0000001, 1.0, bpclip::kGlobal, 0.01) == 0.0, "global drops n > C");
  check(near(clip_factor(3.0, 2.0, bpclip::kNormalize, 0.5), 2.0 / 3.5, 1e-15), "normalize is C/(n+gamma)");
  for (int fn = 0; fn < 3; ++fn) {
    check(clip_factor(nan, 1.0, fn, 0.01) == 0.0, "NaN norm gives factor 0");
    check(clip_factor(inf, 1.0, fn, 0.01) == 0.0, "Inf norm gives factor 0");
    // Every clip function keeps the clipped norm within the bound.
    for (double n : {1e-8, 0.3, 1.0, 2.0, 1e6, 1e300}) {
      check(n * clip_factor(n, 1.5, fn, 0.01) <= 1.5 * (1 + 1e-15), "clipped norm <= bound");
    }
  }

  // The effective bound: eta_N is the smallest power of two >= (N + 4) 2^-53.
  check(bpclip::bound_shrink(0) == 0x1p-51, "eta_0 = 2^-51");
  check(bpclip::bound_shrink(4) == 0x1p-50, "eta_4 = 2^-50");
  check(bpclip::bound_shrink(5) == 0x1p-49, "eta_5 = 2^-49");
  check(bpclip::bound_shrink((int64_t{1} << 31) - 5) == 0x1p-22, "eta_{2^31-5} = 2^-22");
  check(bpclip::bound_shrink((int64_t{1} << 31) - 1) == 0x1p-21, "eta_{2^31-1} = 2^-21");
  check(bpclip::effective_bound(3.0, 1000) == 3.0 * (1.0 - 0x1p-43), "C' = C (1 - eta_N)");

  // s g - c xc, c = clip_jvp_coef(...), equals the finite-difference VJP, over and under the bound.
  const double xs[3][3] = {{3.0, -1.0, 2.0}, {0.1, 0.2, -0.1}, {1e3, 1.0, -2.0}};
  const double g[3] = {0.7, -1.3, 0.4};
  for (int fn = 0; fn < 3; ++fn) {
    for (const auto& x : xs) {
      const double bound = 1.2, gamma = 0.05;
      const double n = std::sqrt(x[0] * x[0] + x[1] * x[1] + x[2] * x[2]);
      const double s = clip_factor(n, bound, fn, gamma);
      double xc[3], dot = 0, sq = 0;
      for (int i = 0; i < 3; ++i) {
        xc[i] = x[i] * s;
        dot += xc[i] * g[i];
        sq += xc[i] * xc[i];
      }
      const double c = bpclip::clip_jvp_coef(n, s, bound, fn, dot, sq);
      double fd[3];
      fd_vjp(x, g, bound, fn, gamma, fd);
      bool ok = true;
      for (int i = 0; i < 3; ++i) ok = ok && near(s * g[i] - c * xc[i], fd[i], 1e-6);
      check(ok, "clipping VJP matches finite differences");
      // A stored norm that overflowed fp32 storage (Inf) is recovered from the factor.
      if (fn != bpclip::kGlobal && s > 0) {
        const double c_inf = bpclip::clip_jvp_coef(inf, s, bound, fn, dot, sq);
        check(fn == bpclip::kNormalize || n <= bound ? true : near(c_inf, c, 1e-12), "Inf norm: clip coefficient");
      }
    }
  }
  // Clip: a gradient along the clipped input is annihilated exactly, however xc was rounded.
  {
    const double x[3] = {3.0, -1.0, 2.0};
    const double n = std::sqrt(14.0), s = clip_factor(n, 1.2, bpclip::kClip, 0.0);
    double xc[3], sq = 0, dot = 0;
    for (int i = 0; i < 3; ++i) {
      xc[i] = static_cast<double>(bpclip::f64_to_f32_rz(x[i] * s));
      sq += xc[i] * xc[i];
    }
    for (int i = 0; i < 3; ++i) dot += xc[i] * xc[i];
    const double c = bpclip::clip_jvp_coef(n, s, 1.2, bpclip::kClip, dot, sq);
    bool ok = true;
    for (int i = 0; i < 3; ++i) ok = ok && std::fabs(s * xc[i] - c * xc[i]) <= 1e-16;
    check(ok, "clip VJP annihilates the radial direction");
  }

  // Rounding toward zero.
  const float fmax = std::numeric_limits<float>::max();
  const float tiny = std::numeric_limits<float>::denorm_min();
  check(bpclip::f64_to_f32_rz(1.0 + 0x1p-30) == 1.0f, "RZ f32: 1 + 2^-30 -> 1");
  check(bpclip::f64_to_f32_rz(1.0 - 0x1p-30) == 1.0f - 0x1p-24f, "RZ f32: 1 - 2^-30 -> 1 - 2^-24");
  check(bpclip::f64_to_f32_rz(-(1.0 - 0x1p-30)) == -(1.0f - 0x1p-24f), "RZ f32: negative");
  check(bpclip::f64_to_f32_rz(1e39) == fmax, "RZ f32: overflow saturates");
  check(bpclip::f64_to_f32_rz(0x1p-149 * 1.9) == tiny, "RZ f32: subnormal truncates");
  check(bpclip::f64_to_f32_rz(0x1p-149 * 0.9) == 0.0f, "RZ f32: below the smallest subnormal -> 0");
  check(bpclip::f64_to_f32_rz(inf) == std::numeric_limits<float>::infinity(), "RZ f32: Inf stays");
  check(bpclip::f32_to_bf16_bits_rz(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f80, "RZ bf16 truncates above a midpoint");
  check(bpclip::f32_to_bf16_bits_rz(-fmax) == 0xff7f, "RZ bf16: -FLT_MAX -> -max bf16");
  check(bpclip::f32_to_f16_bits_rz(65519.0f) == 0x7bff, "RZ f16: 65519 -> 65504");
  check(bpclip::f32_to_f16_bits_rz(1e10f) == 0x7bff, "RZ f16: overflow saturates");
  check(bpclip::f32_to_f16_bits_rz(-1e10f) == 0xfbff, "RZ f16: negative overflow saturates");
  check(bpclip::f32_to_f16_bits_rz(1.0f + 0x1p-11f + 0x1p-20f) == 0x3c00, "RZ f16 truncates above a midpoint");
  check(bpclip::f32_to_f16_bits_rz(0x1p-24f * 1.99f) == 0x0001, "RZ f16: smallest subnormal");
  check(bpclip::f32_to_f16_bits_rz(0x1p-14f * 0.99f) == 0x03f5, "RZ f16: largest subnormals");
  check(bpclip::f32_to_f16_bits_rz(0x1p-25f) == 0x0000, "RZ f16: below the smallest subnormal -> 0");
  check(bpclip::f32_to_f16_bits_rz(0x1p-14f) == 0x0400, "RZ f16: smallest normal");
  check(bpclip::f32_to_f16_bits_rz(std::numeric_limits<float>::infinity()) == 0x7c00, "RZ f16: Inf stays");
  check((bpclip::f32_to_f16_bits_rz(std::numeric_limits<float>::quiet_NaN()) & 0x7fff) > 0x7c00, "RZ f16: NaN");
  check(fbits(bpclip::scale_rz_f32(0.1f, 3.0f)) == fbits(bpclip::f64_to_f32_rz(double(0.1f) * 3.0)), "scale f32");
  // fp64: RZ of the exact product, also where the residual underflows.
  check(bpclip::scale_rz_f64(1.0 / 3.0, 3.0) <= 1.0, "RZ f64: (1/3) * 3 <= 1");
  check(bpclip::scale_rz_f64(1.0 + 0x1p-52, 1.0 + 0x1p-52) == 1.0 + 0x1p-51, "RZ f64 drops 2^-104");
  check(bpclip::scale_rz_f64(1.0 - 0x1p-53, 1.0 - 0x1p-53) == 1.0 - 0x1p-52, "RZ f64 (1-2^-53)^2");
  check(bpclip::scale_rz_f64(-(1.0 - 0x1p-53), 1.0 - 0x1p-53) == -(1.0 - 0x1p-52), "RZ f64 negative");
  check(bpclip::scale_rz_f64(0.75, 0x1p-1074) == 0.0, "RZ f64: 0.75 * min subnormal -> 0");
  check(bpclip::scale_rz_f64(1.5, 0x1p-1074) == 0x1p-1074, "RZ f64: 1.5 * min subnormal -> min subnormal");
  check(bpclip::scale_rz_f64(1.0 - 0x1p-53, 0x1p-1060) == 0x1p-1060 - 0x1p-1074, "RZ f64: subnormal product");

  return report("test_clip");
}
