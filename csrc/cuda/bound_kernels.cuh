// Device code of exact_bound_: one warp per example, the arithmetic of bpclip_fast/bound.h (shared
// with the CPU kernel, which runs the warp's lanes as a loop and combines them in the same order).
// Warp shuffles only, so the test emulator can run this exact kernel.
#pragma once

#include <stdint.h>

#include "bpclip_fast/bound.h"

namespace bpclip {
namespace cuda {

// The position sums of squares as the CUDA kernel takes them: each one read through the strides and
// summed where the lane needs it (position_sq; a Conv2d's patches [rows, d, T] are read transposed,
// sx1 = 1 and sx2 = T, so a warp's lanes read consecutive positions of one entry: coalesced).
template <typename T>
struct StridedPositions {
  const T* x;
  const T* g;
  int64_t dx, sx0, sx1, sx2, dg, sg0, sg1, sg2;
  BPCLIP_HD double x_sq(int64_t r, int64_t t) const { return position_sq(x + r * sx0 + t * sx1, dx, sx2); }
  BPCLIP_HD double g_sq(int64_t r, int64_t t) const { return position_sq(g + r * sg0 + t * sg1, dg, sg2); }
};

template <typename T>
BPCLIP_HD inline StridedPositions<T> strided_positions(const T* x, const T* g, const BoundGeometry& s) {
  return StridedPositions<T>{x, g, s.dx, s.sx0, s.sx1, s.sx2, s.dg, s.sg0, s.sg1, s.sg2};
}

__device__ inline LaneSums shfl_down_lanes(const LaneSums& v, int off) {
  LaneSums o;
  o.P = __shfl_down_sync(0xffffffffu, v.P, off);
  o.X = __shfl_down_sync(0xffffffffu, v.X, off);
  o.M = __shfl_down_sync(0xffffffffu, v.M, off);
  o.A = __shfl_down_sync(0xffffffffu, v.A, off);
  o.B = __shfl_down_sync(0xffffffffu, v.B, off);
  o.W = __shfl_down_sync(0xffffffffu, v.W, off);
  o.bias = __shfl_down_sync(0xffffffffu, v.bias, off);
  return o;
}

// consts: kBoundConsts doubles (bpclip_fast/bound.h), passed by value so no device copy is needed.
struct BoundConstArray {
  double c[kBoundConsts];
};

// sq[i], bound[i] for example i of s.examples (one warp each); nonfinite (may be null) += the
// examples whose bound is not finite.
template <typename T>
__global__ void exact_bound_kernel(const T* __restrict__ x, const T* __restrict__ g, const T* __restrict__ gb,
                                   const T* __restrict__ wa,
                                   const T* __restrict__ wb, BoundGeometry s, BoundConstArray consts,
                                   double* __restrict__ sq, double* __restrict__ bound,
                                   unsigned long long* __restrict__ nonfinite) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kBoundLanes;
  const int lane = threadIdx.x % kBoundLanes;
  if (i >= s.examples) return;  // whole warps leave together: the grid is counted in warps
  const double* c = consts.c;
  const StridedPositions<T> pos = strided_positions(x, g, s);
  ExampleSums e{0, 0, 0, 0, 0};
  for (int64_t k = 0; k < s.per; ++k) {
    LaneSums v = lane_sums(pos, gb, wa, wb, s, c, i * s.per + k, lane);
    for (int off = kBoundLanes / 2; off > 0; off >>= 1) add_lane(v, shfl_down_lanes(v, off));
    if (lane == 0) add_row(e, v, s, c);  // complete in lane 0
  }
  if (lane != 0) return;
  sq[i] = e.sq;
  const double b = example_bound(e, c);
  bound[i] = b;
  if (nonfinite != nullptr && !finite_bound(b)) atomicAdd(nonfinite, 1ull);
}

// factor[i], total[i] from bounds [L, B] (exact_factors; bpclip_fast/bound.h), one thread each.
template <typename fac_t>
__global__ void exact_factors_kernel(const double* __restrict__ bounds, int64_t L, int64_t B, double inflate,
                                     double bound_eff, int fn, double gamma, fac_t* __restrict__ factor,
                                     double* __restrict__ total, unsigned long long* __restrict__ nonfinite) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B) return;
  const double t = layers_total(bounds + i, L, B, inflate);
  total[i] = t;
  bool odd = false;
  factor[i] = static_cast<fac_t>(example_factor(t, sizeof(fac_t) == 8, bound_eff, fn, gamma, &odd));
  if (odd) atomicAdd(nonfinite, 1ull);
}

}  // namespace cuda
}  // namespace bpclip
