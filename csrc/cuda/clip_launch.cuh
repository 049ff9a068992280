// The launch sequences of clip_rows, scale_rows and clip_rows_backward over raw device pointers: block counts,
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

// Entries of the double workspace that reduce_rows needs.
inline int64_t partial_count(const RowGeometry& r) { return r.B * r.G * r.K; }

// Partial sums of one reduction mode, then the per-row finalisation.
template <typename T, typename fac_t>
void reduce_rows(const T* x, const T* y, const RowGeometry& r, int mode, bool square_groups, bool want_factor,
                 double bound_eff, int fn, double gamma, double* partial, double* total, fac_t* norm, fac_t* factor,
                 unsigned long long* nonfinite) {
  const int64_t warps = partial_count(r);
  if (mode == kSumSquares) {
    launch(row_partial_kernel<T, kSumSquares>, warp_blocks(warps), kClipThreads, x, y, r.S, r.K, r.chunk, warps,
           partial);
  } else if (mode == kSumAbs) {
    launch(row_partial_kernel<T, kSumAbs>, warp_blocks(warps), kClipThreads, x, y, r.S, r.K, r.chunk, warps,
           partial);
  } else {
    launch(row_partial_kernel<T, kDot>, warp_blocks(warps), kClipThreads, x, y, r.S, r.K, r.chunk, warps, partial);
  }
  launch(finalize_rows_kernel<fac_t>, warp_blocks(r.B), kClipThreads, static_cast<const double*>(partial), r.B, r.G,
         r.K, square_groups ? 1 : 0, want_factor ? 1 : 0, bound_eff, fn, gamma, total, norm, factor, nonfinite);
}

// out = RZ(factor * x) per row of N elements (zeros where factor = 0): the elementwise pass of
// clip_rows, and the whole of scale_rows.
template <typename T, typename fac_t>
void scale_rows_device(const T* x, const fac_t* factor, int64_t B, int64_t N, T* out) {
  const int64_t tiles = (N + kScaleTile - 1) / kScaleTile;
  launch(scale_rows_kernel<T, fac_t>, B * tiles, kClipThreads, x, factor, N, tiles, out);
}

// (scale_rows(x, fx), scale_rows(y, fy) or with mask_y y's rows kept where fy > 0) in one launch;
// x [B, Nx] and y [B, Ny].
template <typename T, typename fac_t>
void scale_rows2_device(const T* x, const fac_t* fx, int64_t Nx, T* ox, const T* y, const fac_t* fy, int64_t Ny,
                        bool mask_y, int64_t B, T* oy) {
  const int64_t tiles_x = (Nx + kScaleTile - 1) / kScaleTile, tiles_y = (Ny + kScaleTile - 1) / kScaleTile;
  launch(scale_rows2_kernel<T, fac_t>, B * (tiles_x + tiles_y), kClipThreads, x, fx, Nx, tiles_x, B * tiles_x, ox, y,
         fy, Ny, tiles_y, mask_y ? 1 : 0, oy);
}

// out = factor * x per row; factor and norm per row; nonfinite += rows with a non-finite norm.
// `bound` is the caller's bound C; the kernels clip against effective_bound(C, N) (clip.h).
// r must come from row_geometry(x, norm, kReduceChunk); `partial` holds partial_count(r) doubles.
template <typename T, typename fac_t>
void clip_rows_device(const T* x, const RowGeometry& r, bool l15, double bound, int fn, double gamma, double* partial,
                      fac_t* norm, fac_t* factor, unsigned long long* nonfinite, T* out) {
  if (r.B == 0) return;
  reduce_rows<T, fac_t>(x, static_cast<const T*>(nullptr), r, l15 ? kSumAbs : kSumSquares, l15, true,
                        effective_bound(bound, r.N), fn, gamma, partial, static_cast<double*>(nullptr), norm, factor,
                        nonfinite);
  scale_rows_device<T, fac_t>(x, static_cast<const fac_t*>(factor), r.B, r.N, out);
}

// clip_rows_device on g with scale_rows(x, x_factor) in its scaling launch (x [r.B, Nx]): the
// layer backward's clipped upstream gradient and rebuilt clipped input, one launch fewer.
template <typename T, typename fac_t>
void clip_rows_rescale_device(const T* g, const RowGeometry& r, bool l15, double bound, int fn, double gamma,
                              double* partial, fac_t* norm, fac_t* factor, unsigned long long* nonfinite, T* out,
                              const T* x, const fac_t* x_factor, int64_t Nx, T* x_out) {
  if (r.B == 0) return;
  reduce_rows<T, fac_t>(g, static_cast<const T*>(nullptr), r, l15 ? kSumAbs : kSumSquares, l15, true,
                        effective_bound(bound, r.N), fn, gamma, partial, static_cast<double*>(nullptr), norm, factor,
                        nonfinite);
  scale_rows2_device<T, fac_t>(g, static_cast<const fac_t*>(factor), r.N, out, x, x_factor, Nx, false, r.B, x_out);
}

// Entries of the double workspaces of the backward: partial sums (dot products and squared norms)
// and their per-row totals.
inline int64_t backward_partial_count(const RowGeometry& r) { return 2 * partial_count(r); }
inline int64_t backward_sums_count(const RowGeometry& r) { return 2 * r.B; }

// out = the VJP of clip_rows at (grad, clipped, factor, norm); `partial` and `sums` hold
// backward_partial_count(r) and backward_sums_count(r) doubles of workspace.
template <typename T, typename fac_t>
void clip_rows_backward_device(const T* g, const T* xc, const fac_t* factor, const fac_t* norm, const RowGeometry& r,
                               double bound, int fn, double* partial, double* sums, T* out) {
  if (r.B == 0) return;
  const double bound_eff = effective_bound(bound, r.N);  // the bound the forward applied
  reduce_rows<T, fac_t>(xc, g, r, kDot, false, false, bound_eff, fn, 0.0, partial, sums, static_cast<fac_t*>(nullptr),
                        static_cast<fac_t*>(nullptr), static_cast<unsigned long long*>(nullptr));
  const int64_t tiles = (r.N + kScaleTile - 1) / kScaleTile;
  launch(clip_jvp_kernel<T, fac_t>, r.B * tiles, kClipThreads, g, xc, factor, norm, static_cast<const double*>(sums),
         bound_eff, fn, r.B, r.N, tiles, out);
}

}  // namespace cuda
}  // namespace bpclip
