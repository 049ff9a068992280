// CUDA launcher of philox_noise_: checks and dtype dispatch. The launch itself is
// noise_launch.cuh (shared with the test emulator), the kernel noise_kernels.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common.h"
#include "launch.h"
// launch.h first: the launch sequence calls its launch().
#include "noise_launch.cuh"

namespace bpclip {
namespace cuda {
namespace {

void philox_noise_cuda(at::Tensor& buf, int64_t seed, int64_t offset, double stdv, bool accumulate) {
  check_noise_args(buf, stdv);
  const int64_t n = buf.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(buf.device());
  // The stream is indexed by the contiguous (row-major) position, whatever the strides of buf.
  at::Tensor work = buf.is_contiguous() ? buf : buf.contiguous();
  const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, work.scalar_type(), "philox_noise_cuda", [&] {
    philox_noise_device(dev_ptr(work.mutable_data_ptr<scalar_t>()), n, static_cast<uint64_t>(seed),
                        static_cast<uint64_t>(offset), static_cast<float>(stdv), accumulate, sm_count);
  });
  if (!work.is_same(buf)) buf.copy_(work);
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) { m.impl("philox_noise_", &cuda::philox_noise_cuda); }

}  // namespace bpclip
