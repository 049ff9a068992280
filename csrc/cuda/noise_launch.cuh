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
void launch_philox_noise_as(T* buf, int64_t n, uint64_t seed, uint64_t offset, double stdv, double scale,
                            int64_t blocks, int threads) {
  if (reinterpret_cast<uintptr_t>(buf) % alignof(NoisePack<T>) == 0) {
    launch(philox_noise_kernel<T, kAccumulate, true>, blocks, threads, buf, n, seed, offset, stdv, scale);
  } else {
    launch(philox_noise_kernel<T, kAccumulate, false>, blocks, threads, buf, n, seed, offset, stdv, scale);
  }
}

// scale: the stored values times scale where it is not 1 (noise_kernels.cuh, NoiseScale).
template <typename T>
void launch_philox_noise(T* buf, int64_t n, uint64_t seed, uint64_t offset, double stdv, bool accumulate,
                         int64_t blocks, int threads, double scale = 1.0) {
  if (accumulate) {
    launch_philox_noise_as<T, true>(buf, n, seed, offset, stdv, scale, blocks, threads);
  } else {
    launch_philox_noise_as<T, false>(buf, n, seed, offset, stdv, scale, blocks, threads);
  }
}

// sm_count: the device's multiprocessors. The grid is one resident wave (kNoiseBlocksPerSm blocks
// per SM, see noise_kernels.cuh), or fewer blocks where the buffer has fewer warp tiles (the tail
// counting as one): more blocks than that would only wait for a second wave, fewer would leave
// SMs idle while the kernel is compute-bound (Philox + Box-Muller, not the stores, set its speed).
template <typename T>
void philox_noise_device(T* buf, int64_t n, uint64_t seed, uint64_t offset, double stdv, bool accumulate,
                         int sm_count, double scale = 1.0) {
  if (n <= 0) return;
  const int64_t tiles = (n + kNoiseTile - 1) / kNoiseTile;
  const int64_t warps_per_block = kNoiseThreads / kNoiseLanes;
  const int64_t blocks_needed = (tiles + warps_per_block - 1) / warps_per_block;
  const int64_t resident = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) * kNoiseBlocksPerSm;
  const int64_t blocks = blocks_needed < resident ? blocks_needed : resident;
  launch_philox_noise(buf, n, seed, offset, stdv, accumulate, blocks, kNoiseThreads, scale);
}

template <typename T, bool kAccW, bool kPackedW>
void launch_philox_noise2_as(T* w, int64_t nw, T* b, int64_t nb, uint64_t seed, uint64_t offset_w, uint64_t offset_b,
                             double stdv, double scale, bool accumulate_b, int64_t blocks, int threads) {
  if (accumulate_b) {
    launch(philox_noise2_kernel<T, kAccW, kPackedW, true>, blocks, threads, w, nw, b, nb, seed, offset_w, offset_b,
           stdv, scale);
  } else {
    launch(philox_noise2_kernel<T, kAccW, kPackedW, false>, blocks, threads, w, nw, b, nb, seed, offset_w, offset_b,
           stdv, scale);
  }
}

// w at stream offset, b at offset + 1 (the counter word wraps as an unsigned 64-bit integer, as the
// CPU op's does): the streams of philox_noise_(w, offset) and philox_noise_(b, offset + 1).
template <typename T>
void launch_philox_noise2(T* w, int64_t nw, T* b, int64_t nb, uint64_t seed, uint64_t offset, double stdv,
                          bool accumulate_w, bool accumulate_b, int64_t blocks, int threads, double scale = 1.0) {
  const uint64_t offset_b = offset + 1u;
  const bool packed = reinterpret_cast<uintptr_t>(w) % alignof(NoisePack<T>) == 0;
  if (accumulate_w) {
    if (packed) {
      launch_philox_noise2_as<T, true, true>(w, nw, b, nb, seed, offset, offset_b, stdv, scale, accumulate_b, blocks, threads);
    } else {
      launch_philox_noise2_as<T, true, false>(w, nw, b, nb, seed, offset, offset_b, stdv, scale, accumulate_b, blocks, threads);
    }
  } else {
    if (packed) {
      launch_philox_noise2_as<T, false, true>(w, nw, b, nb, seed, offset, offset_b, stdv, scale, accumulate_b, blocks, threads);
    } else {
      launch_philox_noise2_as<T, false, false>(w, nw, b, nb, seed, offset, offset_b, stdv, scale, accumulate_b,
                                               blocks, threads);
    }
  }
}

// The grid as philox_noise_device's for the two buffers' warp tiles together (each tail counting as one).
template <typename T>
void philox_noise2_device(T* w, int64_t nw, T* b, int64_t nb, uint64_t seed, uint64_t offset, double stdv,
                          bool accumulate_w, bool accumulate_b, int sm_count, double scale = 1.0) {
  if (nw <= 0 && nb <= 0) return;
  const int64_t tiles = (nw + kNoiseTile - 1) / kNoiseTile + (nb + kNoiseTile - 1) / kNoiseTile;
  const int64_t warps_per_block = kNoiseThreads / kNoiseLanes;
  const int64_t blocks_needed = (tiles + warps_per_block - 1) / warps_per_block;
  const int64_t resident = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) * kNoiseBlocksPerSm;
  const int64_t blocks = blocks_needed < resident ? blocks_needed : resident;
  launch_philox_noise2(w, nw, b, nb, seed, offset, stdv, accumulate_w, accumulate_b, blocks, kNoiseThreads, scale);
}

}  // namespace cuda
}  // namespace bpclip
