// The launch sequence of norm_affine_example_grads over raw device pointers, shared by the tensor
// launcher (norm_affine_cuda.cu) and the test emulator; `launch` as in clip_launch.cuh.
#pragma once

#include <stdint.h>

#include "norm_affine_kernels.cuh"

namespace bpclip {
namespace cuda {

constexpr int kAffineThreads = 256;
// Positions per LayerNorm thread: enough to make the partials' extra traffic small (2 acc values
// per 2 * 64 inputs), few enough that a batch with few parameters still fills the GPU.
constexpr int64_t kLnAffineChunk = 64;
// Elements per GroupNorm warp (128 per lane), as the row reductions of clip_rows.
constexpr int64_t kGnAffineChunk = 4096;

inline int64_t affine_chunk(bool layer_norm) { return layer_norm ? kLnAffineChunk : kGnAffineChunk; }

// Chunks per output; at least one, so that R = 0 writes zeros through the same path.
inline int64_t affine_chunks(bool layer_norm, int64_t R) {
  const int64_t c = affine_chunk(layer_norm);
  return R <= c ? 1 : (R + c - 1) / c;
}

// acc_t entries of workspace the launch needs (none when one chunk covers every output).
inline int64_t affine_workspace_count(bool layer_norm, int64_t B, int64_t R, int64_t D) {
  const int64_t K = affine_chunks(layer_norm, R);
  return K == 1 ? 0 : 2 * K * B * D;
}

// gw, gb [B, D] of the LayerNorm (layer_norm: x as [B, R, D], stats per (b, r)) or GroupNorm
// (x as [B, D, R], stats per (b, group), G groups) affine parameters; mean and rstd in acc_t.
// `work` holds affine_workspace_count(...) entries.
template <typename T, typename acc_t>
void norm_affine_device(const T* g, const T* x, const acc_t* mean, const acc_t* rstd, bool layer_norm, int64_t B,
                        int64_t R, int64_t D, int64_t G, acc_t* work, acc_t* gw, acc_t* gb) {
  const int64_t O = B * D;
  if (O == 0) return;
  const int64_t K = affine_chunks(layer_norm, R);
  const int64_t chunk = affine_chunk(layer_norm);
  acc_t* pw = K == 1 ? gw : work;
  acc_t* pb = K == 1 ? gb : work + K * O;
  if (layer_norm) {
    launch(ln_affine_partial_kernel<T, acc_t>, (K * O + kAffineThreads - 1) / kAffineThreads, kAffineThreads, g, x,
           mean, rstd, B, R, D, chunk, K, pw, pb);
  } else {
    constexpr int64_t warps_per_block = kAffineThreads / kWarpSize;
    launch(gn_affine_partial_kernel<T, acc_t>, (K * O + warps_per_block - 1) / warps_per_block, kAffineThreads, g,
           x, mean, rstd, B, R, D, G, chunk, K, pw, pb);
  }
  if (K == 1) return;
  launch(affine_finalize_kernel<acc_t>, (2 * O + kAffineThreads - 1) / kAffineThreads, kAffineThreads,
         static_cast<const acc_t*>(work), O, K, gw, gb);
}

}  // namespace cuda
}  // namespace bpclip
