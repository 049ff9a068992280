// The argument checks of the integer-noise ops (discrete_gaussian_, integer_release_), shared by their
// CPU and CUDA launchers.
#pragma once

#include <ATen/ATen.h>

#include <cmath>

#include "bpclip_fast/discrete_gaussian.h"
#include "bpclip_fast/integer_release.h"

namespace bpclip {

// out: int64, any shape; element i is the draw of contiguous (row-major) position i. Every
// element's draw is its own (discrete_gaussian.h), so the positions must fit the stream's 2^56.
inline void check_discrete_gaussian_args(const at::Tensor& out, int64_t sigma) {
  TORCH_CHECK(out.scalar_type() == at::kLong, "bpclip_fast.discrete_gaussian_: out must be int64, got ",
              out.scalar_type());
  TORCH_CHECK(sigma >= 0 && static_cast<uint64_t>(sigma) <= kDgMaxSigma,
              "bpclip_fast.discrete_gaussian_: sigma must be an integer in [0, 2^52] (0: no noise), got ", sigma);
  TORCH_CHECK(out.numel() <= (int64_t{1} << 56), "bpclip_fast.discrete_gaussian_: out has ", out.numel(),
              " elements; the stream indexes at most 2^56");
}

// buf: float32 or float64 (the sums of float16/bfloat16 parameters are to be released from their
// float32 accumulators, before the rounding to the parameter's dtype).
inline void check_integer_release_args(const at::Tensor& buf, int64_t first, double multiplier, int64_t grid_exp,
                                       int64_t sigma, double scale) {
  TORCH_CHECK(buf.scalar_type() == at::kFloat || buf.scalar_type() == at::kDouble,
              "bpclip_fast.integer_release_: buf must be float32 or float64 (release a float16/bfloat16 "
              "parameter's sum from its float32 accumulator), got ", buf.scalar_type());
  TORCH_CHECK(std::isfinite(multiplier) && multiplier > 0, "bpclip_fast.integer_release_: multiplier must be "
              "finite and > 0, got ", multiplier);
  TORCH_CHECK(grid_exp >= -kReleaseMaxGridExp && grid_exp <= kReleaseMaxGridExp,
              "bpclip_fast.integer_release_: grid_exp must be in [-1000, 1000], got ", grid_exp);
  TORCH_CHECK(sigma >= 0 && static_cast<uint64_t>(sigma) <= kDgMaxSigma,
              "bpclip_fast.integer_release_: sigma must be an integer in [0, 2^52] (0: no noise), got ", sigma);
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "bpclip_fast.integer_release_: scale must be finite and > 0, got ",
              scale);
  TORCH_CHECK(first >= 0 && first <= (int64_t{1} << 56) && buf.numel() <= (int64_t{1} << 56) - first,
              "bpclip_fast.integer_release_: elements first .. first + numel (", first, " + ", buf.numel(),
              ") must lie in [0, 2^56], the stream's element range");
}

}  // namespace bpclip
