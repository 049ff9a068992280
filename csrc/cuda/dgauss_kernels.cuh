// Device code of the integer-noise ops, discrete_gaussian_ (bpclip_fast/discrete_gaussian.h) and
// integer_release_ (bpclip_fast/integer_release.h): one thread per element over a grid-stride loop. The draw's loops take a different number of words per element, so the lanes of
// a warp diverge; each element still reads only its own words, so any grid gives the same bits.
#pragma once

#include <stdint.h>

#include "bpclip_fast/discrete_gaussian.h"
#include "bpclip_fast/integer_release.h"

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

// T: float or double; the value is computed in double and rounded to T once.
template <typename T>
__global__ void integer_release_kernel(T* __restrict__ buf, int64_t n, uint64_t seed, uint64_t offset, uint64_t first,
                                       double multiplier, int grid_exp, uint64_t sigma, double scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    buf[i] = static_cast<T>(integer_release_value(static_cast<double>(buf[i]), seed, offset,
                                                  first + static_cast<uint64_t>(i), multiplier, grid_exp, sigma, scale));
  }
}

}  // namespace cuda
}  // namespace bpclip
