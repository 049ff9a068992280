// The launch of banded_row_ over raw device pointers, shared by the tensor launcher (band_cuda.cu)
// and the test emulator. Declare `launch` first (launch.h or the emulator's).
#pragma once

#include <stdint.h>

#include "band_kernels.cuh"

namespace bpclip {
namespace cuda {

// blocks <= 0: one resident wave (kBandBlocksPerSm per SM of sm_count), or fewer where the row has
// fewer warp tiles; otherwise that grid (the tests' small grids exercise the tile stride).
template <typename T>
void banded_row_device(T* ring, int64_t P, uint64_t seed, uint64_t offset, const BandRowArgs<T>& args, int sm_count,
                       int64_t blocks = 0, int threads = kBandThreads) {
  if (P <= 0) return;
  if (blocks <= 0) {
    const int64_t tiles = (P + kNoiseTile - 1) / kNoiseTile;
    const int64_t warps_per_block = kBandThreads / kNoiseLanes;
    const int64_t needed = (tiles + warps_per_block - 1) / warps_per_block;
    const int64_t resident = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) * kBandBlocksPerSm;
    blocks = needed < resident ? needed : resident;
    threads = kBandThreads;
  }
  launch(banded_row_kernel<T>, blocks, threads, ring, P, seed, offset, args);
}

}  // namespace cuda
}  // namespace bpclip
