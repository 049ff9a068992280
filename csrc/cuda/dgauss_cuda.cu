// CUDA launchers of the integer-noise ops: checks and the contiguous copy. The launch is
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

void integer_release_cuda(at::Tensor& buf, int64_t seed, int64_t offset, int64_t first, double multiplier,
                          int64_t grid_exp, int64_t sigma, double scale) {
  check_integer_release_args(buf, first, multiplier, grid_exp, sigma, scale);
  if (buf.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(buf.device());
  at::Tensor work = buf.is_contiguous() ? buf : buf.contiguous();
  const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  AT_DISPATCH_FLOATING_TYPES(work.scalar_type(), "integer_release_cuda", [&] {
    integer_release_device(work.mutable_data_ptr<scalar_t>(), work.numel(), static_cast<uint64_t>(seed),
                           static_cast<uint64_t>(offset), static_cast<uint64_t>(first), multiplier,
                           static_cast<int>(grid_exp),
                           static_cast<uint64_t>(sigma), scale, sm_count);
  });
  if (!work.is_same(buf)) buf.copy_(work);
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) {
  m.impl("discrete_gaussian_", &cuda::discrete_gaussian_cuda);
  m.impl("integer_release_", &cuda::integer_release_cuda);
}

}  // namespace bpclip
