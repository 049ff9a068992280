// CPU kernel of philox_noise_: buf (+)= std * N(0, 1) from the shared Philox4x32-10 stream.
//
// Noise is a first-order cost on CPU (torch's normal_ fills under 1 GB/s), so counter blocks are
// generated kLanes at a time: the Philox rounds with AVX-512 intrinsics where the CPU has them
// (else in plain lane loops the compiler vectorises), Box-Muller and the stores in lane loops with
// AVX-512/AVX2 clones chosen at load time. FMA is deliberately not enabled, so every version rounds
// identically and a seed gives the same numbers on every x86-64 machine.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-math-errno")  // lets sqrtf vectorise; errno is never read
#endif

#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
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

// The Philox4x32-10 outputs of counter blocks first..first+kLanes-1, lane-major: r[j][l] is word j
// of block first+l. Portable version: GCC vectorises the lane loops, but it has no 32x32->64-bit
// vector multiply and widens every word to 64 bits, which costs about half the noise time.
BPCLIP_VECTOR_CLONES
void philox_batch_generic(uint64_t seed, uint64_t offset, uint64_t first, uint32_t r[4][kLanes]) {
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
    r[0][l] = x[l];
    r[1][l] = y[l];
    r[2][l] = w[l];
    r[3][l] = v[l];
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BPCLIP_PHILOX_AVX512 1
// GCC 12's avx512fintrin.h trips -Wuninitialized in its own shift intrinsics (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
static_assert(kLanes == 16, "the AVX-512 Philox holds one 32-bit word of 16 blocks per register");

// hi and lo 32 bits of m * a for 16 lanes: _mm512_mul_epu32 multiplies the even lanes into 64-bit
// products, so the odd lanes are shifted down and multiplied separately, then the halves blended.
__attribute__((target("avx512f"))) inline void mul_hi_lo_avx512(__m512i a, __m512i m, __m512i* hi, __m512i* lo) {
  const __m512i even = _mm512_mul_epu32(a, m);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
}

// Bit-identical to philox_batch_generic (integer arithmetic only), about 3x faster.
__attribute__((target("avx512f"))) void philox_batch_avx512(uint64_t seed, uint64_t offset, uint64_t first,
                                                             uint32_t r[4][kLanes]) {
  uint32_t x0[kLanes], y0[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    const uint64_t blk = first + static_cast<uint64_t>(l);
    x0[l] = static_cast<uint32_t>(blk);
    y0[l] = static_cast<uint32_t>(blk >> 32);
  }
  __m512i x = _mm512_loadu_si512(x0), y = _mm512_loadu_si512(y0);
  __m512i w = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
  __m512i v = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    __m512i hi0, lo0, hi1, lo1;
    mul_hi_lo_avx512(x, m0, &hi0, &lo0);
    mul_hi_lo_avx512(w, m1, &hi1, &lo1);
    // 0x96: the three-way XOR
    x = _mm512_ternarylogic_epi32(hi1, y, _mm512_set1_epi32(static_cast<int>(k0)), 0x96);
    y = lo1;
    w = _mm512_ternarylogic_epi32(hi0, v, _mm512_set1_epi32(static_cast<int>(k1)), 0x96);
    v = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  _mm512_storeu_si512(r[0], x);
  _mm512_storeu_si512(r[1], y);
  _mm512_storeu_si512(r[2], w);
  _mm512_storeu_si512(r[3], v);
}
#pragma GCC diagnostic pop
#endif

using PhiloxBatchFn = void (*)(uint64_t, uint64_t, uint64_t, uint32_t[4][kLanes]);

// Chosen once: the AVX-512 version where the CPU has it, unless BPCLIP_NO_AVX512 is set (the
// tests use it to check that both versions give the same bits).
PhiloxBatchFn choose_philox_batch() {
#ifdef BPCLIP_PHILOX_AVX512
  const char* off = std::getenv("BPCLIP_NO_AVX512");
  __builtin_cpu_init();  // idempotent; guarantees the CPU model is filled in whatever the load order
  if (__builtin_cpu_supports("avx512f") && !(off && *off && std::strcmp(off, "0") != 0)) return philox_batch_avx512;
#endif
  return philox_batch_generic;
}

// The 4*kLanes normals of counter blocks first..first+kLanes-1, lane-major: z[q][l] is normal q of
// block first+l (q = 0..3), exactly philox_normal4's order.
BPCLIP_VECTOR_CLONES
void box_muller_batch(const uint32_t r[4][kLanes], float z[4][kLanes]) {
  for (int l = 0; l < kLanes; ++l) {
    box_muller(r[0][l], r[1][l], &z[0][l], &z[1][l]);
    box_muller(r[2][l], r[3][l], &z[2][l], &z[3][l]);
  }
}

void normals_batch(PhiloxBatchFn philox_batch, uint64_t seed, uint64_t offset, uint64_t first,
                   float z[4][kLanes]) {
  uint32_t r[4][kLanes];
  philox_batch(seed, offset, first, r);
  box_muller_batch(r, z);
}

// out[4l + q] (+)= stdv * z[q][l] for a full fp32 batch. Its own clone so that the lane-major to
// block-major interleave vectorises too (in the generic template below it is a scalar gather).
// Rounds exactly like the generic path: one float multiply, then one float add.
BPCLIP_VECTOR_CLONES
void store_batch_f32(float* out, const float z[4][kLanes], float stdv, bool accumulate) {
  if (accumulate) {
    for (int64_t l = 0; l < kLanes; ++l)
      for (int q = 0; q < 4; ++q) out[4 * l + q] = out[4 * l + q] + stdv * z[q][l];
  } else {
    for (int64_t l = 0; l < kLanes; ++l)
      for (int q = 0; q < 4; ++q) out[4 * l + q] = stdv * z[q][l];
  }
}

template <typename scalar_t>
void noise_span(PhiloxBatchFn philox_batch, scalar_t* p, int64_t n, uint64_t seed, uint64_t offset, float stdv,
                bool accumulate, int64_t blo, int64_t bhi) {
  using acc_t = at::opmath_type<scalar_t>;
  float z[4][kLanes];
  for (int64_t first = blo; first < bhi; first += kLanes) {
    const int64_t lanes = std::min<int64_t>(kLanes, bhi - first);
    if (lanes == kLanes) {
      normals_batch(philox_batch, seed, offset, static_cast<uint64_t>(first), z);
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
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (count == 4 * kLanes) {
        store_batch_f32(out, z, stdv, accumulate);
        continue;
      }
    }
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
  static const PhiloxBatchFn philox_batch = choose_philox_batch();  // once per process, not per batch
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, work.scalar_type(), "philox_noise_cpu", [&] {
    scalar_t* p = work.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t blo, int64_t bhi) {
      noise_span<scalar_t>(philox_batch, p, n, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                           static_cast<float>(stdv), accumulate, blo, bhi);
    });
  });
  if (!work.is_same(buf)) buf.copy_(work);
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) { m.impl("philox_noise_", &philox_noise_cpu); }

}  // namespace bpclip
