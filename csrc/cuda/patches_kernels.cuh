// Device code of conv_patches: one thread per output element (bpclip_fast/patches.h's patch_source
// maps it to its input pixel or to the padding), a block per tile of kPatchTile elements. No
// shared memory, so the test emulator runs this exact kernel.
#pragma once

#include <stdint.h>

#include "bpclip_fast/patches.h"
#include "dtypes.cuh"

namespace bpclip {
namespace cuda {

constexpr int kPatchTile = 4096;  // output elements per block
constexpr int kPatchThreads = 256;

// out[e] for e in block b's tile of the total n (c kh kw) (ho wo) elements, in the accumulation dtype.
template <typename T, typename acc_t>
__global__ void conv_patches_kernel(const T* __restrict__ x, PatchGeometry g, int64_t total,
                                    acc_t* __restrict__ out) {
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kPatchTile;
  const int64_t hi = lo + kPatchTile < total ? lo + kPatchTile : total;
  for (int64_t e = lo + threadIdx.x; e < hi; e += blockDim.x) {
    const int64_t src = patch_source(g, e);
    out[e] = src < 0 ? acc_t(0) : static_cast<acc_t>(to_acc(x[src]));
  }
}

}  // namespace cuda
}  // namespace bpclip
