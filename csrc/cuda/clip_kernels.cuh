// Device code of clip_rows and clip_rows_backward. Layout of a reduction: see RowGeometry in
// csrc/common.h (B rows, G groups of S elements, K chunks per group, partial[(b*G+g)*K+k]).
// One warp reduces one chunk; a second kernel turns each row's partials into its norm and factor
// (or its dot product); an elementwise kernel then scales. Warp shuffles only: no shared memory,
// no cub, no cooperative groups, so the test emulator can run these exact kernels.
#pragma once

#include <stdint.h>

#include "bpclip_fast/clip.h"
#include "dtypes.cuh"

namespace bpclip {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr int kReduceChunk = 4096;  // elements per warp: 128 per lane
constexpr int kScaleTile = 4096;    // elements per block of the elementwise kernels

enum ReduceMode : int { kSumSquares = 0, kSumAbs = 1, kDot = 2 };

__device__ inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename acc_t>
__device__ inline acc_t warp_sum(acc_t v) {
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;  // complete in lane 0
}

// partial[w] for warp w = one chunk of one group of one row. `total` = B*G*K warps.
template <typename T, typename acc_t, int Mode>
__global__ void row_partial_kernel(const T* __restrict__ x, const T* __restrict__ y, int64_t S, int64_t K,
                                   int64_t chunk, int64_t total, acc_t* __restrict__ partial) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (w >= total) return;  // whole warps leave together: total is counted in warps
  const int64_t k = w % K;
  const int64_t start = (w / K) * S + k * chunk;
  const int64_t len = min64(chunk, S - k * chunk);
  acc_t a = 0;
  for (int64_t j = lane; j < len; j += kWarpSize) {
    const acc_t v = to_acc(x[start + j]);
    if (Mode == kSumSquares) {
      a += v * v;
    } else if (Mode == kSumAbs) {
      a += v < acc_t(0) ? -v : v;
    } else {
      a += v * to_acc(y[start + j]);
    }
  }
  a = warp_sum(a);
  if (lane == 0) partial[w] = a;
}

// One warp per row: total = sum_g q(sum_k partial), q(a) = a^2 when square_groups (l15).
// With want_factor, writes norm = sqrt(total), the clip factor, and counts non-finite rows;
// otherwise writes the total itself (a dot product).
template <typename acc_t>
__global__ void finalize_rows_kernel(const acc_t* __restrict__ partial, int64_t B, int64_t G, int64_t K,
                                     int square_groups, int want_factor, acc_t bound, int fn, acc_t gamma,
                                     acc_t* __restrict__ norm_or_total, acc_t* __restrict__ factor,
                                     unsigned long long* __restrict__ nonfinite) {
  const int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (b >= B) return;
  acc_t acc = 0;
  for (int64_t g = lane; g < G; g += kWarpSize) {
    const acc_t* p = partial + (b * G + g) * K;
    acc_t a = 0;
    for (int64_t k = 0; k < K; ++k) a += p[k];
    acc += square_groups ? a * a : a;
  }
  acc = warp_sum(acc);
  if (lane != 0) return;
  if (!want_factor) {
    norm_or_total[b] = acc;
    return;
  }
  const acc_t n = acc_sqrt(acc);
  norm_or_total[b] = n;
  factor[b] = clip_factor<acc_t>(n, bound, fn, gamma);
  if (!is_finite_norm(n)) atomicAdd(nonfinite, 1ull);
}

// Block t handles tile (t % tiles) of row (t / tiles). A zero factor writes zeros, never 0 * x.
template <typename T, typename acc_t>
__global__ void scale_rows_kernel(const T* __restrict__ x, const acc_t* __restrict__ factor, int64_t N,
                                  int64_t tiles, T* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int64_t b = t / tiles;
  const int64_t lo = b * N + (t % tiles) * kScaleTile;
  const int64_t hi = min64(lo + kScaleTile, (b + 1) * N);
  const acc_t f = factor[b];
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    out[i] = f == acc_t(0) ? from_acc<T>(acc_t(0)) : from_acc<T>(to_acc(x[i]) * f);
  }
}

// grad_x = s g - kappa (xc . g) xc per row (see clip_jvp_kappa in bpclip_fast/clip.h).
template <typename T, typename acc_t>
__global__ void clip_jvp_kernel(const T* __restrict__ g, const T* __restrict__ xc, const acc_t* __restrict__ factor,
                                const acc_t* __restrict__ norm, const acc_t* __restrict__ dot, acc_t bound, int fn,
                                int64_t N, int64_t tiles, T* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int64_t b = t / tiles;
  const int64_t lo = b * N + (t % tiles) * kScaleTile;
  const int64_t hi = min64(lo + kScaleTile, (b + 1) * N);
  const acc_t s = factor[b];
  const acc_t c = clip_jvp_kappa<acc_t>(norm[b], s, bound, fn) * dot[b];
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    out[i] = s == acc_t(0) ? from_acc<T>(acc_t(0)) : from_acc<T>(s * to_acc(g[i]) - c * to_acc(xc[i]));
  }
}

}  // namespace cuda
}  // namespace bpclip
