// The per-example arithmetic of the exact norms' bound (csrc/exact.cpp, file comment), shared by the
// CPU kernel (csrc/cpu/bound_cpu.cpp), the CUDA kernel (csrc/cuda/bound_kernels.cuh) and the test
// emulator, so that all three evaluate the same double operations in the same order.
//
// One example is `per` consecutive rows (its channel groups; 1 for Linear). A row r has T positions
// with input vectors x_t = x[r, t, :] (dx entries: a Linear's input row, or a Conv2d's zero-padded
// patch, read from the patches [rows, dx, T] transposed) and upstream gradients g_t = g[r, t, :]
// (dg entries), all through strides, in the accumulation dtype; the bias reads the upstream
// gradient itself, gb[r, t, :] (p channels). The kernel sums each position's squares itself, in
// double (fp32 squares are exact in double and neither overflow nor underflow there), as S =
// position_split(n) interleaved partial sums, part q sequential over the entries e = q, q + S,
// ... < n, then the parts combined by the tree v[q] += v[q + off], off = S / 2, ..., 1
// (position_sq; S = 1 is the plain sequential sum). The split depends on the entry count alone, so
// CPU and CUDA split alike; it exists for the GPU, where a position summed by one thread kept too
// few loads in flight (a Linear's row of 32768 entries; a 288-entry patch, 2026-11-26 profiles). The rest of the row's work is split over
// kBoundLanes lanes (a CUDA block, one example each; a loop on the CPU): lane l takes positions
// t = l, l + kBoundLanes, ... and entries e = l, l + kBoundLanes, ... of the weight's squared-norm
// terms and channels j = l, ... of the bias; each lane sums its share sequentially in double, and the
// lanes' partial sums are combined by the tree v[l] += v[l + off], off = kBoundLanes / 2, ..., 1
// (combine_lanes; on the GPU the levels off >= 32 through shared memory, the rest by a warp's
// shuffle-down, the same additions). Every one of these sums is of
// non-negative terms, except the ghost products' (whose bound gamma_n(v) sum |terms| holds in any
// order), so any order is covered by the file comment's gamma terms; the CPU kernel keeps this
// order exactly (it may precompute a row's position sums with the positions as its inner loop, each
// position's sum still sequential over its entries), so CPU, CUDA and emulator agree bit for bit.
#pragma once

#include <stdint.h>

#include <math.h>

#include "clip.h"
#include "macros.h"

namespace bpclip {

// 256, not a warp's 32: a whole block per example, so a batch of B examples keeps B * 8 warps busy
// (with one warp per example, a flat CIFAR-10 step at B = 128 spent 68% of its H100 time in this
// kernel with under one warp per multiprocessor; docs/benchmarks.md, 2026-11-26).
constexpr int kBoundLanes = 256;

// K of csrc/exact.cpp's file comment: a factor below 1/K is set to 0 (bpclip_fast/exact.py,
// FACTOR_FLOOR), so the bound need cover the release's subnormal rounding only for factors >= 1/K.
constexpr double kFloorInverse = 0x1p60;

// What the kernel knows of a layer's norms: computed on the host (csrc/exact.cpp, bound_consts)
// and passed as one float[] (kBoundConsts entries, in this order).
enum BoundConst : int {
  kGrowX,    // position norm of x: a_t = sqrt(S_t grow + add) (S_t the kernel's double sum of squares;
             // grow 1 from bound_consts, add 3 d tau for fp64 data, 0 for fp32)
  kAddX,
  kGrowG,    // likewise for g
  kAddG,
  kSlack,    // sum_slack(T + d + p + G): the sums over positions and channel groups
  kGhostM2,  // ghost E = cM2 M^2 + 2 M (cB1 B1 + cA1 A1) + cAB (T M + A1 B1)
  kGhostB1,
  kGhostA1,
  kGhostAB,
  kGhostW,   // under = ((1 + w) E + w M^2) out_slack
  kOutSlack,
  kInstDaz,  // instantiation: extra = (sqrt(cD (A1 + B1) M) + cF1 sqrt(cF2 M)) out_slack
  kInstF1,
  kInstF2,
  kGrow,     // bound = sqrt(sq grow + eps P^2 + under) + kappa P + absolute X + extra
  kEps,
  kKappa,
  kAbsolute,
  kBoundConsts
};

// kBoundBiasSummed: gb is [rows, 1, p], the bias gradient itself (csrc/exact.cpp's kept per-example
// gradients, summed over the positions by their producer): the bias is normed from exactly those
// values, so the norm is of what the release sums (an overflow there gives +Inf, factor 0).
enum BoundFlag : int { kBoundWeight = 1, kBoundBias = 2, kBoundGhost = 4, kBoundBiasSummed = 8 };

// Geometry of one call: rows = examples x per; x [rows, T, dx] and g [rows, T, dg] by strides; the
// weight's squared-norm terms wa[r, e] * wb[r, e], e < L, contiguous rows (Gram entries of x and of
// g for ghost, the instantiated gradient twice for instantiation; L = 0 at T = 1, where the weight's
// sq is a^2 b^2 from the position norms).
struct BoundGeometry {
  int64_t examples, per, T, dx, dg, p, L;
  int64_t sx0, sx1, sx2, sg0, sg1, sg2, sb0, sb1, sb2;
  int flags;
};

// One lane's partial sums over its share of a row.
struct LaneSums {
  double P, X, M, A, B, W, bias;
};

BPCLIP_HD inline void add_lane(LaneSums& a, const LaneSums& b) {
  a.P += b.P;
  a.X += b.X;
  a.M += b.M;
  a.A += b.A;
  a.B += b.B;
  a.W += b.W;
  a.bias += b.bias;
}

// Entries per part at least (a part's loop should hide a load's latency, and a short position is
// not worth splitting).
constexpr int64_t kSplitMinEntries = 16;

// How many parts (a power of two) a position's n squares are summed in: the most, up to kBoundLanes,
// with at least kSplitMinEntries entries each (one block of kBoundLanes threads holds a position's
// parts on the GPU).
BPCLIP_HD inline int position_split(int64_t n) {
  int S = 1;
  while (S < kBoundLanes && static_cast<int64_t>(2 * S) * kSplitMinEntries <= n) S <<= 1;
  return S;
}

// Part q of S of a position's sum of squares: entries e = q, q + S, ... < n, sequentially, in double.
template <typename T>
BPCLIP_HD inline double position_part(const T* v, int64_t n, int64_t stride, int S, int q) {
  double s = 0.0;
  for (int64_t j = q; j < n; j += S) {
    const double e = static_cast<double>(v[j * stride]);
    s += e * e;
  }
  return s;
}

// The parts' tree, v[q] += v[q + off] for off = S / 2, ..., 1; the total is v[0].
BPCLIP_HD inline double combine_parts(double* v, int S) {
  for (int off = S / 2; off > 0; off >>= 1)
    for (int q = 0; q < off; ++q) v[q] += v[q + off];
  return v[0];
}

// A position's sum of squares as the kernels take it (the file comment): S = position_split's parts.
template <typename T>
BPCLIP_HD inline double position_sq(const T* v, int64_t n, int64_t stride, int S) {
  double parts[kBoundLanes];
  for (int q = 0; q < S; ++q) parts[q] = position_part(v, n, stride, S, q);
  return combine_parts(parts, S);
}

// Lane `lane`'s share of row r's positions; pos gives the position sums of squares (x_sq(r, t),
// g_sq(r, t)).
template <typename Positions>
BPCLIP_HD inline void lane_positions(LaneSums& out, const Positions& pos, const BoundGeometry& s, const double* c,
                                     int64_t r, int lane) {
  const bool weight = s.flags & kBoundWeight, bias = s.flags & kBoundBias;
  for (int64_t t = lane; t < s.T; t += kBoundLanes) {
    const double a = sqrt(pos.x_sq(r, t) * c[kGrowX] + c[kAddX]);
    const double b = sqrt(pos.g_sq(r, t) * c[kGrowG] + c[kAddG]);
    const double x2 = weight ? a * a : 0.0;
    const double row = sqrt(bias ? x2 + 1.0 : x2);
    out.P += row * b;
    out.X += row;
    out.M += a * b;
    out.A += a;
    out.B += b;
    if (s.T == 1 && weight) out.W = (a * a) * (b * b);  // from the double norms (file comment, T = 1)
  }
}

// Lane `lane`'s share of row r's weight terms wa[r, e] wb[r, e], e = lane, lane + kBoundLanes, ...
// (T > 1; L = 0 at T = 1), added to out.W in that order.
template <typename T>
BPCLIP_HD inline void lane_weight_terms(LaneSums& out, const T* wa, const T* wb, const BoundGeometry& s, int64_t r,
                                        int lane) {
  if (!(s.flags & kBoundWeight) || s.L == 0) return;
  const T* ar = wa + r * s.L;
  const T* br = wb + r * s.L;
  for (int64_t e = lane; e < s.L; e += kBoundLanes) out.W += static_cast<double>(ar[e]) * static_cast<double>(br[e]);
}

// Lane `lane`'s share of row r's bias gradient: channels j = lane, lane + kBoundLanes, ..., each
// summed over the positions in double (one position: kBoundBiasSummed), then squared.
template <typename T>
BPCLIP_HD inline void lane_bias(LaneSums& out, const T* gb, const BoundGeometry& s, int64_t r, int lane) {
  if (!(s.flags & kBoundBias)) return;
  const T* br = gb + r * s.sb0;
  const int64_t positions = (s.flags & kBoundBiasSummed) ? 1 : s.T;
  for (int64_t j = lane; j < s.p; j += kBoundLanes) {
    double sum = 0.0;  // the bias gradient's entry j, in double
    for (int64_t t = 0; t < positions; ++t) sum += static_cast<double>(br[t * s.sb1 + j * s.sb2]);
    out.bias += sum * sum;
  }
}

// Lane `lane`'s share of row r (the CUDA kernel's; the CPU kernel runs the same three parts, the
// weight terms for all lanes in one pass).
template <typename T, typename Positions>
BPCLIP_HD inline LaneSums lane_sums(const Positions& pos, const T* gb, const T* wa, const T* wb,
                                    const BoundGeometry& s, const double* c, int64_t r, int lane) {
  LaneSums out{0, 0, 0, 0, 0, 0, 0};
  lane_positions(out, pos, s, c, r, lane);
  lane_weight_terms(out, wa, wb, s, r, lane);
  lane_bias(out, gb, s, r, lane);
  return out;
}

// Lane 0's result of the lanes' reduction tree over v[0..kBoundLanes), for a host loop, where the
// lanes from n on had no share of the row: theirs are exactly +0.0 (every partial sum starts at +0.0
// and is never -0.0: a sum is -0.0 only if both operands are), and adding +0.0 leaves the other
// operand as it is, NaN and infinities included. So the tree's additions with such a lane are
// skipped, and the result is the full tree's bit for bit (the CUDA kernel runs the full tree).
BPCLIP_HD inline LaneSums combine_lanes(LaneSums* v, int n) {
  for (int off = kBoundLanes / 2; off > 0; off >>= 1)
    for (int l = 0; l < off && l + off < n; ++l) add_lane(v[l], v[l + off]);
  return v[0];
}

// How many lanes get a share of a row: positions, bias channels or weight terms (lane l takes those
// numbered l, l + kBoundLanes, ...); the others keep their zeros.
BPCLIP_HD inline int active_lanes(const BoundGeometry& s) {
  int64_t n = s.T;
  if ((s.flags & kBoundBias) && s.p > n) n = s.p;
  if ((s.flags & kBoundWeight) && s.L > n) n = s.L;
  return n < kBoundLanes ? static_cast<int>(n < 1 ? 1 : n) : kBoundLanes;
}

// The per-example quantities summed over its rows (channel groups).
struct ExampleSums {
  double sq, P, X, under, extra;
};

// Row r's totals (all lanes) -> its sq, P, X and the GEMMs' error terms, added into e.
BPCLIP_HD inline void add_row(ExampleSums& e, const LaneSums& t, const BoundGeometry& s, const double* c) {
  const bool weight = s.flags & kBoundWeight, bias = s.flags & kBoundBias;
  double sq = weight ? t.W : 0.0;
  if (bias) sq = sq + t.bias;
  const double slack = c[kSlack];
  double under = 0.0, extra = 0.0;
  if (weight && s.T > 1) {
    const double M = t.M * slack, A1 = t.A * slack, B1 = t.B * slack;
    if (s.flags & kBoundGhost) {
      const double E = c[kGhostM2] * (M * M) + (2.0 * M) * (c[kGhostB1] * B1 + c[kGhostA1] * A1) +
                       c[kGhostAB] * (static_cast<double>(s.T) * M + A1 * B1);
      under = ((1.0 + c[kGhostW]) * E + c[kGhostW] * (M * M)) * c[kOutSlack];
    } else {
      const double daz = sqrt(c[kInstDaz] * (A1 + B1) * M);
      const double flush = c[kInstF1] * sqrt(c[kInstF2] * M);
      extra = (daz + flush) * c[kOutSlack];
    }
  }
  e.sq += sq;
  e.P += t.P * slack;
  e.X += t.X * slack;
  e.under += under;
  e.extra += extra;
}

BPCLIP_HD inline double example_bound(const ExampleSums& e, const double* c) {
  return sqrt(e.sq * c[kGrow] + c[kEps] * (e.P * e.P) + e.under) + c[kKappa] * e.P + c[kAbsolute] * e.X + e.extra;
}

// n >= 0 always; NaN fails both comparisons and +Inf the second (clip.h's is_finite_norm).
BPCLIP_HD inline bool finite_bound(double n) { return n == n && n - n == 0.0; }


// ---- The clip factors from the bounds (exact_factors; bpclip_fast/exact.py, factors) -------------
// total: one layer's bound as it is; over L > 1 layers (flat) sqrt(sum_l bound_l^2 K) with
// K = 1 + 2 gamma_{L+3}(2^-53) (the caller's `inflate`), an upper bound on the exact root: the sum
// of the L rounded squares is >= S (1 - gamma_L), and the product with K and the root round by
// at most 1 - v each, (1 - gamma_{L+3}) K >= 1. (The plain double root could fall an ulp or a few
// below the exact one, and c * total <= C would not cover the exact total.)
BPCLIP_HD inline double layers_total(const double* bounds, int64_t L, int64_t stride, double inflate) {
  if (L == 1) return bounds[0];
  double s = 0.0;
  for (int64_t l = 0; l < L; ++l) s += bounds[l * stride] * bounds[l * stride];
  return sqrt(s * inflate);
}

// The bound rounded up to fp32 (never down: c * bound <= C must hold for the double bound), NaN
// and +Inf kept; for fp64 data the bound itself.
BPCLIP_HD inline double round_up_to_factor_dtype(double b, bool fp64) {
  if (fp64) return b;
  float f = static_cast<float>(b);
  if (static_cast<double>(f) < b) f = nextafterf(f, static_cast<float>(INFINITY));
  return static_cast<double>(f);
}

// Example factor of a total bound: clip_rows on the rounded-up bound as a row of one element (its
// norm sqrt(b * b), its factor against bound_eff = effective_bound(C, 1), stored rounded toward zero
// to fp32 unless fp64: bit for bit what clip_rows gives; clip.h's proof), then the floor 1/K.
// *nonfinite: whether clip_rows counts the example as non-finite.
BPCLIP_HD inline double example_factor(double total, bool fp64, double bound_eff, int fn, double gamma,
                                       bool* nonfinite) {
  const double b = round_up_to_factor_dtype(total, fp64);
  const double n = sqrt(b * b);
  *nonfinite = !is_finite_norm(n);
  const double c = clip_factor(n, bound_eff, fn, gamma);
  const double f = fp64 ? c : static_cast<double>(f64_to_f32_rz(c));
  return f < 1.0 / kFloorInverse ? 0.0 : f;
}

}  // namespace bpclip
