// The integer release of one coordinate (docs/design.md, "Integer noise"): the clipped sum x is put
// on the grid gamma = 2^e, randomly rounded to an integer k with a Philox word that does not depend
// on the data, given discrete Gaussian noise Y ~ N_Z(0, sigma^2) (discrete_gaussian.h), and
// released as (k + Y) gamma scale in the buffer's dtype. Everything after k + Y is a fixed function
// of that integer (post-processing), so no floating-point detail of the release can tell two data
// sets apart beyond what the integer mechanism k + Y allows.
//
// The grid value: a = clamp((x * multiplier) * 2^-e, +-2^52), NaN as 0, in double: x * multiplier
// is exact where its significands allow (below), and otherwise errs by at most
// 2^-53 |a| (<= 1/2 at the clamp); the power of two is exact for |e| <= 1000 but where the result
// leaves the normal range (overflow goes to the clamp). Exact means: the significands of x and of
// multiplier hold at most 53 bits together (a float32 x times an integer below 2^29, or times 1).
// The clamp and the scaling are 1-Lipschitz up to that rounding.
//
// The coupled rounding: v = (w >> 11) 2^-53 from the first 64-bit word w of the element's tag-2
// stream (discrete_gaussian.h: the rounding words), and k = floor(a) + [a - floor(a) >= v], i.e.
// k = floor(a - v) + 1, computed exactly: a - floor(a) is exact (Sterbenz) but for a in (-1/2, 0),
// where a + 1 rounds (review 46 F4), so there floor(a) = -1 and the test is a >= v - 1 (exact: v is a
// multiple of 2^-53 in [0, 1)). For the same
// v, two data sets give |k - k'| < |a - a'| + 1 on every coordinate, so over d coordinates
// ||k - k'||_2 <= ||a - a'||_2 + sqrt(d) (Minkowski). E[k] = a + O(2^-53): v is uniform on the 2^53
// multiples of 2^-53 below 1.
//
// The value: ((double)(k + Y) * 2^e) * scale, rounded to the buffer's dtype: two products and no
// sum, so no FMA can contract it, and every backend gives the same bits. |k| <= 2^52 + 1 and
// |Y| < 96 sigma <= 2^59 (discrete_gaussian.h), so k + Y never overflows int64.
#pragma once

#include <math.h>
#include <stdint.h>

#include "bpclip_fast/bits.h"
#include "bpclip_fast/discrete_gaussian.h"
#include "bpclip_fast/macros.h"

namespace bpclip {

constexpr int kReleaseMaxGridExp = 1000;
constexpr double kReleaseClamp = 4503599627370496.0;  // 2^52

// 2^e for -1022 <= e <= 1023, built from its bits (exact on every backend).
BPCLIP_HD inline double pow2_exact(int e) { return bits_double(static_cast<uint64_t>(e + 1023) << 52); }

BPCLIP_HD inline double release_grid_value(double x, double multiplier, double inv_grid) {
  double a = (x * multiplier) * inv_grid;
  if (a != a) a = 0.0;
  return a < -kReleaseClamp ? -kReleaseClamp : (a > kReleaseClamp ? kReleaseClamp : a);
}

BPCLIP_HD inline int64_t coupled_round(double a, uint64_t word) {
  const double v = static_cast<double>(word >> 11) * 1.1102230246251565e-16;  // 2^-53
  const double whole = floor(a);
  const bool up = whole == -1.0 ? a >= v - 1.0 : a - whole >= v;
  return static_cast<int64_t>(whole) + (up ? 1 : 0);
}

// The released value of element i (contiguous position) of a buffer holding x.
BPCLIP_HD inline double integer_release_value(double x, uint64_t seed, uint64_t offset, uint64_t i, double multiplier,
                                              int grid_exp, uint64_t sigma, double scale) {
  DgStream st = dg_stream(seed, offset, i, kDgTagRounding);
  const int64_t k = coupled_round(release_grid_value(x, multiplier, pow2_exact(-grid_exp)), dg_word64(st));
  const int64_t y = k + discrete_gaussian(seed, offset, i, sigma);
  return (static_cast<double>(y) * pow2_exact(grid_exp)) * scale;
}

}  // namespace bpclip
