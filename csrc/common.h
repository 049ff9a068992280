// Host-side helpers shared by the CPU and CUDA launchers: argument parsing, checks, and a tensor's
// RowGeometry (the struct itself is in bpclip_fast/rows.h, where the emulator can include it).
#pragma once

#include <ATen/ATen.h>

#include <string_view>
#include <utility>

#include "bpclip_fast/clip.h"
#include "bpclip_fast/rows.h"

namespace bpclip {

inline int parse_clip_fn(std::string_view s) {
  if (s == "clip") return kClip;
  if (s == "global") return kGlobal;
  if (s == "normalize") return kNormalize;
  TORCH_CHECK(false, "bpclip_fast: clip_fn must be 'clip', 'global' or 'normalize', got '", std::string(s), "'");
}

inline int parse_norm(std::string_view s) {
  if (s == "l2") return kL2;
  if (s == "l15") return kL15;
  TORCH_CHECK(false, "bpclip_fast: norm must be 'l2' or 'l15', got '", std::string(s), "'");
}

inline void check_bound(double bound, const char* what) {
  TORCH_CHECK(bound > 0.0 && bound < 1e300, "bpclip_fast: ", what, " must be a positive finite number, got ", bound);
}

inline void check_float_tensor(const at::Tensor& t, const char* what) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble,
              "bpclip_fast: ", what, " must be float32, float16, bfloat16 or float64, got ", st);
}

inline void check_counter(const at::Tensor& counter, const at::Tensor& like) {
  TORCH_CHECK(counter.scalar_type() == at::kLong && counter.numel() == 1,
              "bpclip_fast: the non-finite counter must be a one-element int64 tensor");
  TORCH_CHECK(counter.device() == like.device(), "bpclip_fast: the non-finite counter is on ", counter.device(),
              " but the data is on ", like.device());
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* an, const char* bn) {
  TORCH_CHECK(a.device() == b.device(), "bpclip_fast: ", an, " is on ", a.device(), " but ", bn, " is on ",
              b.device());
}

// The per-example factors and norms are stored as fp32, or fp64 for fp64 data (the reductions and
// the factor computation themselves are double for every dtype: bpclip_fast/clip.h).
inline at::ScalarType acc_type_of(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline RowGeometry row_geometry(const at::Tensor& x, int norm, int64_t chunk) {
  const int64_t B = x.size(0);
  const int64_t N = B == 0 ? 0 : (x.dim() == 1 ? 1 : x.numel() / B);
  if (norm == kL15) {
    TORCH_CHECK(x.dim() == 4, "bpclip_fast: the l15 norm needs a [B, C, H, W] tensor, got ", x.dim(), " dims");
    return make_row_geometry(B, N, x.size(1), x.size(2) * x.size(3), chunk);
  }
  return make_row_geometry(B, N, 1, N, chunk);
}

// Validation of clip_rows' arguments, shared by the backends; returns the parsed (norm, clip_fn).
inline std::pair<int, int> check_clip_rows_args(const at::Tensor& x, const at::Tensor& nonfinite, double bound,
                                                c10::string_view norm, c10::string_view clip_fn, double gamma) {
  check_float_tensor(x, "x");
  TORCH_CHECK(x.dim() >= 1, "bpclip_fast.clip_rows: x needs a batch dimension");
  check_counter(nonfinite, x);
  check_bound(bound, "bound");
  const int fn = parse_clip_fn(clip_fn);
  TORCH_CHECK(fn != kNormalize || gamma > 0, "bpclip_fast: clip_fn='normalize' needs gamma > 0, got ", gamma);
  return {parse_norm(norm), fn};
}

inline int check_clip_backward_args(const at::Tensor& grad, const at::Tensor& clipped, const at::Tensor& factor,
                                    const at::Tensor& norms, double bound, c10::string_view clip_fn) {
  check_float_tensor(grad, "grad");
  TORCH_CHECK(grad.sizes() == clipped.sizes(), "bpclip_fast.clip_rows_backward: grad has shape ", grad.sizes(),
              " but clipped has shape ", clipped.sizes());
  TORCH_CHECK(grad.scalar_type() == clipped.scalar_type(), "bpclip_fast.clip_rows_backward: grad is ",
              grad.scalar_type(), " but clipped is ", clipped.scalar_type());
  check_same_device(grad, clipped, "grad", "clipped");
  check_same_device(grad, factor, "grad", "factor");
  check_same_device(grad, norms, "grad", "norm");
  check_bound(bound, "bound");
  const int64_t b = grad.dim() == 0 ? 0 : grad.size(0);
  TORCH_CHECK(factor.numel() == b && norms.numel() == b, "bpclip_fast.clip_rows_backward: factor and norm need ", b,
              " entries");
  TORCH_CHECK(factor.scalar_type() == acc_type_of(grad) && norms.scalar_type() == acc_type_of(grad),
              "bpclip_fast.clip_rows_backward: factor and norm must be ", acc_type_of(grad));
  return parse_clip_fn(clip_fn);
}

inline void check_scale_rows_args(const at::Tensor& x, const at::Tensor& factor) {
  check_float_tensor(x, "x");
  TORCH_CHECK(x.dim() >= 1, "bpclip_fast.scale_rows: x needs a batch dimension");
  check_same_device(x, factor, "x", "factor");
  TORCH_CHECK(factor.dim() == 1 && factor.numel() == x.size(0), "bpclip_fast.scale_rows: factor needs ", x.size(0),
              " entries (one per example), got shape ", factor.sizes());
  TORCH_CHECK(factor.scalar_type() == acc_type_of(x), "bpclip_fast.scale_rows: factor must be ", acc_type_of(x),
              " for ", x.scalar_type(), " data, got ", factor.scalar_type());
}

inline void check_noise_args(const at::Tensor& buf, double stdv) {
  check_float_tensor(buf, "buf");
  TORCH_CHECK(stdv >= 0.0 && stdv < 1e30, "bpclip_fast.philox_noise_: std must be finite and >= 0, got ", stdv);
}

}  // namespace bpclip
