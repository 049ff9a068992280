// The launch of philox_noise_ over a raw device pointer, shared by the tensor launcher
// (noise_cuda.cu) and the test emulator. Declare `launch` first (launch.h or the emulator's).
#pragma once

#include <stdint.h>

#include "noise_kernels.cuh"

namespace bpclip {
namespace cuda {

// The kernel variant for buf: 16-byte packs only where buf is 16-byte aligned (a misaligned
// vector access faults on a GPU; a view such as t[1:] is misaligned). Any grid is correct: the
// kernel strides over its warp tiles. threads: a multiple of 32, at most kNoiseThreads.
template <typename T, bool kAccumulate>
void launch_philox_noise_as(T* buf, int64_t n, uint64_t seed, uint64_t offset, float stdv, int64_t blocks,
                            int threads) {
  if (reinterpret_cast<uintptr_t>(buf) % alignof(NoisePack<T>) == 0) {
    launch(philox_noise_kernel<T, kAccumulate, true>, blocks, threads, buf, n, seed, offset, stdv);
  } else {
    launch(philox_noise_kernel<T, kAccumulate, false>, blocks, threads, buf, n, seed, offset, stdv);
  }
}

template <typename T>
void launch_philox_noise(T* buf, int64_t n, uint64_t seed, uint64_t offset, float stdv, bool accumulate,
                         int64_t blocks, int threads) {
  if (accumulate) {
    launch_philox_noise_as<T, true>(buf, n, seed, offset, stdv, blocks, threads);
  } else {
    launch_philox_noise_as<T, false>(buf, n, seed, offset, stdv, blocks, threads);
  }
}

// sm_count: the device's multiprocessors. The grid is one resident wave (kNoiseBlocksPerSm blocks
// per SM, see noise_kernels.cuh), or fewer blocks where the buffer has fewer warp tiles (the tail
// counting as one): more blocks than that would only wait for a second wave, fewer would leave
// SMs idle while the kernel is compute-bound (Philox + Box-Muller, not the stores, set its speed).
template <typename T>
void philox_noise_device(T* buf, int64_t n, uint64_t seed, uint64_t offset, float stdv, bool accumulate,
                         int sm_count) {
  if (n <= 0) return;
  const int64_t tiles = (n + kNoiseTile - 1) / kNoiseTile;
  const int64_t warps_per_block = kNoiseThreads / kNoiseLanes;
  const int64_t blocks_needed = (tiles + warps_per_block - 1) / warps_per_block;
  const int64_t resident = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) * kNoiseBlocksPerSm;
  const int64_t blocks = blocks_needed < resident ? blocks_needed : resident;
  launch_philox_noise(buf, n, seed, offset, stdv, accumulate, blocks, kNoiseThreads);
}

}  // namespace cuda
}  // namespace bpclip
