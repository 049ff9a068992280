// Per-example clip factors, the coefficient of the clipping Jacobian, and the rounding of the
// clipped values: shared by both backends (and the test emulator), so that CPU and CUDA compute
// the same numbers with the same arithmetic.
//
// For an example of norm n and bound C the factor s keeps ||s x|| <= C:
//   clip       s = min(1, C/n)        (Abadi et al.; the paper)
//   global     s = 1[n <= C]          (Bu et al.: examples over the bound are dropped)
//   normalize  s = C/(n + gamma)      (automatic clipping), gamma > 0
// A non-finite n (a NaN/Inf entry) gives s = 0: the example contributes nothing, so every bound
// still holds, and the caller counts it.
//
// ---- The bound holds after rounding ---------------------------------------------------------
// Claim. For a row x of N finite entries of dtype T (fp32, fp16, bf16, fp64) and a bound C > 0,
// the values the kernels store, x~_e = RZ_T(s * x_e), satisfy ||x~|| <= C exactly (||.|| the
// Euclidean norm, or for norm = l15 the l15 norm sqrt(sum_c (sum_hw |x_chw|)^2)), for every clip
// function. (fp64 data: up to the overflow and underflow limits stated at the end.)
//
// What the kernels compute (u = 2^-53, every double operation rounds to nearest):
//   Q^  = the row's sum of squares (l2), or sum_g A^_g^2 with A^_g = sum |x_e| over the S = H*W
//         entries of channel g (l15, G channels, N = G*S), summed in double in a fixed tree
//         (RowGeometry's chunks, lanes, warps and per-row combine);
//   n^  = RN(sqrt(Q^));
//   C'  = RN(C * (1 - eta_N)),  eta_N = bound_shrink(N) below, a power of two, so 1 - eta_N is
//         exact;
//   s_d = clip_factor(n^, C', fn, gamma) in double: 1 or C'/n^ (clip), 1 or 0 (global),
//         C'/RN(n^ + gamma) (normalize);
//   s   = the stored factor: RZ_f32(s_d) for fp32/fp16/bf16 data (so s <= s_d), s_d for fp64;
//   x~_e = RZ_T(s * x_e): for fp32/fp16/bf16, s * x_e is a product of two <= 24-bit significands,
//         exact in double (48 <= 53 bits; exponents within [-298, 256]), then rounded toward zero
//         to T (scale_rz_* below); for fp64, RZ_f64 of the exact product (scale_rz_f64). Hence
//         |x~_e| <= s |x_e| for every entry, subnormals and overflow (RZ saturates) included.
//         (The CPU's fp32 loop computes the same RZ from a float product and its exact fma
//         residual where the CPU has FMA: csrc/cpu/clip_cpu.cpp, scale_f32.)
//
// (a) The norm. Each square x_e^2 is exact in double for fp32/fp16/bf16 (an fp32 square has 48
//     significant bits and lies in [2^-298, 2^256]); |x_e| is exact. A sum of non-negative terms
//     in a binary tree multiplies each term by one factor (1 + d), |d| <= u, per rounded addition
//     on its path to the root; an addition with an exact zero operand does not round, and a path
//     meets at most (number of terms - 1) additions with two non-zero operands. An fma
//     a + v*v (nvcc contracts) is one such addition. Terms and partial sums are >= 0 (so no
//     cancellation) and far from double's overflow (all below 2^31 * 2^318) and underflow (no
//     partial sum is below its largest term). With Q and n the exact values:
//       l2:  Q^ >= Q (1-u)^(N-1)      (fp64 data: the squares round too, (1-u)^N)
//       l15: A^_g >= A_g (1-u)^(S-1), its square rounds once, and the G-term sum adds G-1, so
//            Q^ >= Q (1-u)^(2S + G - 2) >= Q (1-u)^(2N-1)    (as (2S-1)(G-1) >= 0)
//     and in every case Q^ >= Q (1-u)^(2N), so n^ >= sqrt(Q^) (1-u) >= n (1-u)^(N+1).
// (b) The factor. C' <= C (1 - eta_N)(1 + u). For clip over the bound, s_d <= (C'/n^)(1+u); for
//     normalize, RN(n^ + gamma) >= n^ (1-u), so s_d <= (C'/n^)(1+u)/(1-u); where s_d = 1 the
//     kernel saw n^ <= C'. In every case s_d n^ <= C' (1+u)/(1-u), or s_d = 0.
// (c) The stored values. |x~_e| <= s |x_e| <= s_d |x_e|, and both norms are monotone in each
//     |x_e| and homogeneous, so
//       ||x~|| <= s_d n <= s_d n^ / (1-u)^(N+1) <= C (1 - eta_N)(1+u)^2 / (1-u)^(N+2)
//              <= C (1 - eta_N) / (1-u)^(N+4)                       [(1+u) <= 1/(1-u)]
//     and (1-u)^(N+4) >= 1 - (N+4) u >= 1 - eta_N by Bernoulli's inequality and the choice of
//     eta_N. So ||x~|| <= C.                                                                   QED
// eta_N <= 2^-21 for every N < 2^31 ((2^31 + 3) u < 2^-21); for the row sizes of real layers it is
// far smaller (N = 10^6: 2^-33). Nothing here depends on the rounding of a later GEMM: the bound is
// on the stored clipped values, from which the sensitivity argument (bpclip_fast/nn.py) proceeds.
// The same holds for the clipped upstream gradient inside linear_backward / conv2d_backward, which
// call clip_rows itself (csrc/layers.cpp).
// Limits of fp64 data (used by gradcheck only): the sums are plain double, so a finite row whose
// sum of squares exceeds DBL_MAX (an entry >= ~1.34e154, or l15 channel sums >= ~1.34e154) gets
// n^ = Inf and is treated as non-finite (factor 0, counted); squares below 2^-1022 may underflow,
// which loosens the claim by an absolute sqrt(N) * 2^-537 (~1e-162 sqrt(N)), irrelevant unless C
// is that small. fp32/fp16/bf16 data have neither limit: no finite row can overflow or underflow
// the double accumulation.
// The stored norm is RN_f32(n^) for fp32/fp16/bf16 data: +Inf when n^ exceeds FLT_MAX (entries
// within a factor sqrt(N) of FLT_MAX). Such a row is finite, clipped normally and not counted;
// clip_jvp_coef recovers its norm from the factor.
#pragma once

#include <math.h>
#include <stdint.h>

#include "bpclip_fast/bits.h"
#include "bpclip_fast/macros.h"

namespace bpclip {

enum ClipFn : int { kClip = 0, kGlobal = 1, kNormalize = 2 };
enum NormKind : int { kL2 = 0, kL15 = 1 };

// eta_N: the smallest power of two >= (N + 4) 2^-53 (step (c) above). 2^-51 for N = 0.
inline double bound_shrink(int64_t n_elements) {
  const double need = static_cast<double>(n_elements + 4) * 0x1p-53;  // exact below 2^53 elements
  double eta = 0x1p-53;
  while (eta < need) eta *= 2.0;
  return eta;
}

// C' = C (1 - eta_N): the bound the kernels clip against, for rows of N elements.
inline double effective_bound(double bound, int64_t n_elements) { return bound * (1.0 - bound_shrink(n_elements)); }

BPCLIP_HD inline bool is_finite_norm(double n) {
  // n >= 0 always; NaN fails both comparisons and +Inf fails the second.
  return n == n && n - n == 0.0;
}

// The factor for norm n^ against the effective bound C' (step (b)).
BPCLIP_HD inline double clip_factor(double n, double bound_eff, int fn, double gamma) {
  if (!is_finite_norm(n)) return 0.0;
  switch (fn) {
    case kGlobal:
      return n <= bound_eff ? 1.0 : 0.0;
    case kNormalize:
      return bound_eff / (n + gamma);
    default:
      return n > bound_eff ? bound_eff / n : 1.0;
  }
}

// The clipping map y = s(x) x has the vector-Jacobian product
//   J^T g = s g + (x . g) grad s(x).
// Where s is locally constant (clip below the bound, global, a zero factor) the second term is 0.
// For clip above the bound, s = C'/n and grad s = -C' x / n^3; for normalize, s = C'/(n+gamma) and
// grad s = -C' x / (n (n+gamma)^2). With the clipped input xc = s x, |xc| = s n, both become
//   J^T g = s g - rho (xc . g) xc / (xc . xc),   rho = s^2 n / C'   (clip: rho = s, as s n = C'),
// so the backward needs only what the forward saves anyway (xc, s, n). Written with the stored
// xc's own squared norm (rather than kappa = 1/(n C') times (xc . g) xc), the radial part is the
// projection on the stored direction: a gradient along xc is annihilated exactly by clip, and the
// rounding of xc (toward zero, up to one ulp per entry) shortens xc without biasing the radial
// term, which for normalize with n >> gamma is a near-cancellation, s g gamma/(n + gamma).
// This returns the row's coefficient c = rho (xc . g) / (xc . xc) of xc, from the row's dot
// product and squared norm.
// n is the stored norm: +Inf for a finite row whose norm overflowed fp32 storage (see above);
// there s > 0 and the norm is recovered as C'/s (exact for clip; for normalize C'/s = n + gamma,
// a relative error gamma/n < gamma * 3e-39).
BPCLIP_HD inline double clip_jvp_coef(double n, double s, double bound_eff, int fn, double dot, double sq) {
  if (s == 0.0 || sq == 0.0) return 0.0;  // xc = 0: no radial term
  if (!is_finite_norm(n)) n = bound_eff / s;
  double rho = 0.0;
  if (fn == kNormalize) {
    rho = s * (s * n / bound_eff);
  } else if (fn == kClip && n > bound_eff) {
    rho = s;
  }
  return rho * (dot / sq);
}

// ---- Rounding toward zero (step (c)) ---------------------------------------------------------
// Portable bit manipulation, the same code on the CPU, the GPU and the emulator. For IEEE
// sign-magnitude formats, one step toward zero from a non-zero value is the integer decrement of
// its bit pattern (subnormals and the largest finite value included).

// RZ_f32(q) for a double q: round to nearest, then one step back toward zero when that
// rounded away from zero (|f| > |q|; an overflow to Inf steps back to FLT_MAX).
BPCLIP_HD inline float f64_to_f32_rz(double q) {
  const float f = static_cast<float>(q);
  const uint32_t back = fabs(static_cast<double>(f)) > fabs(q) ? 1u : 0u;
  return bits_float(float_bits(f) - back);
}

// RZ_bf16(f): bf16 is float's upper half, so truncation is rounding toward zero (Inf and quiet NaNs
// stay).
BPCLIP_HD inline uint16_t f32_to_bf16_bits_rz(float f) { return static_cast<uint16_t>(float_bits(f) >> 16); }

// RZ_f16(f). Half: 5 exponent bits (bias 15), 10 mantissa bits.
BPCLIP_HD inline uint16_t f32_to_f16_bits_rz(float f) {
  const uint32_t b = float_bits(f);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7fffffffu;
  const uint32_t e = a >> 23;  // float's biased exponent
  uint32_t h;
  if (a >= 0x7f800000u) {
    h = a == 0x7f800000u ? 0x7c00u : 0x7e00u;  // Inf stays Inf, NaN stays NaN (not from the kernels)
  } else if (a >= 0x47800000u) {
    h = 0x7bffu;  // |f| >= 2^16: the largest finite half (65504)
  } else if (e >= 113u) {
    h = (a >> 13) - (112u << 10);  // a normal half: rebias the exponent, drop 13 mantissa bits
  } else if (e >= 103u) {
    h = ((a & 0x7fffffu) | 0x800000u) >> (126u - e);  // subnormal half: floor(|f| 2^24)
  } else {
    h = 0u;  // |f| < 2^-24 (float subnormals too)
  }
  return static_cast<uint16_t>(sign | h);
}

// x~ = RZ(s x) for each storage type; x widened exactly (half/bf16 -> float). s >= 0 in the
// kernels (any sign works).
BPCLIP_HD inline float scale_rz_f32(float s, float x) {
  return f64_to_f32_rz(static_cast<double>(s) * static_cast<double>(x));  // the product is exact
}
BPCLIP_HD inline uint16_t scale_rz_bf16_bits(float s, float x) { return f32_to_bf16_bits_rz(scale_rz_f32(s, x)); }
BPCLIP_HD inline uint16_t scale_rz_f16_bits(float s, float x) { return f32_to_f16_bits_rz(scale_rz_f32(s, x)); }
// (RZ then RZ is RZ: every half/bf16 value is a float, so the largest one <= |q| is also the
// largest one <= RZ_f32(|q|).)

// RZ_f64(s x): p = RN(|s| |x|); the residual |s||x| - p is computed by an fma, and its sign is
// right even when it underflows (IEEE: an inexact result keeps the sign of the exact one; an exact
// zero residual is +0). A negative residual means p rounded up: step back one ulp.
BPCLIP_HD inline double scale_rz_f64(double s, double x) {
  const double a = fabs(s), b = fabs(x);
  const double p = a * b;
  const double r = fma(a, b, -p);
  const uint64_t back = signbit(r) ? 1u : 0u;
  const double m = bits_double(double_bits(p) - back);
  return signbit(s) != signbit(x) ? -m : m;
}

}  // namespace bpclip
