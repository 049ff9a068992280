// CPU kernel of philox_noise_: buf (+)= std * N(0, 1) from the shared Philox4x32-10 stream.
//
// Noise is a first-order cost on CPU (torch's normal_ fills under 1 GB/s), so the groups of 8
// normals (three counter blocks each, bpclip_fast/philox.h) are generated kLanes at a time: the
// Philox rounds with AVX-512 or AVX2 intrinsics where the CPU has them (else in plain lane loops
// the compiler vectorises), Box-Muller and the stores in lane loops with AVX-512/AVX2 clones chosen
// at load time. FMA is deliberately not enabled, so every version rounds
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

#include "noise_cpu.h"
#include "vector_clones.h"

namespace bpclip {
namespace {

constexpr int64_t kLanes = 16;            // groups per batch: 3 x 16 counter blocks, 128 normals
constexpr int64_t kGroupsPerTask = 2048;  // 16384 elements per parallel task

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
// (BPCLIP_PHILOX_AVX512 also guards the AVX2 version below.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
static_assert(kLanes == 16, "the AVX-512 Philox holds one 32-bit word of 16 blocks per register");

// The counter words of blocks first..first+kLanes-1: x0[l] the low, y0[l] the high 32 bits.
inline void block_words(uint64_t first, uint32_t x0[kLanes], uint32_t y0[kLanes]) {
  for (int l = 0; l < kLanes; ++l) {
    const uint64_t blk = first + static_cast<uint64_t>(l);
    x0[l] = static_cast<uint32_t>(blk);
    y0[l] = static_cast<uint32_t>(blk >> 32);
  }
}

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
  block_words(first, x0, y0);
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

// The same with AVX2 (CPUs without AVX-512): two registers of eight lanes per word,
// _mm256_mul_epu32 for the even lanes as above. Bit-identical to philox_batch_generic, about 5x
// faster than its AVX2 clone (measured on Zen 3).
__attribute__((target("avx2"))) inline void mul_hi_lo_avx2(__m256i a, __m256i m, __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

__attribute__((target("avx2"))) void philox_batch_avx2(uint64_t seed, uint64_t offset, uint64_t first,
                                                        uint32_t r[4][kLanes]) {
  uint32_t x0[kLanes], y0[kLanes];
  block_words(first, x0, y0);
  __m256i x[2], y[2], w[2], v[2];
  for (int h = 0; h < 2; ++h) {
    x[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + 8 * h));
    y[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y0 + 8 * h));
    w[h] = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
    v[h] = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
  }
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m256i kk0 = _mm256_set1_epi32(static_cast<int>(k0)), kk1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int h = 0; h < 2; ++h) {
      __m256i hi0, lo0, hi1, lo1;
      mul_hi_lo_avx2(x[h], m0, &hi0, &lo0);
      mul_hi_lo_avx2(w[h], m1, &hi1, &lo1);
      x[h] = _mm256_xor_si256(_mm256_xor_si256(hi1, y[h]), kk0);
      y[h] = lo1;
      w[h] = _mm256_xor_si256(_mm256_xor_si256(hi0, v[h]), kk1);
      v[h] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r[0] + 8 * h), x[h]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r[1] + 8 * h), y[h]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r[2] + 8 * h), w[h]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r[3] + 8 * h), v[h]);
  }
}
#pragma GCC diagnostic pop
#endif

using PhiloxBatchFn = void (*)(uint64_t, uint64_t, uint64_t, uint32_t[4][kLanes]);

// Chosen once: the best version the CPU has (AVX-512, AVX2, portable lane loops), capped by
// BPCLIP_PHILOX=avx2|portable, or BPCLIP_NO_AVX512=1 (= portable). All give the same bits (integer
// arithmetic); the tests use the switches to check it.
PhiloxBatchFn choose_philox_batch() {
#ifdef BPCLIP_PHILOX_AVX512
  const char* cap = std::getenv("BPCLIP_PHILOX");
  const char* off = std::getenv("BPCLIP_NO_AVX512");
  const bool portable = (off && *off && std::strcmp(off, "0") != 0) || (cap && std::strcmp(cap, "portable") == 0);
  const bool no512 = portable || (cap && std::strcmp(cap, "avx2") == 0);
  __builtin_cpu_init();  // idempotent; guarantees the CPU model is filled in whatever the load order
  if (!no512 && __builtin_cpu_supports("avx512f")) return philox_batch_avx512;
  if (!portable && __builtin_cpu_supports("avx2")) return philox_batch_avx2;
#endif
  return philox_batch_generic;
}

// The 8*kLanes normals of groups first..first+kLanes-1, lane-major: z[q][l] is normal q of group
// first+l, exactly philox_normal8's order (the same normals_of_group). r[j] holds the words of the
// groups' blocks j: group_block(first + l, j) = group_block(first, j) + l, one Philox batch each.
BPCLIP_VECTOR_CLONES
void box_muller_batch(const uint32_t r[kBlocksPerGroup][4][kLanes], float z[kNormalsPerGroup][kLanes]) {
  for (int l = 0; l < kLanes; ++l) {
    float q[kNormalsPerGroup];
    normals_of_group(U4{r[0][0][l], r[0][1][l], r[0][2][l], r[0][3][l]},
                     U4{r[1][0][l], r[1][1][l], r[1][2][l], r[1][3][l]},
                     U4{r[2][0][l], r[2][1][l], r[2][2][l], r[2][3][l]}, q);
    for (int k = 0; k < kNormalsPerGroup; ++k) z[k][l] = q[k];
  }
}

// The same for a float64 buffer's normals (philox.h): the fourth block's words as the angles' low bits.
BPCLIP_VECTOR_CLONES
void box_muller_batch(const uint32_t r[kBlocksPerGroupF64][4][kLanes], double z[kNormalsPerGroup][kLanes]) {
  for (int l = 0; l < kLanes; ++l) {
    double q[kNormalsPerGroup];
    normals_of_group(U4{r[0][0][l], r[0][1][l], r[0][2][l], r[0][3][l]},
                     U4{r[1][0][l], r[1][1][l], r[1][2][l], r[1][3][l]},
                     U4{r[2][0][l], r[2][1][l], r[2][2][l], r[2][3][l]},
                     U4{r[3][0][l], r[3][1][l], r[3][2][l], r[3][3][l]}, q);
    for (int k = 0; k < kNormalsPerGroup; ++k) z[k][l] = q[k];
  }
}

template <typename Z>
void normals_batch(PhiloxBatchFn philox_batch, uint64_t seed, uint64_t offset, uint64_t first,
                   Z z[kNormalsPerGroup][kLanes]) {
  constexpr int kBlocks = std::is_same_v<Z, double> ? kBlocksPerGroupF64 : kBlocksPerGroup;
  uint32_t r[kBlocks][4][kLanes];
  for (int j = 0; j < kBlocks; ++j) philox_batch(seed, offset, group_block(first, j), r[j]);
  box_muller_batch(r, z);
}

// Groups first..first+lanes-1 into z (lane-major), whole batches through the vectorised path.
template <typename Z>
void normals_lanes(PhiloxBatchFn philox_batch, uint64_t seed, uint64_t offset, uint64_t first, int64_t lanes,
                   Z z[kNormalsPerGroup][kLanes]) {
  if (lanes == kLanes) {
    normals_batch<Z>(philox_batch, seed, offset, first, z);
    return;
  }
  for (int64_t l = 0; l < lanes; ++l) {
    Z q[kNormalsPerGroup];
    philox_normal8(seed, offset, first + static_cast<uint64_t>(l), q);
    for (int k = 0; k < kNormalsPerGroup; ++k) z[k][l] = q[k];
  }
}

// out[8l + q] (+)= stdv * z[q][l] for a full fp32 batch, then times `scale` where it is not 1. Its own
// clone so that the lane-major to element-major interleave vectorises too (in the generic template
// below it is a scalar gather). Rounds exactly like the generic path: one float multiply, then one
// float add (then one float multiply by the scale).
BPCLIP_VECTOR_CLONES
void store_batch_f32(float* out, const float z[kNormalsPerGroup][kLanes], float stdv, bool accumulate, bool scaled,
                     float scale) {
  if (accumulate) {
    for (int64_t l = 0; l < kLanes; ++l)
      for (int q = 0; q < kNormalsPerGroup; ++q)
        out[kNormalsPerGroup * l + q] = out[kNormalsPerGroup * l + q] + stdv * z[q][l];
  } else {
    for (int64_t l = 0; l < kLanes; ++l)
      for (int q = 0; q < kNormalsPerGroup; ++q) out[kNormalsPerGroup * l + q] = stdv * z[q][l];
  }
  if (scaled) {
    for (int64_t i = 0; i < kNormalsPerGroup * kLanes; ++i) out[i] = out[i] * scale;
  }
}

// A float64 buffer draws float64 normals times the double std (philox.h); every other dtype float
// normals times the std rounded to float.
template <typename scalar_t>
void noise_span(PhiloxBatchFn philox_batch, scalar_t* p, int64_t n, uint64_t seed, uint64_t offset, double std_in,
                bool accumulate, double scale, int64_t glo, int64_t ghi) {
  using acc_t = at::opmath_type<scalar_t>;
  using Z = normal_t<scalar_t>;
  const Z stdv = static_cast<Z>(std_in);
  // The scale as mul_(scale) would apply it to the stored values afterwards: in the opmath type,
  // one product, rounded to scalar_t (so scale 1 leaves the bits as they are, and is not applied).
  const bool scaled = scale != 1.0;
  const acc_t s = static_cast<acc_t>(scale);
  constexpr int64_t kPer = kNormalsPerGroup;
  Z z[kPer][kLanes];
  for (int64_t first = glo; first < ghi; first += kLanes) {
    const int64_t lanes = std::min<int64_t>(kLanes, ghi - first);
    normals_lanes<Z>(philox_batch, seed, offset, static_cast<uint64_t>(first), lanes, z);
    const int64_t base = first * kPer;
    const int64_t count = std::min<int64_t>(kPer * lanes, n - base);
    scalar_t* out = p + base;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (count == kPer * kLanes) {
        store_batch_f32(out, z, stdv, accumulate, scaled, s);
        continue;
      }
    }
    if (accumulate) {
      for (int64_t i = 0; i < count; ++i)
        out[i] = static_cast<scalar_t>(static_cast<acc_t>(out[i]) + static_cast<acc_t>(stdv * z[i % kPer][i / kPer]));
    } else {
      for (int64_t i = 0; i < count; ++i) out[i] = static_cast<scalar_t>(stdv * z[i % kPer][i / kPer]);
    }
    if (scaled) {
      for (int64_t i = 0; i < count; ++i) out[i] = static_cast<scalar_t>(static_cast<acc_t>(out[i]) * s);
    }
  }
}

void philox_noise_cpu(at::Tensor& buf, int64_t seed, int64_t offset, double stdv, bool accumulate, double scale) {
  check_noise_args(buf, stdv, scale);
  const int64_t n = buf.numel();
  if (n == 0) return;
  // The stream is indexed by the contiguous (row-major) position, whatever the strides of buf.
  at::Tensor work = buf.is_contiguous() ? buf : buf.contiguous();
  const int64_t groups = (n + kNormalsPerGroup - 1) / kNormalsPerGroup;
  static const PhiloxBatchFn philox_batch = choose_philox_batch();  // once per process, not per batch
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, work.scalar_type(), "philox_noise_cpu", [&] {
    scalar_t* p = work.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, groups, kGroupsPerTask, [&](int64_t glo, int64_t ghi) {
      noise_span<scalar_t>(philox_batch, p, n, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                           stdv, accumulate, scale, glo, ghi);
    });
  });
  if (!work.is_same(buf)) buf.copy_(work);
}

// A layer's weight and bias noise in one op (one launch on a GPU): exactly philox_noise_(w, offset)
// then philox_noise_(b, offset + 1), the offset incremented as an unsigned 64-bit counter word.
void philox_noise2_cpu(at::Tensor& w, at::Tensor& b, int64_t seed, int64_t offset, double stdv, bool accumulate_w,
                       bool accumulate_b, double scale) {
  check_noise2_args(w, b, stdv, scale);
  philox_noise_cpu(w, seed, offset, stdv, accumulate_w, scale);
  philox_noise_cpu(b, seed, static_cast<int64_t>(static_cast<uint64_t>(offset) + 1u), stdv, accumulate_b, scale);
}

template <typename Z>
void philox_normals_as(uint64_t seed, uint64_t offset, uint64_t first_group, int64_t groups, Z* z) {
  static const PhiloxBatchFn philox_batch = choose_philox_batch();
  Z zb[kNormalsPerGroup][kLanes];
  for (int64_t g0 = 0; g0 < groups; g0 += kLanes) {
    const int64_t lanes = std::min<int64_t>(kLanes, groups - g0);
    normals_lanes<Z>(philox_batch, seed, offset, first_group + static_cast<uint64_t>(g0), lanes, zb);
    for (int64_t l = 0; l < lanes; ++l)
      for (int k = 0; k < kNormalsPerGroup; ++k) z[kNormalsPerGroup * (g0 + l) + k] = zb[k][l];
  }
}

}  // namespace

void philox_normals(uint64_t seed, uint64_t offset, uint64_t first_group, int64_t groups, float* z) {
  philox_normals_as<float>(seed, offset, first_group, groups, z);
}

void philox_normals(uint64_t seed, uint64_t offset, uint64_t first_group, int64_t groups, double* z) {
  philox_normals_as<double>(seed, offset, first_group, groups, z);
}

void philox_noise_into(at::Tensor& buf, int64_t seed, int64_t offset, double stdv, bool accumulate, double scale) {
  philox_noise_cpu(buf, seed, offset, stdv, accumulate, scale);
}

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) {
  m.impl("philox_noise_", &philox_noise_cpu);
  m.impl("philox_noise2_", &philox_noise2_cpu);
}

}  // namespace bpclip
