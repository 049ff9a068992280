// CUDA launcher of discrete_gaussian_: checks and the contiguous copy. The launch is
// dgauss_launch.cuh (shared with the test emulator), the kernel dgauss_kernels.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../dgauss_args.h"
#include "launch.h"
// launch.h first: the launch sequence calls its launch().
#include "dgauss_launch.cuh"

namespace bpclip {
namespace cuda {
namespace {

void discrete_gaussian_cuda(at::Tensor& out, int64_t seed, int64_t offset, int64_t sigma) {
  check_discrete_gaussian_args(out, sigma);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  at::Tensor work = out.is_contiguous() ? out : out.contiguous();
  const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // int64 storage; CUDA's 64-bit type is long long.
  discrete_gaussian_device(reinterpret_cast<long long*>(work.mutable_data_ptr<int64_t>()), work.numel(),
                           static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), static_cast<uint64_t>(sigma),
                           sm_count);
  if (!work.is_same(out)) out.copy_(work);
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) { m.impl("discrete_gaussian_", &cuda::discrete_gaussian_cuda); }

}  // namespace bpclip
