// Device code of norm_affine_example_grads: per example b and affine parameter d,
//   gw[b, d] = sum_r g * ((x - mean) * rstd),   gb[b, d] = sum_r g,
// over the R positions r that parameter d scales. The sum is split into K chunks of positions
// whose partial sums land in partial[k * O + o] (o = b * D + d, O = B * D; the gw partials first,
// then the gb ones), and a second kernel adds the chunks in order: a fixed summation order (no
// float atomics), so the result does not depend on the schedule. With K = 1 the first kernel
// writes the outputs directly. Accumulation in acc_t: fp32 for fp32/fp16/bf16, fp64 for fp64.
#pragma once

#include <stdint.h>

#include "clip_kernels.cuh"  // kWarpSize, warp_sum, min64
#include "dtypes.cuh"

namespace bpclip {
namespace cuda {

// LayerNorm, x viewed as [B, R, D]: the R positions of parameter d are D apart, so one thread
// takes one (chunk, b, d), and consecutive threads read consecutive d (coalesced). Thread i is
// partial i = k * O + o. The statistics are per row (b, r).
template <typename T, typename acc_t>
__global__ void ln_affine_partial_kernel(const T* __restrict__ g, const T* __restrict__ x,
                                         const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd, int64_t B,
                                         int64_t R, int64_t D, int64_t chunk, int64_t K, acc_t* __restrict__ pw,
                                         acc_t* __restrict__ pb) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t O = B * D;
  if (i >= K * O) return;
  const int64_t k = i / O;
  const int64_t o = i % O;
  const int64_t b = o / D;
  const int64_t d = o % D;
  const int64_t hi = min64((k + 1) * chunk, R);
  acc_t sw = 0, sb = 0;
  for (int64_t r = k * chunk; r < hi; ++r) {
    const int64_t row = b * R + r;
    const acc_t gv = to_acc(g[row * D + d]);
    sw += gv * ((to_acc(x[row * D + d]) - mean[row]) * rstd[row]);
    sb += gv;
  }
  pw[i] = sw;
  pb[i] = sb;
}

// GroupNorm, x viewed as [B, D, R] (D = channels, R = spatial size): the R positions of channel d
// are contiguous, so one warp takes one (chunk, b, d) and its lanes stride through the chunk. Warp
// w is partial w = k * O + o. The statistics are per (b, group of d), one pair per warp.
template <typename T, typename acc_t>
__global__ void gn_affine_partial_kernel(const T* __restrict__ g, const T* __restrict__ x,
                                         const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd, int64_t B,
                                         int64_t R, int64_t D, int64_t G, int64_t chunk, int64_t K,
                                         acc_t* __restrict__ pw, acc_t* __restrict__ pb) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t O = B * D;
  if (w >= K * O) return;  // whole warps leave together: K * O is counted in warps
  const int64_t k = w / O;
  const int64_t o = w % O;
  const int64_t stat = (o / D) * G + (o % D) / (D / G);
  const acc_t m = mean[stat], s = rstd[stat];
  const int64_t start = o * R + k * chunk;
  const int64_t len = min64(chunk, R - k * chunk);
  acc_t sw = 0, sb = 0;
  for (int64_t j = lane; j < len; j += kWarpSize) {
    const acc_t gv = to_acc(g[start + j]);
    sw += gv * ((to_acc(x[start + j]) - m) * s);
    sb += gv;
  }
  sw = warp_sum(sw);
  sb = warp_sum(sb);
  if (lane != 0) return;
  pw[w] = sw;
  pb[w] = sb;
}

// Thread i < O adds the K gw partials of output i, thread O + i the gb ones, chunk by chunk.
template <typename acc_t>
__global__ void affine_finalize_kernel(const acc_t* __restrict__ partial, int64_t O, int64_t K,
                                       acc_t* __restrict__ gw, acc_t* __restrict__ gb) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= 2 * O) return;
  const int64_t which = i / O;
  const int64_t o = i % O;
  const acc_t* p = partial + which * K * O + o;
  acc_t s = 0;
  for (int64_t k = 0; k < K; ++k) s += p[k * O];
  (which == 0 ? gw : gb)[o] = s;
}

}  // namespace cuda
}  // namespace bpclip
