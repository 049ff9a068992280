// The launch sequences of clip_rows and clip_rows_backward over raw device pointers: block counts,
// kernel order and workspace. The tensor launchers (clip_cuda.cu) and the test emulator
// (tests/emulator) both run exactly these. `launch(kernel, blocks, threads, args...)` must be
// declared before this header: launch.h in the build, the emulator's in the tests.
#pragma once

#include <stdint.h>

#include "bpclip_fast/rows.h"
#include "clip_kernels.cuh"

namespace bpclip {
namespace cuda {

constexpr int kClipThreads = 256;
constexpr int64_t kWarpsPerBlock = kClipThreads / kWarpSize;

inline int64_t warp_blocks(int64_t warps) { return (warps + kWarpsPerBlock - 1) / kWarpsPerBlock; }

// Entries of the acc_t workspace that reduce_rows needs.
inline int64_t partial_count(const RowGeometry& r) { return r.B * r.G * r.K; }

// Partial sums of one reduction mode, then the per-row finalisation.
template <typename T, typename acc_t>
void reduce_rows(const T* x, const T* y, const RowGeometry& r, int mode, bool square_groups, bool want_factor,
                 acc_t bound, int fn, acc_t gamma, acc_t* partial, acc_t* norm_or_total, acc_t* factor,
                 unsigned long long* nonfinite) {
  const int64_t warps = partial_count(r);
  if (mode == kSumSquares) {
    launch(row_partial_kernel<T, acc_t, kSumSquares>, warp_blocks(warps), kClipThreads, x, y, r.S, r.K, r.chunk,
           warps, partial);
  } else if (mode == kSumAbs) {
    launch(row_partial_kernel<T, acc_t, kSumAbs>, warp_blocks(warps), kClipThreads, x, y, r.S, r.K, r.chunk, warps,
           partial);
  } else {
    launch(row_partial_kernel<T, acc_t, kDot>, warp_blocks(warps), kClipThreads, x, y, r.S, r.K, r.chunk, warps,
           partial);
  }
  launch(finalize_rows_kernel<acc_t>, warp_blocks(r.B), kClipThreads, static_cast<const acc_t*>(partial), r.B, r.G,
         r.K, square_groups ? 1 : 0, want_factor ? 1 : 0, bound, fn, gamma, norm_or_total, factor, nonfinite);
}

// out = factor * x per row; factor and norm per row; nonfinite += rows with a non-finite norm.
// r must come from row_geometry(x, norm, kReduceChunk); `partial` holds partial_count(r) entries.
template <typename T, typename acc_t>
void clip_rows_device(const T* x, const RowGeometry& r, bool l15, acc_t bound, int fn, acc_t gamma, acc_t* partial,
                      acc_t* norm, acc_t* factor, unsigned long long* nonfinite, T* out) {
  if (r.B == 0) return;
  reduce_rows<T, acc_t>(x, static_cast<const T*>(nullptr), r, l15 ? kSumAbs : kSumSquares, l15, true, bound, fn,
                        gamma, partial, norm, factor, nonfinite);
  const int64_t tiles = (r.N + kScaleTile - 1) / kScaleTile;
  launch(scale_rows_kernel<T, acc_t>, r.B * tiles, kClipThreads, x, static_cast<const acc_t*>(factor), r.N, tiles,
         out);
}

// out = the VJP of clip_rows at (grad, clipped, factor, norm); `dot` holds B entries of workspace.
template <typename T, typename acc_t>
void clip_rows_backward_device(const T* g, const T* xc, const acc_t* factor, const acc_t* norm, const RowGeometry& r,
                               acc_t bound, int fn, acc_t* partial, acc_t* dot, T* out) {
  if (r.B == 0) return;
  reduce_rows<T, acc_t>(xc, g, r, kDot, false, false, bound, fn, acc_t(0), partial, dot,
                        static_cast<acc_t*>(nullptr), static_cast<unsigned long long*>(nullptr));
  const int64_t tiles = (r.N + kScaleTile - 1) / kScaleTile;
  launch(clip_jvp_kernel<T, acc_t>, r.B * tiles, kClipThreads, g, xc, factor, norm, static_cast<const acc_t*>(dot),
         bound, fn, r.N, tiles, out);
}

}  // namespace cuda
}  // namespace bpclip
