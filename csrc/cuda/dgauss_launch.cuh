// The launches of the integer-noise ops over raw device pointers, shared by the tensor launcher
// (dgauss_cuda.cu) and the test emulator. Declare `launch` first.
#pragma once

#include <stdint.h>

#include "dgauss_kernels.cuh"

namespace bpclip {
namespace cuda {

// One thread per element up to 16 resident blocks per SM; the grid-stride loop takes the rest.
inline void discrete_gaussian_device(long long* out, int64_t n, uint64_t seed, uint64_t offset, uint64_t sigma,
                                     int sm_count) {
  const int64_t wanted = (n + kDgThreads - 1) / kDgThreads;
  const int64_t cap = 16 * static_cast<int64_t>(sm_count > 0 ? sm_count : 1);
  launch(discrete_gaussian_kernel, wanted < cap ? wanted : cap, kDgThreads, out, n, seed, offset, sigma);
}

template <typename T>
void integer_release_device(T* buf, int64_t n, uint64_t seed, uint64_t offset, uint64_t first, double multiplier,
                            int grid_exp, uint64_t sigma, double scale, int sm_count) {
  const int64_t wanted = (n + kDgThreads - 1) / kDgThreads;
  const int64_t cap = 16 * static_cast<int64_t>(sm_count > 0 ? sm_count : 1);
  launch(integer_release_kernel<T>, wanted < cap ? wanted : cap, kDgThreads, buf, n, seed, offset, first,
         multiplier, grid_exp, sigma, scale);
}

}  // namespace cuda
}  // namespace bpclip
