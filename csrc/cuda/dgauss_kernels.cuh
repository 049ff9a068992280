// Device code of discrete_gaussian_ (bpclip_fast/discrete_gaussian.h): one thread per element over a
// grid-stride loop. The draw's loops take a different number of words per element, so the lanes of
// a warp diverge; each element still reads only its own words, so any grid gives the same bits.
#pragma once

#include <stdint.h>

#include "bpclip_fast/discrete_gaussian.h"

namespace bpclip {
namespace cuda {

constexpr int kDgThreads = 256;

__global__ void discrete_gaussian_kernel(long long* __restrict__ out, int64_t n, uint64_t seed, uint64_t offset,
                                         uint64_t sigma) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = discrete_gaussian(seed, offset, static_cast<uint64_t>(i), sigma);
  }
}

}  // namespace cuda
}  // namespace bpclip
