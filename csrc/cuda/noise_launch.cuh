// The launch of philox_noise_ over a raw device pointer, shared by the tensor launcher
// (noise_cuda.cu) and the test emulator. Declare `launch` first (launch.h or the emulator's).
#pragma once

#include <stdint.h>

#include "noise_kernels.cuh"

namespace bpclip {
namespace cuda {

constexpr int kNoiseThreads = 256;
// Enough blocks to fill any device several times over; the kernel strides over the rest.
constexpr int64_t kMaxNoiseBlocks = 65536;

template <typename T>
void philox_noise_device(T* buf, int64_t n, uint64_t seed, uint64_t offset, float stdv, bool accumulate) {
  if (n <= 0) return;
  const int64_t groups = (n + kNormalsPerGroup - 1) / kNormalsPerGroup;
  const int64_t blocks_needed = (groups + kNoiseThreads - 1) / kNoiseThreads;
  const int64_t blocks = blocks_needed < kMaxNoiseBlocks ? blocks_needed : kMaxNoiseBlocks;
  launch(philox_noise_kernel<T>, blocks, kNoiseThreads, buf, n, seed, offset, stdv, accumulate ? 1 : 0);
}

}  // namespace cuda
}  // namespace bpclip
