// Device code of philox_noise_: the same Philox4x32-10 + Box-Muller as the CPU kernel (one header,
// bpclip_fast/philox.h); only the order in which elements reach memory differs.
//
// Why the layout below. The stream fixes that lane l of a warp draws group g (three counter
// blocks, 8 normals, elements 8g..8g+7), so a lane's results are 8 CONSECUTIVE elements. Stored
// as they come (the former kernel: 8 scalar stores per lane), each store instruction of a warp
// touches 32 sectors 32 bytes apart, 4 bytes of each: 8x the L1 wavefronts and L2 write requests
// of a coalesced store, and it ran at 13% of copy bandwidth on an H100 (issue 25). Here a warp
// owns a TILE of 32 groups (256 elements): each lane draws its group, the warp regroups the tile
// through its own slice of shared memory (__syncwarp only: no block barrier) so that store k of
// lane l writes slot 32k + l, and every warp-wide store covers one contiguous run of bytes. Where
// the buffer is 16-byte aligned the slots are 16-byte packs (fp32: 2 per lane, fp64: 4; fp16/bf16:
// a group IS one pack, so it is stored directly); otherwise (a view such as t[1:]) the slots are
// single elements, still coalesced. The last n % 256 elements (fewer than one tile) are written
// by one warp with the per-group code. Accumulation reads the tile the same coalesced way.
#pragma once

#include <stdint.h>

#include "bpclip_fast/philox.h"
#include "dtypes.cuh"

namespace bpclip {
namespace cuda {

constexpr int kNoiseThreads = 256;
// Blocks of 256 threads resident per SM. __launch_bounds__ holds the compiler to the registers for
// this many (65536 / (6 x 256) -> 40 per thread), so the launcher's grid of SMs x 6 blocks is
// exactly one resident wave: every warp strides over the same number of tiles (+-1) and none waits
// for a second wave. Why 6 (48 warps, 75% occupancy) and not 8: at 32 registers ptxas spills in
// every variant (sm_90, nvcc 13.0); at 40 the aligned write paths spill nothing (aligned accumulate:
// 8 bytes fp32, 36 fp64; the misaligned paths ~50), and 48 warps of ~570 instructions per tile
// hide the memory latency. Without a bound ptxas takes 56-64 registers for the accumulate paths.
constexpr int kNoiseBlocksPerSm = 6;
constexpr int kNoiseLanes = 32;  // the warp size; the launch's block size must be a multiple of it
constexpr int kNoiseTile = kNoiseLanes * kNormalsPerGroup;  // elements per warp tile

// A 16-byte access unit (ld/st.global.v4): what one lane moves per instruction on the aligned path.
template <typename T>
struct alignas(16) NoisePack {
  T e[16 / sizeof(T)];
};
template <typename T>
constexpr int kPackElems = static_cast<int>(16 / sizeof(T));
template <typename T>
constexpr int kPacksPerGroup = kNormalsPerGroup / kPackElems<T>;  // fp16/bf16 1, fp32 2, fp64 4

// The stored value of one element: stdv z (+ the old value), rounded once to T, with z and stdv in
// normal_t<T> (double for a float64 buffer, float otherwise: philox.h). The same expressions as the
// CPU kernel (noise_cpu.cpp). `old` is read only when accumulating (it may be uninitialised otherwise).
template <typename T, bool kAccumulate>
__device__ __forceinline__ T noise_store_value(const T& old, normal_t<T> z, normal_t<T> stdv) {
  const normal_t<T> v = stdv * z;
  if constexpr (kAccumulate) {
    return from_acc<T>(to_acc(old) + v);
  } else {
    (void)old;
    return from_acc<T>(v);
  }
}

// The scale of philox_noise_ (where it is not 1): the stored value times the scale in the opmath
// type (double for fp64, float otherwise), rounded to T, as a later mul_(scale) gives (noise_cpu.cpp).
struct NoiseScale {
  double scale;
  bool on;
};

template <typename T, bool kAccumulate>
__device__ __forceinline__ T noise_store_value(const T& old, normal_t<T> z, normal_t<T> stdv, const NoiseScale& s) {
  const T r = noise_store_value<T, kAccumulate>(old, z, stdv);
  if (!s.on) return r;
  using A = decltype(to_acc(r));
  return from_acc<T>(to_acc(r) * static_cast<A>(s.scale));
}

// Elements first.. n-1 (fewer than one tile): lane l draws group first / 8 + l and writes the part
// of it below n. Uncoalesced, but at most 255 elements per call.
template <typename T, bool kAccumulate>
__device__ void philox_noise_tail(T* __restrict__ buf, int64_t n, int64_t first, int lane, uint64_t seed,
                                  uint64_t offset, normal_t<T> stdv, NoiseScale scale) {
  const int64_t base = first + static_cast<int64_t>(lane) * kNormalsPerGroup;
  if (base >= n) return;
  normal_t<T> z[kNormalsPerGroup];
  philox_normal8(seed, offset, static_cast<uint64_t>(base / kNormalsPerGroup), z);
  for (int l = 0; l < kNormalsPerGroup; ++l) {
    if (base + l >= n) break;
    buf[base + l] = noise_store_value<T, kAccumulate>(buf[base + l], z[l], stdv, scale);
  }
}

// One warp's slots: kPacked, 16-byte packs (buf 16-byte aligned); else single elements. Slot s of
// the staged tile is pack s, or element s of the packs read as one array.
template <typename T, bool kPacked>
struct NoiseSlots {
  using Unit = NoisePack<T>;
  static constexpr int kPerLane = kPacksPerGroup<T>;
  __device__ static Unit load(const T* tile, int s) { return reinterpret_cast<const Unit*>(tile)[s]; }
  __device__ static void store(T* tile, int s, const Unit& u) { reinterpret_cast<Unit*>(tile)[s] = u; }
  __device__ static Unit get(const NoisePack<T>* stage, int s) { return stage[s]; }
  __device__ static void put(NoisePack<T>* stage, int s, const Unit& u) { stage[s] = u; }
};
template <typename T>
struct NoiseSlots<T, false> {
  using Unit = T;
  static constexpr int kPerLane = kNormalsPerGroup;
  __device__ static T load(const T* tile, int s) { return tile[s]; }
  __device__ static void store(T* tile, int s, const T& u) { tile[s] = u; }
  __device__ static T get(const NoisePack<T>* stage, int s) { return stage[s / kPackElems<T>].e[s % kPackElems<T>]; }
  __device__ static void put(NoisePack<T>* stage, int s, const T& u) {
    stage[s / kPackElems<T>].e[s % kPackElems<T>] = u;
  }
};

// One buffer's share of a launch, grid-stride over its warp tiles: warp w (of `warps`, numbered
// from this buffer's first) takes tiles w, w + warps, ...; the warp after the last full tile's owner
// in that order takes the tail. kPacked: buf is 16-byte aligned (the launcher checks). stage: the
// warp's slice of shared memory, free on entry and on return. std_in: as the op got it, rounded here
// to normal_t<T> (float for every dtype but float64, as the CPU kernel does).
template <typename T, bool kAccumulate, bool kPacked>
__device__ __forceinline__ void philox_noise_tiles(T* __restrict__ buf, int64_t n, uint64_t seed, uint64_t offset,
                                                   double std_in, NoiseScale scale, int64_t warp, int64_t warps,
                                                   int lane, NoisePack<T>* stage) {
  const normal_t<T> stdv = static_cast<normal_t<T>>(std_in);
  using Slots = NoiseSlots<T, kPacked>;
  using Pack = NoisePack<T>;
  constexpr int kPacks = kPacksPerGroup<T>;
  constexpr int kPer = kPackElems<T>;
  const int64_t tiles = n / kNoiseTile;
  for (int64_t t = warp; t < tiles; t += warps) {
    T* tile = buf + t * kNoiseTile;
    const uint64_t group = static_cast<uint64_t>(t) * kNoiseLanes + static_cast<uint64_t>(lane);
    if constexpr (kPacked && kPacks == 1) {
      // fp16/bf16: the lane's group is one pack and pack l is already slot l: no regrouping.
      Pack p;
      if constexpr (kAccumulate) p = Slots::load(tile, lane);
      normal_t<T> z[kNormalsPerGroup];
      philox_normal8(seed, offset, group, z);
      for (int l = 0; l < kNormalsPerGroup; ++l) {
        p.e[l] = noise_store_value<T, kAccumulate>(p.e[l], z[l], stdv, scale);
      }
      Slots::store(tile, lane, p);
    } else {
      // Aligned: the old values are loaded before the Philox rounds, so that their latency hides
      // behind them. Misaligned (8 scalar slots a lane): after, as holding 8 values across the
      // rounds spills registers; that path is rare (views such as t[1:]).
      constexpr bool kPreload = kAccumulate && kPacked;
      typename Slots::Unit held[kPreload ? Slots::kPerLane : 1];
      if constexpr (kPreload) {
        for (int k = 0; k < Slots::kPerLane; ++k) held[k] = Slots::load(tile, k * kNoiseLanes + lane);
      }
      normal_t<T> z[kNormalsPerGroup];
      philox_normal8(seed, offset, group, z);
      if constexpr (kAccumulate) {
        for (int k = 0; k < Slots::kPerLane; ++k) {
          const int s = k * kNoiseLanes + lane;
          if constexpr (kPreload) {
            Slots::put(stage, s, held[k]);
          } else {
            Slots::put(stage, s, Slots::load(tile, s));
          }
        }
        __syncwarp();  // the old values of every lane's group staged
      }
      for (int q = 0; q < kPacks; ++q) {
        Pack p;
        if constexpr (kAccumulate) p = stage[lane * kPacks + q];
        for (int e = 0; e < kPer; ++e) {
          p.e[e] = noise_store_value<T, kAccumulate>(p.e[e], z[q * kPer + e], stdv, scale);
        }
        stage[lane * kPacks + q] = p;
      }
      __syncwarp();  // every lane's group staged before any lane stores slots of others
      for (int k = 0; k < Slots::kPerLane; ++k) {
        Slots::store(tile, k * kNoiseLanes + lane, Slots::get(stage, k * kNoiseLanes + lane));
      }
      __syncwarp();  // every slot read before the next tile overwrites the stage
    }
  }
  if (warp == tiles % warps) {
    philox_noise_tail<T, kAccumulate>(buf, n, tiles * kNoiseTile, lane, seed, offset, stdv, scale);
  }
}

// This thread's place in the grid, counted in warps: its lane, its warp within the block and
// within the grid, and the grid's warp count.
struct NoiseWarp {
  int lane, in_block;
  int64_t warp, warps;
};

__device__ inline NoiseWarp noise_warp() {
  const int64_t per_block = blockDim.x / kNoiseLanes;
  const int in_block = static_cast<int>(threadIdx.x) / kNoiseLanes;
  return {static_cast<int>(threadIdx.x) % kNoiseLanes, in_block, static_cast<int64_t>(blockIdx.x) * per_block + in_block,
          static_cast<int64_t>(gridDim.x) * per_block};
}

// The stage slices of a block's warps, in shared memory.
template <typename T>
using NoiseStage = NoisePack<T>[kNoiseThreads / kNoiseLanes][kNoiseLanes * kPacksPerGroup<T>];

// blockDim.x: a multiple of 32, at most kNoiseThreads.
template <typename T, bool kAccumulate, bool kPacked>
__global__ void __launch_bounds__(kNoiseThreads, kNoiseBlocksPerSm)
    philox_noise_kernel(T* __restrict__ buf, int64_t n, uint64_t seed, uint64_t offset, double stdv, double scale) {
  __shared__ NoiseStage<T> stage_of_warp;
  const NoiseWarp t = noise_warp();
  philox_noise_tiles<T, kAccumulate, kPacked>(buf, n, seed, offset, stdv, NoiseScale{scale, scale != 1.0}, t.warp,
                                              t.warps, t.lane, stage_of_warp[t.in_block]);
}

// philox_noise2_: a layer's weight w (stream offset_w) and bias b (offset_b) in one launch, each
// element the value philox_noise_kernel gives it. b's work is numbered on from the warp after the
// one that took w's tail, so the grid shares out the two buffers' tiles as it would their
// concatenation. b (a bias: one value per output, far smaller than w) always takes the element
// slots, coalesced like the packs but valid at any alignment, so only w's alignment picks a variant.
template <typename T, bool kAccW, bool kPackedW, bool kAccB>
__global__ void __launch_bounds__(kNoiseThreads, kNoiseBlocksPerSm)
    philox_noise2_kernel(T* __restrict__ w, int64_t nw, T* __restrict__ b, int64_t nb, uint64_t seed,
                         uint64_t offset_w, uint64_t offset_b, double stdv, double scale) {
  __shared__ NoiseStage<T> stage_of_warp;
  const NoiseWarp t = noise_warp();
  const NoiseScale s{scale, scale != 1.0};
  philox_noise_tiles<T, kAccW, kPackedW>(w, nw, seed, offset_w, stdv, s, t.warp, t.warps, t.lane,
                                         stage_of_warp[t.in_block]);
  const int64_t first_b = (nw / kNoiseTile + 1) % t.warps;  // after w's full tiles and its tail
  philox_noise_tiles<T, kAccB, false>(b, nb, seed, offset_b, stdv, s, (t.warp + t.warps - first_b) % t.warps,
                                      t.warps, t.lane, stage_of_warp[t.in_block]);
}

}  // namespace cuda
}  // namespace bpclip
