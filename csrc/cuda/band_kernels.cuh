// Device code of banded_row_ (one row of the banded mechanism's correlated noise, bpclip_fast/banded.py):
//   w_i = std z_i + sum_{a = 1..b-1} weights[a-1] ring[slot(a), i],  slot(a) = (newest - a + 1) mod (b-1),
// stored into the oldest slot (newest + 1) mod (b-1) and added to the out covering element i.
// z is philox_noise_'s stream (bpclip_fast/philox.h): element i is normal i % 8 of group i / 8.
//
// A bandwidth kernel: per element it reads b-1 ring values and writes one, and reads and writes the
// out covering it (if any): (b + 2) x sizeof(T) bytes, plus 3/8 of a Philox block. Layout: as in
// philox_noise_ (noise_kernels.cuh), lane l of a warp draws group 32t + l of tile t (256 elements),
// i.e. 8 consecutive elements; the warp stages the tile's 256 normals in its slice of shared memory
// (__syncwarp only) and then handles element 32k + l of the tile in step k, so every ring row, the
// destination slot and the outs are read and written in coalesced runs of 32 consecutive elements.
// Element i is owned by one thread, which reads the oldest slot before it overwrites it: in place.
//
// Arithmetic in T (fp32 for float32, fp64 for float64), in the CPU kernel's order (csrc/cpu/band_cpu.cpp):
// std z, then the ages a = 1, 2, ... (one multiply, one add each), then out + w. On a GPU nvcc may
// contract a multiply-add into an FMA (a rounding, not a different sum); the emulator, built without
// contraction, checks the order bit for bit.
#pragma once

#include <stdint.h>

#include "bpclip_fast/band.h"
#include "bpclip_fast/philox.h"
#include "noise_kernels.cuh"

namespace bpclip {
namespace cuda {

constexpr int kBandThreads = 256;
constexpr int kBandBlocksPerSm = 8;  // 2048 threads per SM: the memory system needs every warp it can get

// Everything but the ring, by value in the kernel's parameter block (__grid_constant__: read where it
// lies, indexed by the age and the out, with no per-thread copy).
template <typename T>
struct BandRowArgs {
  T weights[kBandMaxSlots];  // weights[a - 1] = -c_a / c_0
  T* outs[kBandMaxOuts];
  int64_t starts[kBandMaxOuts], ends[kBandMaxOuts];  // outs[k] covers elements [starts[k], ends[k])
  T stdv;                                             // std / c_0
  int slots, newest, n_outs;
};

template <typename T>
__device__ __forceinline__ T band_value(normal_t<T> z, const T* ring, int64_t P, int64_t i,
                                        const BandRowArgs<T>& a) {
  T v = a.stdv * static_cast<T>(z);
  int s = a.newest;
  for (int k = 0; k < a.slots; ++k) {
    v = v + a.weights[k] * ring[static_cast<int64_t>(s) * P + i];
    s = s == 0 ? a.slots - 1 : s - 1;
  }
  return v;
}

// blockDim.x: a multiple of 32, at most kBandThreads. Any grid: the warps stride over the tiles.
template <typename T>
__global__ void __launch_bounds__(kBandThreads)
    banded_row_kernel(T* ring, int64_t P, uint64_t seed, uint64_t offset, const __grid_constant__ BandRowArgs<T> a) {
  __shared__ normal_t<T> z_of_warp[kBandThreads / kNoiseLanes][kNoiseTile];  // float64 rows: float64 normals
  const NoiseWarp t = noise_warp();
  normal_t<T>* stage = z_of_warp[t.in_block];
  T* dst = ring + static_cast<int64_t>((a.newest + 1) % a.slots) * P;
  const int64_t tiles = (P + kNoiseTile - 1) / kNoiseTile;
  for (int64_t tile = t.warp; tile < tiles; tile += t.warps) {
    const int64_t base = tile * kNoiseTile;
    if (base + static_cast<int64_t>(t.lane) * kNormalsPerGroup < P) {
      normal_t<T> z[kNormalsPerGroup];
      philox_normal8(seed, offset, static_cast<uint64_t>(tile) * kNoiseLanes + static_cast<uint64_t>(t.lane), z);
      for (int q = 0; q < kNormalsPerGroup; ++q) stage[t.lane * kNormalsPerGroup + q] = z[q];
    }
    __syncwarp();  // the tile's normals staged before any lane reads another's
    for (int k = 0; k < kNormalsPerGroup; ++k) {
      const int e = k * kNoiseLanes + t.lane;
      const int64_t i = base + e;
      if (i >= P) break;
      const T v = band_value(stage[e], ring, P, i, a);
      dst[i] = v;
      for (int o = 0; o < a.n_outs; ++o) {
        if (i >= a.starts[o] && i < a.ends[o]) {
          T* out = a.outs[o] + (i - a.starts[o]);
          *out = *out + v;
        }
      }
    }
    __syncwarp();  // every normal read before the next tile overwrites the stage
  }
}

}  // namespace cuda
}  // namespace bpclip
