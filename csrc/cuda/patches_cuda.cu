// CUDA launcher of conv_patches: checks and dtype dispatch; the launch is patches_launch.cuh
// (shared with the test emulator).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../patches_args.h"
#include "launch.h"
// launch.h first: the launch sequence calls its launch().
#include "patches_launch.cuh"

namespace bpclip {
namespace cuda {
namespace {

at::Tensor conv_patches_cuda(const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef dilation) {
  const PatchGeometry g = check_patches_args(x, kernel_size, stride, padding, dilation);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = patches_output(x, g);
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "conv_patches_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    conv_patches_device(dev_ptr(x.const_data_ptr<scalar_t>()), g, out.mutable_data_ptr<acc_t>());
  });
  return out;
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) { m.impl("conv_patches", &cuda::conv_patches_cuda); }

}  // namespace bpclip
