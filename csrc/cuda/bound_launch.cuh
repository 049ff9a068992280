// The launch of exact_bound_ over raw device pointers, shared by the tensor launcher
// (bound_cuda.cu) and the test emulator; `launch` as in clip_launch.cuh.
#pragma once

#include <stdint.h>

#include "bound_kernels.cuh"

namespace bpclip {
namespace cuda {

constexpr int kBoundThreads = 128;  // 4 warps, 4 examples per block

template <typename T>
void exact_bound_device(const T* x, const T* g, const T* gb, const T* wa, const T* wb, const BoundGeometry& s,
                        const double* consts, double* sq, double* bound, unsigned long long* nonfinite) {
  BoundConstArray c;
  for (int k = 0; k < kBoundConsts; ++k) c.c[k] = consts[k];
  const int64_t per_block = kBoundThreads / kBoundLanes;
  launch(exact_bound_kernel<T>, (s.examples + per_block - 1) / per_block, kBoundThreads, x, g, gb, wa, wb, s, c, sq,
         bound, nonfinite);
}

}  // namespace cuda
}  // namespace bpclip
