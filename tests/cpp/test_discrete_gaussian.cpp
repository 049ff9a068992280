// Dependency-free check of csrc/include/bpclip_fast/discrete_gaussian.h (no torch):
//   * mul_64x64 against the compiler's 128-bit product,
//   * the stream's documented counter and key layout,
//   * uniform_below, bernoulli_exp_frac and bernoulli_exp_square against their exact probabilities,
//   * the discrete Gaussian's pmf by a chi-square test, and its variance at large s.
// The draws are integer-only and keyed by fixed seeds, so every number here is the same on every
// machine. The statistical thresholds are 6 standard errors (binomial) and a chi-square bound of
// k + 6 sqrt(2k): a correct sampler exceeds them with probability below 1e-6 per check, and a
// fixed stream either does or does not, the same everywhere.
// Exit status 0 iff every check passed; prints "test_discrete_gaussian: N passed, M failed" and the
// draw's cost (not checked).
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include <chrono>
#include <vector>

#include "bpclip_fast/discrete_gaussian.h"

#include "checks.h"

// A binomial frequency within 6 standard errors of p.
static void check_frequency(int64_t hits, int64_t n, double p, const char* what) {
  const double se = sqrt(p * (1 - p) / static_cast<double>(n));
  const double f = static_cast<double>(hits) / static_cast<double>(n);
  if (fabs(f - p) > 6 * se + 1e-15) fprintf(stderr, "  %s: frequency %.8f, want %.8f (se %.2g)\n", what, f, p, se);
  check(fabs(f - p) <= 6 * se + 1e-15, what);
}

// The frequency of trial(stream) over 2·10^6 elements' own streams (keyed by seed and offset)
// within 6 standard errors of p.
template <typename Trial>
static void bernoulli_frequency(uint64_t seed, uint64_t offset, Trial trial, double p, const char* what) {
  const int64_t n = 2000000;
  int64_t hits = 0;
  for (int64_t i = 0; i < n; ++i) {
    bpclip::DgStream st = bpclip::dg_stream(seed, offset, static_cast<uint64_t>(i), bpclip::kDgTagNoise);
    hits += trial(st) ? 1 : 0;
  }
  check_frequency(hits, n, p, what);
}

static uint64_t splitmix(uint64_t* x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The pmf of N_Z(0, s^2) on [-w, w], normalised over a range whose outside mass is below 1e-300.
static std::vector<double> pmf(double s, int64_t w) {
  const int64_t far = static_cast<int64_t>(40 * s) + 40;
  double z = 0;
  for (int64_t y = -far; y <= far; ++y) z += exp(-static_cast<double>(y) * y / (2 * s * s));
  std::vector<double> p(2 * w + 1);
  for (int64_t y = -w; y <= w; ++y) p[y + w] = exp(-static_cast<double>(y) * y / (2 * s * s)) / z;
  return p;
}

static void chi_square_pmf(uint64_t s, int64_t n, uint64_t seed) {
  const int64_t w = static_cast<int64_t>(6 * s) + 2;
  const std::vector<double> p = pmf(static_cast<double>(s), w);
  std::vector<int64_t> count(2 * w + 1, 0);
  int64_t outside = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t y = bpclip::discrete_gaussian(seed, 7, static_cast<uint64_t>(i), s);
    if (y < -w || y > w) {
      ++outside;
    } else {
      ++count[y + w];
    }
  }
  // Bins with an expected count of at least 20 each; the rest pooled into one bin.
  double chi = 0, pooled_p = 0;
  int64_t pooled = outside, bins = 0;
  double inside_p = 0;
  for (int64_t k = 0; k <= 2 * w; ++k) {
    inside_p += p[k];
    if (p[k] * n >= 20) {
      const double e = p[k] * n;
      chi += (count[k] - e) * (count[k] - e) / e;
      ++bins;
    } else {
      pooled_p += p[k];
      pooled += count[k];
    }
  }
  pooled_p += 1 - inside_p;
  if (pooled_p * n >= 1) {
    const double e = pooled_p * n;
    chi += (pooled - e) * (pooled - e) / e;
    ++bins;
  } else {
    check(pooled == 0 || pooled_p * n > 1e-6, "no draws where the pmf has no mass");
  }
  const double dof = static_cast<double>(bins - 1);
  char what[128];
  snprintf(what, sizeof what, "chi-square of N_Z(0, %llu^2): %.1f on %.0f dof", static_cast<unsigned long long>(s),
           chi, dof);
  if (chi > dof + 6 * sqrt(2 * dof)) fprintf(stderr, "  %s\n", what);
  check(chi <= dof + 6 * sqrt(2 * dof), what);
}

int main() {
  using namespace bpclip;
  // mul_64x64 against unsigned __int128.
  {
    uint64_t x = 1;
    bool ok = true;
    const uint64_t edges[] = {0, 1, 2, 0xffffffffull, 0x100000000ull, 0xffffffffffffffffull, 0x8000000000000000ull};
    for (uint64_t a : edges)
      for (uint64_t b : edges) {
        uint64_t hi, lo;
        mul_64x64(a, b, &hi, &lo);
        const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
        ok = ok && hi == static_cast<uint64_t>(p >> 64) && lo == static_cast<uint64_t>(p);
      }
    for (int i = 0; i < 1000000; ++i) {
      const uint64_t a = splitmix(&x), b = splitmix(&x) >> (i % 64);
      uint64_t hi, lo;
      mul_64x64(a, b, &hi, &lo);
      const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
      ok = ok && hi == static_cast<uint64_t>(p >> 64) && lo == static_cast<uint64_t>(p);
    }
    check(ok, "mul_64x64 == the 128-bit product");
  }
  // The stream: block j of element i at (seed, offset, tag).
  {
    const uint64_t seed = 0x0123456789abcdefull, offset = 0xfedcba9876543210ull, elem = 0x00ab00cd12345678ull;
    DgStream st = dg_stream(seed, offset, elem, kDgTagNoise);
    uint32_t got[8];
    for (uint32_t& g : got) g = dg_word32(st);
    const uint32_t k0 = static_cast<uint32_t>(seed) ^ ((1u << 24) | 0xabu << 16 | 0xcdu);
    const U4 b0 = philox4x32_10(U4{0u, 0x12345678u, 0x76543210u, 0xfedcba98u}, k0, 0x01234567u);
    const U4 b1 = philox4x32_10(U4{1u, 0x12345678u, 0x76543210u, 0xfedcba98u}, k0, 0x01234567u);
    check(got[0] == b0.x && got[1] == b0.y && got[2] == b0.z && got[3] == b0.w && got[4] == b1.x &&
              got[7] == b1.w,
          "stream: block j = (j, lo(i), lo(offset), hi(offset)) under (lo(seed) ^ tag<<24 ^ i>>32, hi(seed))");
    DgStream st2 = dg_stream(seed, offset, elem, kDgTagNoise);
    check(dg_word64(st2) == (static_cast<uint64_t>(b0.x) << 32 | b0.y), "a 64-bit word is first << 32 | second");
  }
  // uniform_below(m): each value's frequency, for small m, and the top bit's for m near 2^53.
  {
    const uint64_t ms[] = {1, 2, 3, 7, 10};
    for (uint64_t m : ms) {
      const int64_t n = 1000000;
      std::vector<int64_t> count(m, 0);
      bool in_range = true;
      for (int64_t i = 0; i < n; ++i) {
        DgStream st = dg_stream(11, m, static_cast<uint64_t>(i), kDgTagNoise);
        const uint64_t u = uniform_below(st, m);
        in_range = in_range && u < m;
        if (u < m) ++count[u];
      }
      check(in_range, "uniform_below(m) < m");
      for (uint64_t v = 0; v < m; ++v) check_frequency(count[v], n, 1.0 / static_cast<double>(m), "uniform_below(m)");
    }
    // both word widths at their edges: the 32-bit words up to 2^28, the 64-bit ones above
    const uint64_t large[] = {(uint64_t{1} << 53) - 3, kDgSmallRange, kDgSmallRange + 1, 3 * (uint64_t{1} << 26) + 1};
    for (uint64_t m : large) {
      const int64_t n = 1000000;
      int64_t upper = 0;
      bool in_range = true;
      for (int64_t i = 0; i < n; ++i) {
        DgStream st = dg_stream(12, m, static_cast<uint64_t>(i), kDgTagNoise);
        const uint64_t u = uniform_below(st, m);
        in_range = in_range && u < m;
        upper += u >= (m + 1) / 2 ? 1 : 0;
      }
      check(in_range, "uniform_below(m) < m, large m");
      check_frequency(upper, n, static_cast<double>(m / 2) / static_cast<double>(m), "uniform_below(large m), upper half");
    }
  }
  // The Bernoulli trials against their exact probabilities.
  {
    const uint64_t fracs[][2] = {{0, 1}, {1, 1}, {1, 2}, {3, 7}, {6, 7}, {(uint64_t{1} << 52) - 1, uint64_t{1} << 52}};
    for (const auto& c : fracs) {
      const double g = static_cast<double>(c[0]) / static_cast<double>(c[1]);
      bernoulli_frequency(13, c[0], [&](DgStream& st) { return bernoulli_exp_frac(st, c[0], c[1]); }, exp(-g),
                          "bernoulli_exp_frac");
    }
    const uint64_t squares[][2] = {{0, 1}, {1, 2}, {5, 7}, {999, 1000}};
    for (const auto& c : squares) {
      const double r = static_cast<double>(c[0]) / static_cast<double>(c[1]);
      bernoulli_frequency(14, c[0], [&](DgStream& st) { return bernoulli_exp_square(st, c[0], c[1]); },
                          exp(-r * r / 2), "bernoulli_exp_square");
    }
  }
  // The discrete Gaussian.
  {
    const uint64_t ss[] = {1, 2, 3, 7, 40};
    for (uint64_t s : ss) chi_square_pmf(s, 2000000, 0x5eed0000ull + s);
    check(discrete_gaussian(1, 2, 3, 0) == 0, "s = 0 draws 0");
    // Large s: mean 0 and variance s^2 (to 1e-300 relative); the variance of y^2/s^2 is 2 (+tiny).
    const uint64_t big[] = {uint64_t{1} << 26, 1000003, uint64_t{1} << 40, kDgMaxSigma};
    for (uint64_t s : big) {
      const int64_t n = 400000;
      double m1 = 0, m2 = 0, m4 = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double y = static_cast<double>(discrete_gaussian(99, s, static_cast<uint64_t>(i), s)) / static_cast<double>(s);
        m1 += y;
        m2 += y * y;
        m4 += y * y * y * y;
      }
      m1 /= n;
      m2 /= n;
      m4 /= n;
      check(fabs(m1) <= 6 / sqrt(static_cast<double>(n)), "large s: mean 0 within 6 standard errors");
      check(fabs(m2 - 1) <= 6 * sqrt(2.0 / n), "large s: variance s^2 within 6 standard errors");
      check(fabs(m4 - 3) <= 6 * sqrt(96.0 / n), "large s: fourth moment 3 s^4 within 6 standard errors");
    }
  }
  // Cost (not checked).
  {
    const int64_t n = 1000000;
    int64_t acc = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; ++i) acc += discrete_gaussian(5, 6, static_cast<uint64_t>(i), uint64_t{1} << 27);
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n;
    printf("discrete_gaussian(s = 2^27): %.1f ns a draw on one core (sum %lld)\n", ns, static_cast<long long>(acc));
  }
  return report("test_discrete_gaussian");
}
