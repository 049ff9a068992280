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

void philox_noise_cuda(at::Tensor& buf, int64_t seed, int64_t offset, double stdv, bool accumulate, double scale) {
  check_noise_args(buf, stdv, scale);
  const int64_t n = buf.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(buf.device());
  // The stream is indexed by the contiguous (row-major) position, whatever the strides of buf.
  at::Tensor work = buf.is_contiguous() ? buf : buf.contiguous();
  const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, work.scalar_type(), "philox_noise_cuda", [&] {
    philox_noise_device(dev_ptr(work.mutable_data_ptr<scalar_t>()), n, static_cast<uint64_t>(seed),
                        static_cast<uint64_t>(offset), stdv, accumulate, sm_count, scale);
  });
  if (!work.is_same(buf)) buf.copy_(work);
}

// One launch for both buffers (noise_kernels.cuh, philox_noise2_kernel).
void philox_noise2_cuda(at::Tensor& w, at::Tensor& b, int64_t seed, int64_t offset, double stdv, bool accumulate_w,
                        bool accumulate_b, double scale) {
  check_noise2_args(w, b, stdv, scale);
  if (w.numel() == 0 && b.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(w.device());
  // The streams are indexed by the contiguous (row-major) positions, whatever the strides.
  at::Tensor ww = w.is_contiguous() ? w : w.contiguous();
  at::Tensor bw = b.is_contiguous() ? b : b.contiguous();
  const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ww.scalar_type(), "philox_noise2_cuda", [&] {
    philox_noise2_device(dev_ptr(ww.mutable_data_ptr<scalar_t>()), ww.numel(), dev_ptr(bw.mutable_data_ptr<scalar_t>()),
                         bw.numel(), static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                         stdv, accumulate_w, accumulate_b, sm_count, scale);
  });
  if (!ww.is_same(w)) w.copy_(ww);
  if (!bw.is_same(b)) b.copy_(bw);
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) {
  m.impl("philox_noise_", &cuda::philox_noise_cuda);
  m.impl("philox_noise2_", &cuda::philox_noise2_cuda);
}

}  // namespace bpclip
