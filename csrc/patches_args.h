// Validation of conv_patches' arguments and its geometry, shared by its CPU and CUDA kernels
// (the layout: bpclip_fast/patches.h; the caller: csrc/exact.cpp, conv2d_grad_norms).
#pragma once

#include <ATen/ATen.h>

#include "bpclip_fast/patches.h"
#include "common.h"
#include "host_cache.h"

namespace bpclip {

inline PatchGeometry check_patches_args(const at::Tensor& x, at::IntArrayRef k, at::IntArrayRef stride,
                                        at::IntArrayRef padding, at::IntArrayRef dilation) {
  constexpr const char* op = "bpclip_fast.conv_patches: ";
  check_float_tensor(x, "the input");
  TORCH_CHECK(x.dim() == 4, op, "the input must be [B, C, H, W], got ", x.sizes());
  TORCH_CHECK(k.size() == 2 && stride.size() == 2 && padding.size() == 2 && dilation.size() == 2, op,
              "kernel_size, stride, padding and dilation need two entries each");
  TORCH_CHECK(k[0] >= 1 && k[1] >= 1 && stride[0] >= 1 && stride[1] >= 1 && dilation[0] >= 1 && dilation[1] >= 1 &&
                  padding[0] >= 0 && padding[1] >= 0,
              op, "kernel_size, stride and dilation must be >= 1 and padding >= 0, got ", k, ", ", stride, ", ",
              dilation, ", ", padding);
  const int64_t h = x.size(2), w = x.size(3);
  const int64_t eh = dilation[0] * (k[0] - 1) + 1, ew = dilation[1] * (k[1] - 1) + 1;
  TORCH_CHECK(h + 2 * padding[0] >= eh && w + 2 * padding[1] >= ew, op, "the (dilated) kernel ", eh, "x", ew,
              " is larger than the padded input ", h + 2 * padding[0], "x", w + 2 * padding[1]);
  return PatchGeometry{x.size(0), x.size(1), h, w, k[0], k[1], stride[0], stride[1], padding[0], padding[1],
                       dilation[0], dilation[1], (h + 2 * padding[0] - eh) / stride[0] + 1,
                       (w + 2 * padding[1] - ew) / stride[1] + 1, x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
}

// The output: [B, C kh kw, T] in the accumulation dtype (fp64 for fp64 input, fp32 otherwise); the
// norms ops' scratch, dropped once a chunk's GEMM has read it.
inline at::Tensor patches_output(const at::Tensor& x, const PatchGeometry& g) {
  return host_empty({g.n, g.c * g.kh * g.kw, g.ho * g.wo},
                    x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat)
                        .memory_format(at::MemoryFormat::Contiguous),
                    /*scratch=*/true);
}

}  // namespace bpclip
