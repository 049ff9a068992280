// Device code of philox_noise_: the same Philox4x32-10 + Box-Muller as the CPU kernel (one header).
#pragma once

#include <stdint.h>

#include "bpclip_fast/philox.h"
#include "dtypes.cuh"

namespace bpclip {
namespace cuda {

// Thread i draws group i (three counter blocks, eight normals) and writes elements 8i..8i+7;
// grid-stride loop.
template <typename T>
__global__ void philox_noise_kernel(T* __restrict__ buf, int64_t n, uint64_t seed, uint64_t offset, float stdv,
                                    int accumulate) {
  const int64_t groups = (n + kNormalsPerGroup - 1) / kNormalsPerGroup;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t grp = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; grp < groups; grp += stride) {
    float z[kNormalsPerGroup];
    philox_normal8(seed, offset, static_cast<uint64_t>(grp), z);
    const int64_t base = grp * kNormalsPerGroup;
    for (int l = 0; l < kNormalsPerGroup; ++l) {
      if (base + l >= n) break;
      const float v = stdv * z[l];
      buf[base + l] = accumulate ? from_acc<T>(to_acc(buf[base + l]) + v) : from_acc<T>(v);
    }
  }
}

}  // namespace cuda
}  // namespace bpclip
