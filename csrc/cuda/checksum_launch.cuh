// The launch of word_checksum over raw device pointers, shared by the tensor launcher
// (checksum_cuda.cu) and the test emulator. Declare `launch` first.
#pragma once

#include <stdint.h>

#include "checksum_kernels.cuh"

namespace bpclip {
namespace cuda {

// *out += the checksum of words [n] (the caller zeroes *out first). Enough blocks to fill the
// device (sm_count of them, 8 each), no more: the atomics are one per warp.
inline void word_checksum_device(const long long* words, int64_t n, unsigned long long* out, int sm_count) {
  const int64_t wanted = (n + kChecksumThreads - 1) / kChecksumThreads;
  const int64_t cap = 8 * static_cast<int64_t>(sm_count > 0 ? sm_count : 1);
  launch(word_checksum_kernel, wanted < cap ? wanted : cap, kChecksumThreads, words, n, out);
}

}  // namespace cuda
}  // namespace bpclip
