// CPU kernel of philox_noise_: buf (+)= std * N(0, 1) from the shared Philox4x32-10 stream.
//
// Noise is a first-order cost on CPU (torch's normal_ fills under 1 GB/s), so counter blocks are
// generated kLanes at a time in plain loops over the lane index, which the compiler vectorises;
// an AVX2 clone is chosen at load time where the CPU has it. FMA is deliberately not enabled, so
// every clone rounds identically and a seed gives the same numbers on every x86-64 machine.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-math-errno")  // lets sqrtf vectorise; errno is never read
#endif

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common.h"
#include "bpclip_fast/philox.h"

#include "vector_clones.h"

namespace bpclip {
namespace {

constexpr int64_t kLanes = 16;            // counter blocks per batch: 64 normals
constexpr int64_t kBlocksPerTask = 4096;  // 16384 elements per parallel task

// The 4*kLanes normals of counter blocks first..first+kLanes-1, lane-major: z[q][l] is normal q of
// block first+l (q = 0..3), exactly philox_normal4's order.
BPCLIP_VECTOR_CLONES
void normals_batch(uint64_t seed, uint64_t offset, uint64_t first, float z[4][kLanes]) {
  uint32_t x[kLanes], y[kLanes], w[kLanes], v[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    const uint64_t blk = first + static_cast<uint64_t>(l);
    x[l] = static_cast<uint32_t>(blk);
    y[l] = static_cast<uint32_t>(blk >> 32);
    w[l] = static_cast<uint32_t>(offset);
    v[l] = static_cast<uint32_t>(offset >> 32);
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    for (int l = 0; l < kLanes; ++l) {
      const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * x[l];
      const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * w[l];
      const uint32_t nx = static_cast<uint32_t>(p1 >> 32) ^ y[l] ^ k0;
      const uint32_t ny = static_cast<uint32_t>(p1);
      const uint32_t nw = static_cast<uint32_t>(p0 >> 32) ^ v[l] ^ k1;
      const uint32_t nv = static_cast<uint32_t>(p0);
      x[l] = nx;
      y[l] = ny;
      w[l] = nw;
      v[l] = nv;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int l = 0; l < kLanes; ++l) {
    box_muller(x[l], y[l], &z[0][l], &z[1][l]);
    box_muller(w[l], v[l], &z[2][l], &z[3][l]);
  }
}

template <typename scalar_t>
void noise_span(scalar_t* p, int64_t n, uint64_t seed, uint64_t offset, float stdv, bool accumulate, int64_t blo,
                int64_t bhi) {
  using acc_t = at::opmath_type<scalar_t>;
  float z[4][kLanes];
  for (int64_t first = blo; first < bhi; first += kLanes) {
    const int64_t lanes = std::min<int64_t>(kLanes, bhi - first);
    if (lanes == kLanes) {
      normals_batch(seed, offset, static_cast<uint64_t>(first), z);
    } else {
      for (int64_t l = 0; l < lanes; ++l) {
        float q[4];
        philox_normal4(seed, offset, static_cast<uint64_t>(first + l), q);
        for (int k = 0; k < 4; ++k) z[k][l] = q[k];
      }
    }
    const int64_t base = first * 4;
    const int64_t count = std::min<int64_t>(4 * lanes, n - base);
    scalar_t* out = p + base;
    if (accumulate) {
      for (int64_t i = 0; i < count; ++i)
        out[i] = static_cast<scalar_t>(static_cast<acc_t>(out[i]) + static_cast<acc_t>(stdv * z[i & 3][i >> 2]));
    } else {
      for (int64_t i = 0; i < count; ++i) out[i] = static_cast<scalar_t>(stdv * z[i & 3][i >> 2]);
    }
  }
}

void philox_noise_cpu(at::Tensor& buf, int64_t seed, int64_t offset, double stdv, bool accumulate) {
  check_noise_args(buf, stdv);
  const int64_t n = buf.numel();
  if (n == 0) return;
  // The stream is indexed by the contiguous (row-major) position, whatever the strides of buf.
  at::Tensor work = buf.is_contiguous() ? buf : buf.contiguous();
  const int64_t blocks = (n + 3) / 4;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, work.scalar_type(), "philox_noise_cpu", [&] {
    scalar_t* p = work.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t blo, int64_t bhi) {
      noise_span<scalar_t>(p, n, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), static_cast<float>(stdv),
                           accumulate, blo, bhi);
    });
  });
  if (!work.is_same(buf)) buf.copy_(work);
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) { m.impl("philox_noise_", &philox_noise_cpu); }

}  // namespace bpclip
