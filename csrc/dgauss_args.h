// The argument check of discrete_gaussian_, shared by its CPU and CUDA launchers.
#pragma once

#include <ATen/ATen.h>

#include "bpclip_fast/discrete_gaussian.h"

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

}  // namespace bpclip
