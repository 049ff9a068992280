// The bound and the release of instantiated per-example gradients (bpclip_fast/exact.py,
// DenseExamples: GroupNorm, LayerNorm, PositionalEmbedding, ClassToken), shared by the CPU kernels
// (csrc/cpu/examples_cpu.cpp), the CUDA kernels (csrc/cuda/examples_kernels.cuh) and the emulator,
// so that every backend sums in the same fixed order and gives the same bits.
//
// An example's values are a weight row of Nw and a bias row of Nb entries (Nb = 0 without one),
// read as one row of n = Nw + Nb: entry j < Nw is weight[b, j], entry j >= Nw is bias[b, j - Nw].
//
// examples_bound: per example b, bound[b] = RN(RN(sqrt(t)) * r), with
//   t = RN(s^ + n tau),   s^ = the double sum of the entries' squares (order: kBoundParts partial
//   sums, part p taking the entries j = p mod kBoundParts in increasing j, then a halving tree),
//   tau = 2^-1074 (fp64 data only; 0 otherwise), r = examples_bound_factor(n) >= sqrt(grow(n + 1)).
// Proof that bound[b] >= ||G_b|| (v = 2^-53, gamma_k = k v / (1 - k v)):
//   squares: an fp32/fp16/bf16 entry squares exactly in double (<= 48-bit significand, exponent
//     >= -298); an fp64 entry's square is x^2 (1 + d) + e, |d| <= v, |e| <= tau / 2 (underflow),
//     so x^2 <= RN(x^2) / (1 - v) + tau;
//   sum: a double sum of n non-negative terms in any order errs by at most gamma_{n-1} (additions
//     are exact in the subnormal range, so they carry no absolute term): sum RN(x^2) <= s^ / (1 -
//     gamma_{n-1}); so s = ||G_b||^2 <= (s^ + n tau) / ((1 - gamma_{n-1})(1 - v));
//   the addition of n tau, the root and the product each round once (relative v), so
//     bound >= sqrt(t) r (1 - v)^2 >= sqrt((s^ + n tau) grow) (1 - v)^(5/2)
//   and bound >= sqrt(s) when grow >= 1 / ((1 - gamma_{n-1}) (1 - v)^6), which grow(n + 1) =
//   1 + 2 (n + 5) v is for n v < 2^-13 (checked: n < 2^39). A non-finite entry (or an fp64 square
//   that overflows) gives a non-finite bound: the factor is 0 and the example adds exact zeros.
//
// examples_release: out[o] = RN_T(((S[o] + RN(std z[o])) * scale)) with
//   S[o] = sum over b of RZ_T(c_b x[b, o]) (0 for c_b = 0, whatever x[b, o] holds), summed in acc_t
//   (fp32; fp64 for fp64 data) in a fixed order: kReleaseParts partial sums, part p taking the
//   examples b = p mod kReleaseParts in increasing b, then ((p0 + p1) + (p2 + p3)) + ((p4 + p5) +
//   (p6 + p7)); z[o] the philox_noise_ stream's normal for element o (bpclip_fast/philox.h) at
//   counter offset `offset` for the weight and offset + 1 for the bias, added as philox_noise_'s
//   accumulate does (skipped for std = 0), and the scale applied as acc_t (skipped for 1). So the
//   result is bit for bit philox_noise_(S, accumulate=True), then S.mul_(scale), then .to(T).
#pragma once

#include <math.h>
#include <stdint.h>

#include "bpclip_fast/bound.h"  // finite_bound
#include "bpclip_fast/macros.h"

namespace bpclip {

constexpr int kBoundParts = 256;   // partial sums of squares per example (the CUDA block size)
constexpr int kReleaseParts = 8;   // partial sums per released element (the CUDA warps per block)
constexpr int kReleaseTile = 32;   // released elements per CUDA block (one warp's lanes)
// n < 2^39 keeps n v < 2^-13, where grow's first-order form covers the higher-order terms.
constexpr int64_t kMaxExampleEntries = int64_t(1) << 39;

// r = the double just above sqrt(1 + 2 (n + 5) 2^-53): the root rounds once, so its successor is
// >= the exact root of grow(n + 1) = 1 + ((n + 1) + 4) 2^-52 (the extra term: the n tau addition).
inline double examples_bound_factor(int64_t n) {
  const double grow = 1.0 + static_cast<double>(n + 5) * 0x1p-52;  // exact for n < 2^39
  return nextafter(sqrt(grow), INFINITY);
}

// n tau for fp64 data (the underflow of the squares), 0 otherwise; exact (a multiple of tau below
// 2^-1022 * 2^39).
inline double examples_bound_tiny(int64_t n, bool fp64) {
  return fp64 ? static_cast<double>(n) * 0x1p-1074 : 0.0;
}

// The bound from an example's sum of squares `total` (after the halving tree over the kBoundParts
// partial sums, part[t] += part[t + s] for s = 128, .., 1, as the CUDA block does it in shared memory;
// the partials of absent entries are exact zeros, so at most n - 1 additions round).
BPCLIP_HD inline double examples_bound_of(double total, double tiny, double r) {
  return sqrt(total + tiny) * r;
}

template <typename acc_t>
BPCLIP_HD inline acc_t release_parts_total(const acc_t* p) {
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

}  // namespace bpclip
