// Argument checks of examples_bound and examples_release (csrc/cpu/examples_cpu.cpp and
// csrc/cuda/examples_cuda.cu; the arithmetic: bpclip_fast/examples.h).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "common.h"
#include "bpclip_fast/examples.h"

namespace bpclip {

// B examples, each with Nw weight and Nb bias values (Nb = 0 without a bias tensor).
struct ExamplesShape {
  int64_t B, Nw, Nb;
};

struct ExamplesArgs {
  at::Tensor w, b;  // contiguous, or undefined where not given
  at::Tensor like;  // the first one given (dtype, device)
  ExamplesShape s;
};

inline int64_t row_numel(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t i = 1; i < t.dim(); ++i) n *= t.size(i);
  return n;
}

// weight, bias: [B, *] per-example values of one dtype and device (either may be absent, not both).
inline ExamplesArgs check_examples_args(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                        const char* op) {
  const std::string pre = std::string("bpclip_fast.") + op + ": ";
  TORCH_CHECK(weight.has_value() || bias.has_value(), pre, "needs the weight's or the bias's per-example values");
  ExamplesArgs a;
  a.like = weight.has_value() ? *weight : *bias;
  check_float_tensor(a.like, weight.has_value() ? "weight" : "bias");
  TORCH_CHECK(a.like.dim() >= 1, pre, "the per-example values need a batch dimension");
  if (weight.has_value() && bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == weight->scalar_type(), pre, "bias is ", bias->scalar_type(), " but weight is ",
                weight->scalar_type());
    check_same_device(*weight, *bias, "weight", "bias");
    TORCH_CHECK(bias->dim() >= 1 && bias->size(0) == weight->size(0), pre, "bias has shape ", bias->sizes(),
                " but weight has ", weight->size(0), " examples");
  }
  if (weight.has_value()) a.w = weight->contiguous();
  if (bias.has_value()) a.b = bias->contiguous();
  a.s.B = a.like.size(0);
  a.s.Nw = a.w.defined() ? row_numel(a.w) : 0;
  a.s.Nb = a.b.defined() ? row_numel(a.b) : 0;
  TORCH_CHECK(a.s.Nw + a.s.Nb < kMaxExampleEntries, pre, "an example has ", a.s.Nw + a.s.Nb,
              " values; the bound's proof covers fewer than 2^39");
  return a;
}

struct ReleaseNoise {
  uint64_t seed, offset;
  double stdv;  // rounded to float only for the float normals (a float64 release draws in double)
};

inline ReleaseNoise check_release_args(const ExamplesArgs& a, const at::Tensor& factor, at::IntArrayRef noise_key,
                                       double noise_std, double scale) {
  constexpr const char* pre = "bpclip_fast.examples_release: ";
  check_same_device(a.like, factor, "the per-example values", "factor");
  TORCH_CHECK(factor.dim() == 1 && factor.numel() == a.s.B, pre, "factor needs ", a.s.B,
              " entries (one per example), got shape ", factor.sizes());
  TORCH_CHECK(factor.scalar_type() == acc_type_of(a.like), pre, "factor must be ", acc_type_of(a.like), " for ",
              a.like.scalar_type(), " values, got ", factor.scalar_type());
  TORCH_CHECK(noise_key.size() == 2, pre, "noise_key must be [seed, offset]");
  TORCH_CHECK(noise_std_ok(noise_std), pre, "noise_std must be " BPCLIP_NOISE_STD_RULE ", got ", noise_std);
  TORCH_CHECK(scale > 0.0 && scale < 1e30, pre, "scale must be finite and > 0 (below 1e30, as every noise op's), got ",
              scale);
  return {static_cast<uint64_t>(noise_key[0]), static_cast<uint64_t>(noise_key[1]), noise_std};
}

}  // namespace bpclip
