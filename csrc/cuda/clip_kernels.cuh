// Device code of clip_rows, scale_rows and clip_rows_backward. Layout of a reduction: see
// RowGeometry in bpclip_fast/rows.h (B rows, G groups of S elements, K chunks per group,
// partial[(b*G+g)*K+k]).
// One warp reduces one chunk; a second kernel turns each row's partials into its norm and factor
// (or its dot product); an elementwise kernel then scales. Warp shuffles only: no shared memory,
// no cub, no cooperative groups, so the test emulator can run these exact kernels.
#pragma once

#include <stdint.h>

#include "bpclip_fast/clip.h"
#include "bpclip_fast/rows.h"
#include "dtypes.cuh"

namespace bpclip {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr int kReduceChunk = 4096;  // elements per warp: 128 per lane
constexpr int kScaleTile = 4096;    // elements per block of the elementwise kernels

__device__ inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename acc_t>
__device__ inline acc_t warp_sum(acc_t v) {
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;  // complete in lane 0
}

// partial[w] for warp w = one chunk of one group of one row. `total` = B*G*K warps. Accumulates
// in double for every dtype (bpclip_fast/clip.h, step (a)). Mode kDot: partial[w] = x . y and
// partial[total + w] = x . x (the backward's two sums in one pass).
template <typename T, int Mode>
__global__ void row_partial_kernel(const T* __restrict__ x, const T* __restrict__ y, int64_t S, int64_t K,
                                   int64_t chunk, int64_t total, double* __restrict__ partial) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (w >= total) return;  // whole warps leave together: total is counted in warps
  const int64_t k = w % K;
  const int64_t start = (w / K) * S + k * chunk;
  const int64_t len = min64(chunk, S - k * chunk);
  double a = 0, q = 0;
  for (int64_t j = lane; j < len; j += kWarpSize) {
    const double v = to_f64(x[start + j]);
    if (Mode == kSumSquares) {
      a += v * v;
    } else if (Mode == kSumAbs) {
      a += v < 0.0 ? -v : v;
    } else {
      a += v * to_f64(y[start + j]);
      q += v * v;
    }
  }
  a = warp_sum(a);
  if (Mode == kDot) q = warp_sum(q);
  if (lane != 0) return;
  partial[w] = a;
  if (Mode == kDot) partial[total + w] = q;
}

// One warp per row: total = sum_g q(sum_k partial), q(a) = a^2 when square_groups (l15), in double.
// With want_factor, writes the norm sqrt(total) and the clip factor against the effective bound
// (stored as fac_t: the factor rounded toward zero), and counts non-finite rows; otherwise (the
// backward: G = 1, partial from kDot) writes the row's dot product to total_out[b] and its squared
// norm to total_out[B + b].
template <typename fac_t>
__global__ void finalize_rows_kernel(const double* __restrict__ partial, int64_t B, int64_t G, int64_t K,
                                     int square_groups, int want_factor, double bound_eff, int fn, double gamma,
                                     double* __restrict__ total_out, fac_t* __restrict__ norm,
                                     fac_t* __restrict__ factor, unsigned long long* __restrict__ nonfinite) {
  const int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (b >= B) return;
  double acc = 0;
  for (int64_t g = lane; g < G; g += kWarpSize) {
    const double* p = partial + (b * G + g) * K;
    double a = 0;
    for (int64_t k = 0; k < K; ++k) a += p[k];
    acc += square_groups ? a * a : a;
  }
  acc = warp_sum(acc);
  if (!want_factor) {
    double sq = 0;
    const double* p = partial + B * G * K;
    for (int64_t g = lane; g < G; g += kWarpSize)
      for (int64_t k = 0; k < K; ++k) sq += p[(b * G + g) * K + k];
    sq = warp_sum(sq);
    if (lane != 0) return;
    total_out[b] = acc;
    total_out[B + b] = sq;
    return;
  }
  if (lane != 0) return;
  const double n = sqrt(acc);
  norm[b] = static_cast<fac_t>(n);
  factor[b] = store_factor(clip_factor(n, bound_eff, fn, gamma), factor);
  if (!is_finite_norm(n)) atomicAdd(nonfinite, 1ull);
}

// A block's tile t: tile (t % tiles) of row (t / tiles), out = RZ(f * x) (bpclip_fast/clip.h).
// A zero factor writes zeros, never 0 * x. mask: f is 1 where factor > 0 and 0 otherwise (RZ(1 * x)
// = x: the row kept as it is, or zeros).
template <typename T, typename fac_t>
__device__ __forceinline__ void scale_tile(const T* __restrict__ x, const fac_t* __restrict__ factor, int64_t N,
                                           int64_t tiles, int64_t t, bool mask, T* __restrict__ out) {
  const int64_t b = t / tiles;
  const int64_t lo = b * N + (t % tiles) * kScaleTile;
  const int64_t hi = min64(lo + kScaleTile, (b + 1) * N);
  const fac_t f = mask ? (factor[b] > fac_t(0) ? fac_t(1) : fac_t(0)) : factor[b];
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    out[i] = f == fac_t(0) ? from_acc<T>(fac_t(0)) : scale_store(f, x[i]);
  }
}

template <typename T, typename fac_t>
__global__ void scale_rows_kernel(const T* __restrict__ x, const fac_t* __restrict__ factor, int64_t N,
                                  int64_t tiles, T* __restrict__ out) {
  scale_tile(x, factor, N, tiles, static_cast<int64_t>(blockIdx.x), false, out);
}

// Two row scalings in one launch (scale_rows2; clip_rows_rescale's scaling pass): blocks below
// x_blocks take x's tiles, the rest y's; mask_y as scale_tile's mask.
template <typename T, typename fac_t>
__global__ void scale_rows2_kernel(const T* __restrict__ x, const fac_t* __restrict__ fx, int64_t Nx, int64_t tiles_x,
                                   int64_t x_blocks, T* __restrict__ ox, const T* __restrict__ y,
                                   const fac_t* __restrict__ fy, int64_t Ny, int64_t tiles_y, int mask_y,
                                   T* __restrict__ oy) {
  const int64_t t = blockIdx.x;
  if (t < x_blocks) {
    scale_tile(x, fx, Nx, tiles_x, t, false, ox);
  } else {
    scale_tile(y, fy, Ny, tiles_y, t - x_blocks, mask_y != 0, oy);
  }
}

// grad_x = s g - c xc per row, c = rho (xc . g) / (xc . xc) (clip_jvp_coef in bpclip_fast/clip.h;
// sums[b], sums[B + b] = the dot product and the squared norm), in double, rounded once to fp32
// (fp64) and then to T: tile t (tile t % tiles of row t / tiles) of the output.
template <typename T, typename fac_t>
__device__ __forceinline__ void clip_jvp_tile(const T* __restrict__ g, const T* __restrict__ xc,
                                              const fac_t* __restrict__ factor, const fac_t* __restrict__ norm,
                                              const double* __restrict__ sums, double bound_eff, int fn, int64_t B,
                                              int64_t N, int64_t tiles, int64_t t, T* __restrict__ out) {
  const int64_t b = t / tiles;
  const int64_t lo = b * N + (t % tiles) * kScaleTile;
  const int64_t hi = min64(lo + kScaleTile, (b + 1) * N);
  const double s = factor[b];
  const double c = clip_jvp_coef(norm[b], s, bound_eff, fn, sums[b], sums[B + b]);
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    out[i] = s == 0.0 ? from_acc<T>(fac_t(0))
                      : from_acc<T>(static_cast<fac_t>(s * to_f64(g[i]) - c * to_f64(xc[i])));
  }
}

template <typename T, typename fac_t>
__global__ void clip_jvp_kernel(const T* __restrict__ g, const T* __restrict__ xc, const fac_t* __restrict__ factor,
                                const fac_t* __restrict__ norm, const double* __restrict__ sums, double bound_eff,
                                int fn, int64_t B, int64_t N, int64_t tiles, T* __restrict__ out) {
  clip_jvp_tile(g, xc, factor, norm, sums, bound_eff, fn, B, N, tiles, static_cast<int64_t>(blockIdx.x), out);
}

}  // namespace cuda
}  // namespace bpclip
