// Per-example clip factors and the coefficient of the clipping Jacobian, shared by both backends.
//
// For an example of norm n and bound C the factor s keeps ||s x|| <= C:
//   clip       s = min(1, C/n)        (Abadi et al.; the paper)
//   global     s = 1[n <= C]          (Bu et al.: examples over the bound are dropped)
//   normalize  s = C/(n + gamma)      (automatic clipping), gamma > 0
// A non-finite n (a NaN/Inf entry, or a norm that overflowed the accumulator) gives s = 0: the
// example contributes nothing, so every bound still holds, and the caller counts it.
#pragma once

#include "bpclip_fast/macros.h"

namespace bpclip {

enum ClipFn : int { kClip = 0, kGlobal = 1, kNormalize = 2 };
enum NormKind : int { kL2 = 0, kL15 = 1 };

template <typename acc_t>
BPCLIP_HD inline bool is_finite_norm(acc_t n) {
  // n >= 0 always; NaN fails both comparisons and +Inf fails the second.
  return n == n && n - n == acc_t(0);
}

template <typename acc_t>
BPCLIP_HD inline acc_t clip_factor(acc_t n, acc_t bound, int fn, acc_t gamma) {
  if (!is_finite_norm(n)) return acc_t(0);
  switch (fn) {
    case kGlobal:
      return n <= bound ? acc_t(1) : acc_t(0);
    case kNormalize:
      return bound / (n + gamma);
    default:
      return n > bound ? bound / n : acc_t(1);
  }
}

// The clipping map y = s(x) x has the vector-Jacobian product
//   J^T g = s g + (x . g) grad s(x).
// Where s is locally constant (clip below the bound, global, a zero factor) the second term is 0.
// For clip above the bound, s = C/n and grad s = -C x / n^3; for normalize, s = C/(n+gamma) and
// grad s = -C x / (n (n+gamma)^2). Written with the clipped input xc = s x both become
//   J^T g = s g - kappa (xc . g) xc   with   kappa = 1 / (n C),
// so the backward needs only what the forward saves anyway (xc, s, n). This returns kappa.
template <typename acc_t>
BPCLIP_HD inline acc_t clip_jvp_kappa(acc_t n, acc_t s, acc_t bound, int fn) {
  if (s == acc_t(0) || !is_finite_norm(n) || n == acc_t(0)) return acc_t(0);
  if (fn == kNormalize || (fn == kClip && n > bound)) return acc_t(1) / (n * bound);
  return acc_t(0);
}

}  // namespace bpclip
