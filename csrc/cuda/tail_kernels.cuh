// Device code of layer_tail_ (bpclip_fast/tail.h): one launch, three jobs by block range: the
// input clipping's VJP tiles (clip_jvp_tile, after clip_rows_backward's two reduction launches),
// the bias' column blocks (its sum over the rows where asked, then its noise), the weight's noise
// (philox_noise_tiles over the remaining blocks, numbered as in a launch of their own). Each block
// has one role, so the bias blocks' __syncthreads is uniform.
#pragma once

#include <stdint.h>

#include "bpclip_fast/tail.h"
#include "clip_kernels.cuh"
#include "noise_kernels.cuh"

namespace bpclip {
namespace cuda {

constexpr int kTailColumns = kNoiseLanes;  // bias columns per block: one per lane
static_assert(kNoiseThreads / kNoiseLanes == kTailSlices, "a tail block's warps are the bias sum's slices");

// The weight's or bias' element i: noised as philox_noise_(accumulate) gives it where draw, else
// only scaled (as mul_(scale) would, std 0).
template <typename A>
__device__ __forceinline__ A tail_value(A old, uint64_t seed, uint64_t offset, int64_t i, double stdv, int draw,
                                        const NoiseScale& s) {
  if (draw) {
    normal_t<A> z[kNormalsPerGroup];
    philox_normal8(seed, offset, static_cast<uint64_t>(i / kNormalsPerGroup), z);
    return noise_store_value<A, true>(old, z[i % kNormalsPerGroup], static_cast<normal_t<A>>(stdv), s);
  }
  return s.on ? from_acc<A>(to_acc(old) * static_cast<A>(s.scale)) : old;
}

// Columns block * 32 .. + 31 of b: with sum_rows, warp k sums rows k, k + 8, ... of its lane's column
// (each load a coalesced row segment) and warp 0 adds the 8 slices in order (tail.h), so b's old
// value is never read (R = 0: zeros; an empty tensor's pointer is null, so "sum the rows" is a flag
// of its own, never `rows != nullptr`: review 38 F1); then warp 0 stores the noised value.
template <typename A>
__device__ __forceinline__ void tail_bias_block(A* __restrict__ b, int64_t nb, int sum_rows, const A* __restrict__ rows,
                                                int64_t R, int64_t block, uint64_t seed, uint64_t offset_b, double stdv,
                                                int draw, const NoiseScale& s, double (*slices)[kTailColumns]) {
  const int lane = static_cast<int>(threadIdx.x) % kNoiseLanes;
  const int slice = static_cast<int>(threadIdx.x) / kNoiseLanes;
  const int64_t j = block * kTailColumns + lane;
  if (sum_rows) {
    double acc = 0.0;
    if (j < nb) {
      for (int64_t r = slice; r < R; r += kTailSlices) acc += to_f64(rows[r * nb + j]);
    }
    slices[slice][lane] = acc;
    __syncthreads();
  }
  if (slice != 0 || j >= nb) return;
  A old;
  if (sum_rows) {
    double total = 0.0;
    for (int k = 0; k < kTailSlices; ++k) total += slices[k][lane];
    old = static_cast<A>(total);
  } else {
    old = b[j];
  }
  b[j] = tail_value(old, seed, offset_b, j, stdv, draw, s);
}

// T: the data dtype (the VJP's), A: the accumulation dtype (the gradients' and the factors').
template <typename T, typename A, bool kPackedW>
__global__ void __launch_bounds__(kNoiseThreads, kNoiseBlocksPerSm)
    layer_tail_kernel(A* __restrict__ w, int64_t nw, A* __restrict__ b, int64_t nb, int sum_rows,
                      const A* __restrict__ rows, int64_t R, uint64_t seed, uint64_t offset_w, uint64_t offset_b, double stdv, int draw,
                      double scale, const T* __restrict__ g, const T* __restrict__ xc, const A* __restrict__ factor,
                      const A* __restrict__ norm, const double* __restrict__ sums, double bound_eff, int fn,
                      int64_t B, int64_t N, int64_t tiles, T* __restrict__ out, int64_t jvp_blocks,
                      int64_t bias_blocks) {
  __shared__ NoiseStage<A> stage_of_warp;
  __shared__ double slices[kTailSlices][kTailColumns];
  const NoiseScale s{scale, scale != 1.0};
  const int64_t block = blockIdx.x;
  if (block < jvp_blocks) {
    clip_jvp_tile(g, xc, factor, norm, sums, bound_eff, fn, B, N, tiles, block, out);
    return;
  }
  if (block < jvp_blocks + bias_blocks) {
    tail_bias_block(b, nb, sum_rows, rows, R, block - jvp_blocks, seed, offset_b, stdv, draw, s, slices);
    return;
  }
  const int64_t first = jvp_blocks + bias_blocks;
  const int64_t per_block = kNoiseThreads / kNoiseLanes;
  const int in_block = static_cast<int>(threadIdx.x) / kNoiseLanes;
  const int lane = static_cast<int>(threadIdx.x) % kNoiseLanes;
  const int64_t warp = (block - first) * per_block + in_block;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) - first) * per_block;
  if (draw) {
    philox_noise_tiles<A, true, kPackedW>(w, nw, seed, offset_w, stdv, s, warp, warps, lane,
                                          stage_of_warp[in_block]);
  } else {
    for (int64_t i = warp * kNoiseLanes + lane; i < nw; i += warps * kNoiseLanes) {
      w[i] = tail_value(w[i], seed, offset_w, i, stdv, 0, s);
    }
  }
}

}  // namespace cuda
}  // namespace bpclip
