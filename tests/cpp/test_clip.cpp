// The shared clip-factor and clipping-Jacobian functions (bpclip_fast/clip.h), checked against
// closed forms and a finite-difference Jacobian in double precision.
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <limits>

#include "bpclip_fast/clip.h"

static int passed = 0, failed = 0;

static void check(bool ok, const char* what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAILED: %s\n", what);
  }
}

static bool near(double a, double b, double tol) { return std::fabs(a - b) <= tol * (1.0 + std::fabs(b)); }

// Exact VJP of x -> x * s(x) by central differences, for a 3-vector.
static void fd_vjp(const double x[3], const double g[3], double bound, int fn, double gamma, double out[3]) {
  auto map = [&](const double* v, double* y) {
    const double n = std::sqrt(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
    const double s = bpclip::clip_factor<double>(n, bound, fn, gamma);
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

int main() {
  using bpclip::clip_factor;
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();

  check(clip_factor<double>(0.5, 1.0, bpclip::kClip, 0.01) == 1.0, "clip under the bound is 1");
  check(near(clip_factor<double>(4.0, 1.0, bpclip::kClip, 0.01), 0.25, 1e-15), "clip over the bound is C/n");
  check(clip_factor<double>(1.0, 1.0, bpclip::kGlobal, 0.01) == 1.0, "global keeps n == C");
  check(clip_factor<double>(1.0000001, 1.0, bpclip::kGlobal, 0.01) == 0.0, "global drops n > C");
  check(near(clip_factor<double>(3.0, 2.0, bpclip::kNormalize, 0.5), 2.0 / 3.5, 1e-15), "normalize is C/(n+gamma)");
  for (int fn = 0; fn < 3; ++fn) {
    check(clip_factor<double>(nan, 1.0, fn, 0.01) == 0.0, "NaN norm gives factor 0");
    check(clip_factor<double>(inf, 1.0, fn, 0.01) == 0.0, "Inf norm gives factor 0");
    check(clip_factor<float>(std::numeric_limits<float>::infinity(), 1.0f, fn, 0.01f) == 0.0f, "float Inf gives 0");
    // Every clip function keeps the clipped norm within the bound.
    for (double n : {1e-8, 0.3, 1.0, 2.0, 1e6, 1e300}) {
      check(n * clip_factor<double>(n, 1.5, fn, 0.01) <= 1.5 * (1 + 1e-15), "clipped norm <= bound");
    }
  }

  // s g - kappa (xc . g) xc equals the finite-difference VJP, over and under the bound.
  const double xs[3][3] = {{3.0, -1.0, 2.0}, {0.1, 0.2, -0.1}, {1e3, 1.0, -2.0}};
  const double g[3] = {0.7, -1.3, 0.4};
  for (int fn = 0; fn < 3; ++fn) {
    for (const auto& x : xs) {
      const double bound = 1.2, gamma = 0.05;
      const double n = std::sqrt(x[0] * x[0] + x[1] * x[1] + x[2] * x[2]);
      const double s = clip_factor<double>(n, bound, fn, gamma);
      const double kappa = bpclip::clip_jvp_kappa<double>(n, s, bound, fn);
      double xc[3], dot = 0;
      for (int i = 0; i < 3; ++i) {
        xc[i] = x[i] * s;
        dot += xc[i] * g[i];
      }
      double fd[3];
      fd_vjp(x, g, bound, fn, gamma, fd);
      bool ok = true;
      for (int i = 0; i < 3; ++i) ok = ok && near(s * g[i] - kappa * dot * xc[i], fd[i], 1e-6);
      check(ok, "clipping VJP matches finite differences");
    }
  }
  std::printf("test_clip: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
