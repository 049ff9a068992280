// Device code of philox_noise_: the same Philox4x32-10 + Box-Muller as the CPU kernel (one header).
#pragma once

#include <stdint.h>

#include "bpclip_fast/philox.h"
#include "dtypes.cuh"

namespace bpclip {
namespace cuda {

// Thread i draws counter block i (four normals) and writes elements 4i..4i+3; grid-stride loop.
template <typename T>
__global__ void philox_noise_kernel(T* __restrict__ buf, int64_t n, uint64_t seed, uint64_t offset, float stdv,
                                    int accumulate) {
  const int64_t blocks = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t blk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; blk < blocks; blk += stride) {
    float z[4];
    philox_normal4(seed, offset, static_cast<uint64_t>(blk), z);
    const int64_t base = blk * 4;
    for (int l = 0; l < 4; ++l) {
      if (base + l >= n) break;
      const float v = stdv * z[l];
      buf[base + l] = accumulate ? from_acc<T>(to_acc(buf[base + l]) + v) : from_acc<T>(v);
    }
  }
}

}  // namespace cuda
}  // namespace bpclip
