// Kernels that test the emulator itself: each feature the emulator claims (barriers, static and
// dynamic shared memory, warp collectives, atomics, 3-D ids) is used correctly here, and the
// planted bugs (`bug` argument) are the mistakes it must expose. tests/test_emulator.py checks
// both: correct results without the bug, a reported error or a wrong result with it.
#include "simt.h"

namespace selftest {

enum Bug : int {
  kNone = 0,
  kMissingBarrier = 1,     // block_sum: the __syncthreads() between the loads and the tree is gone
  kSharedOutOfRange = 2,   // block_sum: the loads are stored one slot too far
  kWrongShuffleLane = 3,   // half_warp_sum: starts at offset 16, a lane outside the half-warp mask
  kMissingBarrierDyn = 4,  // reverse_block: no barrier between the write and the read of dynamic shared
};

constexpr int kBlock = 256;

// out[blockIdx] = sum of the block's 256 elements of x (zero past n): a shared-memory tree.
__global__ void block_sum(const float* x, int n, float* out, int bug) {
  __shared__ float sh[kBlock];
  const int t = threadIdx.x;
  const int i = blockIdx.x * kBlock + t;
  const float v = i < n ? x[i] : 0.0f;
  if (bug == kSharedOutOfRange) {
    sh[t + 1] = v;
  } else {
    sh[t] = v;
  }
  if (bug != kMissingBarrier) __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (t < s) sh[t] += sh[t + s];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = sh[0];
}

// Each half-warp sums its 16 values with its own mask; out[i] = the half-warp's sum.
__global__ void half_warp_sum(const float* x, float* out, int bug) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x % 32;
  const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
  float v = x[i];
  for (int off = bug == kWrongShuffleLane ? 16 : 8; off > 0; off >>= 1) v += __shfl_xor_sync(mask, v, off);
  out[i] = v;
}

// out = x reversed within each block, through dynamic shared memory.
__global__ void reverse_block(const float* x, float* out, int bug) {
  extern __shared__ float dyn[];
  const int t = threadIdx.x, n = blockDim.x;
  dyn[t] = x[blockIdx.x * n + t];
  if (bug != kMissingBarrierDyn) __syncthreads();
  out[blockIdx.x * n + t] = dyn[n - 1 - t];
}

// The warp and block collectives side by side; one row of 8 results per thread.
__global__ void collectives(const int* x, long long* out) {
  const int t = threadIdx.x, lane = t % 32;
  const int v = x[blockIdx.x * blockDim.x + t];
  long long* o = out + (static_cast<long long>(blockIdx.x) * blockDim.x + t) * 8;
  o[0] = __ballot_sync(0xffffffffu, v > 0);
  o[1] = __any_sync(0xffffffffu, v > 5);
  o[2] = __all_sync(0xffffffffu, v > -100);
  o[3] = __shfl_up_sync(0xffffffffu, v, 3);
  o[4] = __shfl_sync(0xffffffffu, v, 31 - lane);
  o[5] = __shfl_down_sync(0xffffffffu, v, 5, 8);  // segments of 8 lanes
  __syncwarp();
  o[6] = __syncthreads_count(v > 0);
  o[7] = __syncthreads_or(v == 7);
}

// atomics across blocks: a float sum, an int histogram, an int max.
__global__ void atomics(const float* x, const int* bins, int n, float* sum, int* hist, int* maxbin) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  atomicAdd(sum, x[i]);
  atomicAdd(&hist[bins[i]], 1);
  atomicMax(maxbin, bins[i]);
}

// Records every thread's ids; a 3-D grid of 3-D blocks.
__global__ void ids(int* out) {
  const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int tid = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  int* o = out + (block * threads + tid) * 6;
  o[0] = threadIdx.x;
  o[1] = threadIdx.y;
  o[2] = threadIdx.z;
  o[3] = blockIdx.x;
  o[4] = blockIdx.y;
  o[5] = blockIdx.z;
}

// Misuses that must be reported, not silently run.
__global__ void misuse(int which) {
  const int t = threadIdx.x, lane = t % 32;
  if (which == 0) {  // threads of one block at two different barriers
    if (t < 16) {
      __syncthreads();
    } else {
      __syncthreads();
    }
  } else if (which == 1) {  // a lane the mask names has exited
    if (lane == 5) return;
    __shfl_down_sync(0xffffffffu, t, 1);
  } else if (which == 2) {  // the mask does not name the calling lane
    __shfl_down_sync(1u << ((lane + 1) % 32), t, 1);
  } else if (which == 3) {  // half the warp at one shuffle, half at a ballot, same mask
    if (lane < 16) {
      __shfl_down_sync(0xffffffffu, t, 1);
    } else {
      __ballot_sync(0xffffffffu, 1);
    }
  }
}

}  // namespace selftest

extern "C" {

int simt_selftest_block_sum(const float* x, int n, float* out, int bug) {
  simt::launch(selftest::block_sum, dim3((n + selftest::kBlock - 1) / selftest::kBlock), dim3(selftest::kBlock), 0,
               x, n, out, bug);
  return simt::has_error();
}

int simt_selftest_half_warp_sum(const float* x, int n, float* out, int bug) {
  simt::launch(selftest::half_warp_sum, dim3(n / 64), dim3(64), 0, x, out, bug);
  return simt::has_error();
}

int simt_selftest_reverse_block(const float* x, int blocks, int threads, float* out, int bug) {
  simt::launch(selftest::reverse_block, dim3(blocks), dim3(threads), threads * sizeof(float), x, out, bug);
  return simt::has_error();
}

int simt_selftest_collectives(const int* x, int blocks, int threads, long long* out) {
  simt::launch(selftest::collectives, dim3(blocks), dim3(threads), 0, x, out);
  return simt::has_error();
}

int simt_selftest_atomics(const float* x, const int* bins, int n, float* sum, int* hist, int* maxbin) {
  simt::launch(selftest::atomics, dim3((n + 127) / 128), dim3(128), 0, x, bins, n, sum, hist, maxbin);
  return simt::has_error();
}

int simt_selftest_ids(const unsigned* grid, const unsigned* block, int* out) {
  simt::launch(selftest::ids, dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]), 0, out);
  return simt::has_error();
}

int simt_selftest_misuse(int which) {
  simt::launch(selftest::misuse, dim3(2), dim3(64), 0, which);
  return simt::has_error();
}

}  // extern "C"
