// The launch sequence of layer_tail_ over raw device pointers, shared by the tensor launcher
// (tail_cuda.cu) and the test emulator. Declare `launch` first (launch.h or the emulator's).
#pragma once

#include <stdint.h>

#include "clip_launch.cuh"
#include "tail_kernels.cuh"

namespace bpclip {
namespace cuda {

// g == nullptr: no VJP (r unused, partial and sums may be null); sum_rows: b is first set to the
// column sums of rows [R, nb] (R may be 0, rows then null: b becomes zeros), else noised as it holds. partial and sums: backward_partial_count(r) and backward_sums_count(r) doubles. The weight's
// blocks as philox_noise_device's grid for w alone (one resident wave at most).
template <typename T, typename A>
void layer_tail_device(A* w, int64_t nw, A* b, int64_t nb, bool sum_rows, const A* rows, int64_t R, uint64_t seed, uint64_t offset,
                       double stdv, bool draw, double scale, const T* g, const T* xc, const A* factor, const A* norm,
                       const RowGeometry& r, double bound, int fn, double* partial, double* sums, T* out,
                       int sm_count) {
  int64_t jvp_blocks = 0, tiles = 0;
  double bound_eff = 0.0;
  if (g != nullptr && r.B > 0) {
    bound_eff = effective_bound(bound, r.N);  // the bound the forward applied
    reduce_rows<T, A>(xc, g, r, kDot, false, false, bound_eff, fn, 0.0, partial, sums, static_cast<A*>(nullptr),
                      static_cast<A*>(nullptr), static_cast<unsigned long long*>(nullptr));
    tiles = (r.N + kScaleTile - 1) / kScaleTile;
    jvp_blocks = r.B * tiles;
  }
  const bool touch = draw || scale != 1.0;
  const int64_t bias_blocks = nb > 0 && (touch || sum_rows) ? (nb + kTailColumns - 1) / kTailColumns : 0;
  int64_t noise_blocks = 0;
  if (nw > 0 && touch) {
    const int64_t tiles_w = (nw + kNoiseTile - 1) / kNoiseTile;
    const int64_t warps_per_block = kNoiseThreads / kNoiseLanes;
    const int64_t needed = (tiles_w + warps_per_block - 1) / warps_per_block;
    const int64_t resident = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) * kNoiseBlocksPerSm;
    noise_blocks = needed < resident ? needed : resident;
  }
  const int64_t blocks = jvp_blocks + bias_blocks + noise_blocks;
  const uint64_t offset_b = offset + 1u;  // wraps as an unsigned counter word, as the CPU op's
  if (reinterpret_cast<uintptr_t>(w) % alignof(NoisePack<A>) == 0) {
    launch(layer_tail_kernel<T, A, true>, blocks, kNoiseThreads, w, nw, b, nb, sum_rows ? 1 : 0, rows, R, seed, offset,
           offset_b, stdv, draw ? 1 : 0, scale, g, xc, factor, norm, static_cast<const double*>(sums), bound_eff, fn, r.B, r.N, tiles,
           out, jvp_blocks, bias_blocks);
  } else {
    launch(layer_tail_kernel<T, A, false>, blocks, kNoiseThreads, w, nw, b, nb, sum_rows ? 1 : 0, rows, R, seed,
           offset, offset_b, stdv, draw ? 1 : 0, scale, g, xc, factor, norm, static_cast<const double*>(sums), bound_eff, fn, r.B, r.N,
           tiles, out, jvp_blocks, bias_blocks);
  }
}

}  // namespace cuda
}  // namespace bpclip
