// Device code of exact_bound_: one block of kBoundLanes threads per example, the arithmetic of
// bpclip_fast/bound.h (shared with the CPU kernel, which runs the lanes as a loop and combines them in
// the same order). Shared memory, barriers and warp shuffles, all of which the test emulator runs.
#pragma once

#include <stdint.h>

#include "bpclip_fast/bound.h"

namespace bpclip {
namespace cuda {

// The position sums of squares, precomputed by position_sums_kernel into xs and gs [rows, T].
struct BufferPositions {
  const double* xs;
  const double* gs;
  int64_t T;
  BPCLIP_HD double x_sq(int64_t r, int64_t t) const { return xs[r * T + t]; }
  BPCLIP_HD double g_sq(int64_t r, int64_t t) const { return gs[r * T + t]; }
};

// Every position sum of one call (position_sq: S parts, then their tree), x's into xs and g's into
// gs, [rows, T] each: blocks [0, x_blocks) take x, the rest g. A block's kBoundLanes threads take
// P = kBoundLanes / S positions, S threads (its parts) each. Which thread holds which part changes
// no sum: by_position (positions adjacent in memory: a Conv2d's transposed patches) puts a block's P
// positions on adjacent threads, part q of all of them on threads [qP, qP + P), so each load of a
// warp reads consecutive positions; otherwise (a Linear's rows, entries adjacent) a position's S
// parts are adjacent threads, reading adjacent entries. A separate launch from the bound kernel,
// whose one block per example left most of an H100 idle (docs/benchmarks.md).
template <typename T>
__global__ void __launch_bounds__(kBoundLanes) position_sums_kernel(const T* __restrict__ x, const T* __restrict__ g,
                                                                      BoundGeometry s, int64_t x_blocks, int split_x,
                                                                      int split_g, bool x_by_position,
                                                                      bool g_by_position, double* __restrict__ xs,
                                                                      double* __restrict__ gs) {
  __shared__ double parts[kBoundLanes];
  const bool is_x = blockIdx.x < x_blocks;
  const int S = is_x ? split_x : split_g;
  const int P = kBoundLanes / S;
  const bool by_position = is_x ? x_by_position : g_by_position;
  const int lane = threadIdx.x;
  const int q = by_position ? lane / P : lane & (S - 1);
  const int local = by_position ? lane % P : lane / S;
  const int stride = by_position ? P : 1;  // between the lanes of one position's parts q and q + 1
  const int64_t task = (is_x ? blockIdx.x : blockIdx.x - x_blocks) * static_cast<int64_t>(P) + local;
  const bool live = task < s.examples * s.per * s.T;
  double v = 0.0;
  if (live) {
    const int64_t r = task / s.T, t = task % s.T;
    v = is_x ? position_part(x + r * s.sx0 + t * s.sx1, s.dx, s.sx2, S, q)
             : position_part(g + r * s.sg0 + t * s.sg1, s.dg, s.sg2, S, q);
  }
  if (S > 1) {  // S is the same for the whole block: every thread reaches every barrier
    parts[lane] = v;
    __syncthreads();
    for (int off = S / 2; off > 0; off >>= 1) {
      if (q < off) parts[lane] += parts[lane + off * stride];
      __syncthreads();
    }
    v = parts[lane];
  }
  if (live && q == 0) (is_x ? xs : gs)[task] = v;
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

// sq[i], bound[i] for example i = blockIdx.x of s.examples (kBoundLanes threads each) from the
// position sums xs, gs (position_sums_kernel); nonfinite (may be null) += the examples whose bound is
// not finite.
template <typename T>
__global__ void __launch_bounds__(kBoundLanes) exact_bound_kernel(const double* __restrict__ xs, const double* __restrict__ gs, const T* __restrict__ gb,
                                   const T* __restrict__ wa,
                                   const T* __restrict__ wb, BoundGeometry s, BoundConstArray consts,
                                   double* __restrict__ sq, double* __restrict__ bound,
                                   unsigned long long* __restrict__ nonfinite) {
  __shared__ BoundShared sh;
  const int64_t i = blockIdx.x;
  const int lane = threadIdx.x;
  const double* c = consts.c;
  const BufferPositions pos{xs, gs, s.T};
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
