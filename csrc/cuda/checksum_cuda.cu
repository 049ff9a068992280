// CUDA launcher of word_checksum: checks and the zeroed output. The launch is checksum_launch.cuh
// (shared with the test emulator), the kernel checksum_kernels.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checksum_args.h"
#include "launch.h"
// launch.h first: the launch sequence calls its launch().
#include "checksum_launch.cuh"

namespace bpclip {
namespace cuda {
namespace {

at::Tensor word_checksum_cuda(const at::Tensor& words) {
  const at::Tensor w = checked_words(words);
  const c10::cuda::CUDAGuard guard(w.device());
  at::Tensor out = at::zeros({}, w.options());
  const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // int64 storage; CUDA's 64-bit loads and atomicAdd take long long and unsigned long long.
  word_checksum_device(reinterpret_cast<const long long*>(w.const_data_ptr<int64_t>()), w.numel(),
                       reinterpret_cast<unsigned long long*>(out.mutable_data_ptr<int64_t>()), sm_count);
  return out;
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) { m.impl("word_checksum", &cuda::word_checksum_cuda); }

}  // namespace bpclip
