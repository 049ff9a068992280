// Device code of exact_bound_: one block of kBoundLanes threads per example, the arithmetic of
// bpclip_fast/bound.h (shared with the CPU kernel, which runs the lanes as a loop and combines them in
// the same order). Shared memory, barriers and warp shuffles, all of which the test emulator runs.
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

// The lanes' partial sums, one array per field (consecutive lanes in consecutive words).
struct BoundShared {
  double P[kBoundLanes], X[kBoundLanes], M[kBoundLanes], A[kBoundLanes], B[kBoundLanes], W[kBoundLanes],
      bias[kBoundLanes];
  __device__ void put(int l, const LaneSums& v) {
    P[l] = v.P; X[l] = v.X; M[l] = v.M; A[l] = v.A; B[l] = v.B; W[l] = v.W; bias[l] = v.bias;
  }
  __device__ LaneSums get(int l) const { return LaneSums{P[l], X[l], M[l], A[l], B[l], W[l], bias[l]}; }
};

// combine_lanes on the device: lane 0 returns the tree's total (the other lanes' results are unused).
// Levels off >= 32 pair lanes of different warps through shared memory; the last five are a warp's
// shuffle-down, v[l] += v[l + off] exactly as the host loop adds them.
__device__ inline LaneSums block_combine(LaneSums v, BoundShared& sh, int lane) {
  sh.put(lane, v);
  __syncthreads();
  for (int off = kBoundLanes / 2; off >= 32; off >>= 1) {
    if (lane < off) {
      LaneSums a = sh.get(lane);
      add_lane(a, sh.get(lane + off));
      sh.put(lane, a);
    }
    __syncthreads();
  }
  if (lane < 32) {
    v = sh.get(lane);
    for (int off = 16; off > 0; off >>= 1) add_lane(v, shfl_down_lanes(v, off));
  }
  __syncthreads();  // the next row's put waits for warp 0's reads
  return v;
}

// consts: kBoundConsts doubles (bpclip_fast/bound.h), passed by value so no device copy is needed.
struct BoundConstArray {
  double c[kBoundConsts];
};

// sq[i], bound[i] for example i = blockIdx.x of s.examples (kBoundLanes threads each); nonfinite
// (may be null) += the examples whose bound is not finite.
template <typename T>
__global__ void __launch_bounds__(kBoundLanes) exact_bound_kernel(const T* __restrict__ x, const T* __restrict__ g, const T* __restrict__ gb,
                                   const T* __restrict__ wa,
                                   const T* __restrict__ wb, BoundGeometry s, BoundConstArray consts,
                                   double* __restrict__ sq, double* __restrict__ bound,
                                   unsigned long long* __restrict__ nonfinite) {
  __shared__ BoundShared sh;
  const int64_t i = blockIdx.x;
  const int lane = threadIdx.x;
  const double* c = consts.c;
  const StridedPositions<T> pos = strided_positions(x, g, s);
  ExampleSums e{0, 0, 0, 0, 0};
  for (int64_t k = 0; k < s.per; ++k) {
    const LaneSums v = block_combine(lane_sums(pos, gb, wa, wb, s, c, i * s.per + k, lane), sh, lane);
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
