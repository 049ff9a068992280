// The launch of conv_patches over raw device pointers, shared by the tensor launcher
// (patches_cuda.cu) and the test emulator; `launch` as in clip_launch.cuh.
#pragma once

#include <stdint.h>

#include "patches_kernels.cuh"

namespace bpclip {
namespace cuda {

template <typename T, typename acc_t>
void conv_patches_device(const T* x, const PatchGeometry& g, acc_t* out) {
  const int64_t total = g.n * g.c * g.kh * g.kw * g.ho * g.wo;
  launch(conv_patches_kernel<T, acc_t>, (total + kPatchTile - 1) / kPatchTile, kPatchThreads, x, g, total, out);
}

}  // namespace cuda
}  // namespace bpclip
