// The launch of exact_bound_ over raw device pointers, shared by the tensor launcher
// (bound_cuda.cu) and the test emulator; `launch` as in clip_launch.cuh.
#pragma once

#include <stdint.h>

#include "bound_kernels.cuh"

namespace bpclip {
namespace cuda {

constexpr int kBoundThreads = 128;  // exact_factors_kernel's block; exact_bound_kernel's is kBoundLanes

// scratch: bound_scratch(s) doubles of device memory (the position sums).
inline int64_t bound_scratch(const BoundGeometry& s) { return 2 * s.examples * s.per * s.T; }

template <typename T>
void exact_bound_device(const T* x, const T* g, const T* gb, const T* wa, const T* wb, const BoundGeometry& s,
                        const double* consts, double* sq, double* bound, unsigned long long* nonfinite,
                        double* scratch) {
  BoundConstArray c;
  for (int k = 0; k < kBoundConsts; ++k) c.c[k] = consts[k];
  const int64_t positions = s.examples * s.per * s.T;
  const int split_x = position_split(s.dx), split_g = position_split(s.dg);
  const int64_t x_blocks = (positions * split_x + kBoundLanes - 1) / kBoundLanes;
  const int64_t g_blocks = (positions * split_g + kBoundLanes - 1) / kBoundLanes;
  double* xs = scratch;
  double* gs = scratch + positions;
  // Positions adjacent in memory (a Conv2d's transposed patches, or T = 1 rows) are read by adjacent threads.
  const bool x_by_position = s.sx1 == 1 && s.sx2 != 1, g_by_position = s.sg1 == 1 && s.sg2 != 1;
  launch(position_sums_kernel<T>, x_blocks + g_blocks, kBoundLanes, x, g, s, x_blocks, split_x, split_g,
         x_by_position, g_by_position, xs, gs);
  launch(exact_bound_kernel<T>, s.examples, kBoundLanes, xs, gs, gb, wa, wb, s, c, sq, bound, nonfinite);
}

template <typename fac_t>
void exact_factors_device(const double* bounds, int64_t L, int64_t B, double inflate, double bound_eff, int fn,
                          double gamma, fac_t* factor, double* total, unsigned long long* nonfinite) {
  launch(exact_factors_kernel<fac_t>, (B + kBoundThreads - 1) / kBoundThreads, kBoundThreads, bounds, L, B, inflate,
         bound_eff, fn, gamma, factor, total, nonfinite);
}

}  // namespace cuda
}  // namespace bpclip
