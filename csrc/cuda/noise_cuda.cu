// CUDA launcher of philox_noise_; the kernel is in noise_kernels.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "../common.h"
#include "launch.h"
#include "noise_kernels.cuh"

namespace bpclip {
namespace cuda {
namespace {

constexpr int kThreads = 256;

void philox_noise_cuda(at::Tensor& buf, int64_t seed, int64_t offset, double stdv, bool accumulate) {
  check_noise_args(buf, stdv);
  const int64_t n = buf.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(buf.device());
  // The stream is indexed by the contiguous (row-major) position, whatever the strides of buf.
  at::Tensor work = buf.is_contiguous() ? buf : buf.contiguous();
  const int64_t blocks_needed = ((n + 3) / 4 + kThreads - 1) / kThreads;
  // Enough blocks to fill the device several times over; the kernel strides over the rest.
  const int64_t blocks = std::min<int64_t>(blocks_needed, 65536);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, work.scalar_type(), "philox_noise_cuda", [&] {
    using T = typename DeviceType<scalar_t>::type;
    launch(philox_noise_kernel<T>, blocks, kThreads, dev_ptr(work.mutable_data_ptr<scalar_t>()), n,
           static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), static_cast<float>(stdv), accumulate ? 1 : 0);
  });
  if (!work.is_same(buf)) buf.copy_(work);
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) { m.impl("philox_noise_", &cuda::philox_noise_cuda); }

}  // namespace bpclip
