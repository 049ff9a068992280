// CPU kernel of philox_noise_: buf (+)= std * N(0, 1) from the shared Philox4x32-10 stream.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common.h"
#include "bpclip_fast/philox.h"

namespace bpclip {
namespace {

constexpr int64_t kBlocksPerTask = 2048;  // 8192 elements: one task per few tens of microseconds

template <typename scalar_t>
void noise_span(scalar_t* p, int64_t n, uint64_t seed, uint64_t offset, float stdv, bool accumulate, int64_t blo,
                int64_t bhi) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t blk = blo; blk < bhi; ++blk) {
    float z[4];
    philox_normal4(seed, offset, static_cast<uint64_t>(blk), z);
    const int64_t base = blk * 4;
    const int64_t lanes = std::min<int64_t>(4, n - base);
    for (int64_t l = 0; l < lanes; ++l) {
      const acc_t v = static_cast<acc_t>(stdv * z[l]);
      p[base + l] = accumulate ? static_cast<scalar_t>(static_cast<acc_t>(p[base + l]) + v) : static_cast<scalar_t>(v);
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
