// Device code of word_checksum (bpclip_fast/checksum.h): each warp sums its grid-stride share of the
// words, folds the lanes with shuffles and adds the warp's sum to the output atomically (the order
// of the additions does not change a sum modulo 2^64). Warp shuffles and one atomic per warp only,
// so the test emulator runs this very kernel.
#pragma once

#include <stdint.h>

#include "bpclip_fast/checksum.h"

namespace bpclip {
namespace cuda {

constexpr int kChecksumThreads = 256;
constexpr int kChecksumWarp = 32;

__global__ void word_checksum_kernel(const long long* __restrict__ words, int64_t n, unsigned long long* out) {
  uint64_t s = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    s += checksum_term(words[i]);
  }
  unsigned long long v = s;
  for (int off = kChecksumWarp / 2; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  if (threadIdx.x % kChecksumWarp == 0) atomicAdd(out, v);
}

}  // namespace cuda
}  // namespace bpclip
