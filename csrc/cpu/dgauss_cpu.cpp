// CPU kernel of discrete_gaussian_ (bpclip_fast/discrete_gaussian.h): one draw per element, split
// across threads; each element reads only its own words, so the split changes no bit.
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

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) { m.impl("discrete_gaussian_", &discrete_gaussian_cpu); }

}  // namespace bpclip
