// CPU kernels of the integer-noise ops, discrete_gaussian_ (bpclip_fast/discrete_gaussian.h) and
// integer_release_ (bpclip_fast/integer_release.h): one element at a time, split across threads;
// each element reads only its own words, so the split changes no bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "../dgauss_args.h"

namespace bpclip {
namespace {

void discrete_gaussian_cpu(at::Tensor& out, int64_t seed, int64_t offset, int64_t sigma) {
  check_discrete_gaussian_args(out, sigma);
  at::Tensor work = out.is_contiguous() ? out : out.contiguous();
  int64_t* p = work.mutable_data_ptr<int64_t>();
  const uint64_t s = static_cast<uint64_t>(sigma);
  at::parallel_for(0, work.numel(), 1024, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      p[i] = discrete_gaussian(static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), static_cast<uint64_t>(i), s);
    }
  });
  if (!work.is_same(out)) out.copy_(work);
}

void integer_release_cpu(at::Tensor& buf, int64_t seed, int64_t offset, int64_t first, double multiplier,
                         int64_t grid_exp, int64_t sigma, double scale) {
  check_integer_release_args(buf, first, multiplier, grid_exp, sigma, scale);
  at::Tensor work = buf.is_contiguous() ? buf : buf.contiguous();
  AT_DISPATCH_FLOATING_TYPES(work.scalar_type(), "integer_release_cpu", [&] {
    scalar_t* p = work.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, work.numel(), 1024, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        p[i] = static_cast<scalar_t>(integer_release_value(static_cast<double>(p[i]), static_cast<uint64_t>(seed),
                                                           static_cast<uint64_t>(offset), static_cast<uint64_t>(first + i),
                                                           multiplier, static_cast<int>(grid_exp),
                                                           static_cast<uint64_t>(sigma), scale));
      }
    });
  });
  if (!work.is_same(buf)) buf.copy_(work);
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) {
  m.impl("discrete_gaussian_", &discrete_gaussian_cpu);
  m.impl("integer_release_", &integer_release_cpu);
}

}  // namespace bpclip
