// CUDA launcher of exact_bound_: checks and dtype dispatch; the launch is bound_launch.cuh
// (shared with the test emulator).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../bound_args.h"
#include "launch.h"
// launch.h first: the launch sequence calls its launch().
#include "bound_launch.cuh"

namespace bpclip {
namespace cuda {
namespace {

void exact_bound_cuda(at::Tensor& sq, at::Tensor& bound, const at::Tensor& x, const at::Tensor& g,
                      const at::Tensor& gb, const at::Tensor& wa, const at::Tensor& wb, int64_t offset, int64_t per, int64_t flags,
                      at::ArrayRef<double> consts, const c10::optional<at::Tensor>& nonfinite) {
  const BoundGeometry s = check_bound_args(sq, bound, x, g, gb, wa, wb, offset, per, flags, consts, nonfinite);
  if (s.examples == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  unsigned long long* counter = nullptr;
  if (nonfinite.has_value() && nonfinite->defined())
    counter = reinterpret_cast<unsigned long long*>(nonfinite->mutable_data_ptr<int64_t>());
  const at::Tensor scratch = at::empty({bound_scratch(s)}, x.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "exact_bound_cuda", [&] {
    exact_bound_device<scalar_t>(x.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
                                 (flags & kBoundBias) ? gb.const_data_ptr<scalar_t>() : nullptr,
                                 s.L ? wa.const_data_ptr<scalar_t>() : nullptr,
                                 s.L ? wb.const_data_ptr<scalar_t>() : nullptr, s, consts.data(),
                                 sq.mutable_data_ptr<double>() + offset, bound.mutable_data_ptr<double>() + offset,
                                 counter, scratch.mutable_data_ptr<double>());
  });
}

std::tuple<at::Tensor, at::Tensor> exact_factors_cuda(at::TensorList bounds, at::Tensor& nonfinite, double max_norm,
                                                      c10::string_view clip_fn, double gamma, bool fp64) {
  const FactorsArgs a = check_factors_args(bounds, nonfinite, max_norm, clip_fn, gamma);
  const c10::cuda::CUDAGuard guard(bounds[0].device());
  const at::TensorOptions opts = bounds[0].options();
  at::Tensor factor = at::empty({a.B}, opts.dtype(fp64 ? at::kDouble : at::kFloat));
  at::Tensor total = at::empty({a.B}, opts);
  if (a.B == 0) return {factor, total};
  // One [L, B] buffer for the kernel (a launch more than the CPU kernel, which reads the list).
  const at::Tensor stacked = a.L == 1 ? bounds[0] : at::stack(bounds);
  auto* counter = reinterpret_cast<unsigned long long*>(nonfinite.mutable_data_ptr<int64_t>());
  if (fp64) {
    exact_factors_device<double>(stacked.const_data_ptr<double>(), a.L, a.B, a.inflate, a.bound_eff, a.fn, gamma,
                                 factor.mutable_data_ptr<double>(), total.mutable_data_ptr<double>(), counter);
  } else {
    exact_factors_device<float>(stacked.const_data_ptr<double>(), a.L, a.B, a.inflate, a.bound_eff, a.fn, gamma,
                                factor.mutable_data_ptr<float>(), total.mutable_data_ptr<double>(), counter);
  }
  return {factor, total};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) {
  m.impl("exact_bound_", &cuda::exact_bound_cuda);
  m.impl("exact_factors", &cuda::exact_factors_cuda);
}

}  // namespace bpclip
