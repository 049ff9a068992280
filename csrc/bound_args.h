// Validation of exact_bound_'s arguments, shared by its CPU and CUDA kernels (the arithmetic is
// bpclip_fast/bound.h; the caller, and the proof, csrc/exact.cpp).
#pragma once

#include <ATen/ATen.h>

#include "bpclip_fast/bound.h"
#include "common.h"

namespace bpclip {

inline BoundGeometry check_bound_args(const at::Tensor& sq, const at::Tensor& bound, const at::Tensor& x,
                                      const at::Tensor& g, const at::Tensor& gb, const at::Tensor& wa, const at::Tensor& wb, int64_t offset,
                                      int64_t per, int64_t flags, at::ArrayRef<double> consts,
                                      const c10::optional<at::Tensor>& nonfinite) {
  constexpr const char* op = "bpclip_fast.exact_bound_: ";
  TORCH_CHECK(consts.size() == kBoundConsts, op, "consts needs ", static_cast<int>(kBoundConsts), " entries, got ",
              consts.size());
  TORCH_CHECK(x.dim() == 3 && g.dim() == 3 && x.size(0) == g.size(0) && x.size(1) == g.size(1), op,
              "x and g must be [rows, T, *] with the same rows and T, got ", x.sizes(), " and ", g.sizes());
  const auto acc = x.scalar_type();
  TORCH_CHECK(acc == at::kFloat || acc == at::kDouble, op, "x must be float32 or float64, got ", acc);
  TORCH_CHECK(g.scalar_type() == acc && gb.scalar_type() == acc && wa.scalar_type() == acc &&
                  wb.scalar_type() == acc,
              op, "x, g, gb, wa and wb must share a dtype");
  TORCH_CHECK(sq.scalar_type() == at::kDouble && bound.scalar_type() == at::kDouble && sq.dim() == 1 &&
                  bound.sizes() == sq.sizes() && sq.is_contiguous() && bound.is_contiguous(),
              op, "sq and bound must be contiguous float64 [B]");
  for (const at::Tensor* t : {&bound, &g, &gb, &wa, &wb}) check_same_device(x, *t, "x", "an argument");
  check_same_device(x, sq, "x", "sq");
  TORCH_CHECK(per >= 1 && x.size(0) % per == 0, op, "per must be >= 1 and divide the rows, got ", per);
  const int64_t examples = x.size(0) / per;
  TORCH_CHECK(offset >= 0 && offset + examples <= sq.size(0), op, "rows [", offset, ", ", offset + examples,
              ") outside sq's ", sq.size(0));
  const int64_t L = wa.numel() == 0 ? 0 : wa.size(-1);
  TORCH_CHECK(wa.numel() == wb.numel() && (L == 0 || (wa.dim() == 2 && wb.dim() == 2 && wa.size(0) == x.size(0) &&
                                                      wb.sizes() == wa.sizes() && wa.is_contiguous() &&
                                                      wb.is_contiguous())),
              op, "wa and wb must be empty or contiguous [rows, L] of the same shape");
  TORCH_CHECK((flags & ~15) == 0, op, "unknown flags ", flags, " (1 weight, 2 bias, 4 ghost, 8 bias summed)");
  const bool bias = flags & kBoundBias, summed = flags & kBoundBiasSummed;
  TORCH_CHECK(!summed || bias, op, "flag 8 (the bias summed) needs flag 2 (the bias)");
  TORCH_CHECK(!bias || (gb.dim() == 3 && gb.size(0) == x.size(0) && gb.size(1) == (summed ? 1 : x.size(1))), op,
              summed ? "with the bias summed, gb must be [rows, 1, channels]" : "with the bias, gb must be [rows, T, channels]");
  TORCH_CHECK(x.size(1) == 1 || !(flags & kBoundWeight) || L > 0, op, "T > 1 needs the weight's terms wa, wb");
  if (nonfinite.has_value() && nonfinite->defined()) check_counter(*nonfinite, x);
  return BoundGeometry{examples,    per,         x.size(1),   x.size(2),   g.size(2),
                       bias ? gb.size(2) : 0,   L,           x.stride(0), x.stride(1), x.stride(2),
                       g.stride(0), g.stride(1), g.stride(2), bias ? gb.stride(0) : 0, bias ? gb.stride(1) : 0,
                       bias ? gb.stride(2) : 0, static_cast<int>(flags)};
}

// exact_factors: returns (B, L, clip_fn, bound_eff, inflate).
struct FactorsArgs {
  int64_t B, L;
  int fn;
  double bound_eff, inflate;
};

// The clipping arguments of the factors (exact_factors, examples_factors: one set of checks).
inline FactorsArgs factor_params(int64_t B, int64_t L, double max_norm, c10::string_view clip_fn, double gamma) {
  check_bound(max_norm, "max_norm");
  const int fn = parse_clip_fn(clip_fn);
  TORCH_CHECK(fn != kNormalize || gamma > 0, "bpclip_fast: clip_fn='normalize' needs gamma > 0, got ", gamma);
  const double v = 0x1p-53, k = static_cast<double>(L + 3);
  return FactorsArgs{B, L, fn, effective_bound(max_norm, 1), 1.0 + 2.0 * (k * v / (1.0 - k * v))};
}

inline FactorsArgs check_factors_args(at::TensorList bounds, const at::Tensor& nonfinite, double max_norm,
                                      c10::string_view clip_fn, double gamma) {
  constexpr const char* op = "bpclip_fast.exact_factors: ";
  TORCH_CHECK(!bounds.empty(), op, "needs at least one layer's bounds");
  for (const at::Tensor& b : bounds) {
    TORCH_CHECK(b.scalar_type() == at::kDouble && b.dim() == 1 && b.is_contiguous() && b.sizes() == bounds[0].sizes(),
                op, "every bound must be a contiguous float64 [B] of the same size");
    check_same_device(b, bounds[0], "a bound", "the first bound");
  }
  check_counter(nonfinite, bounds[0]);
  return factor_params(bounds[0].size(0), static_cast<int64_t>(bounds.size()), max_norm, clip_fn, gamma);
}

}  // namespace bpclip
