// CUDA launchers of examples_bound and examples_release: checks, allocation and dtype dispatch.
// The launches are examples_launch.cuh (shared with the test emulator), the kernels
// examples_kernels.cuh.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "../common.h"
#include "../bound_args.h"
#include "../examples_args.h"
#include "launch.h"
// launch.h first: the launch sequences call its launch().
#include "examples_launch.cuh"

namespace bpclip {
namespace cuda {
namespace {

at::Tensor examples_bound_cuda(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                               std::optional<at::Tensor> nonfinite) {
  const ExamplesArgs a = check_examples_args(weight, bias, "examples_bound");
  if (nonfinite) check_counter(*nonfinite, a.like);
  const c10::cuda::CUDAGuard guard(a.like.device());
  at::Tensor out = at::empty({a.s.B}, a.like.options().dtype(at::kDouble));
  if (a.s.B == 0) return out;
  // The counter's storage is int64; CUDA's 64-bit atomicAdd takes unsigned long long.
  at::Tensor counter;
  if (nonfinite) counter = nonfinite->is_contiguous() ? *nonfinite : nonfinite->contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.like.scalar_type(), "examples_bound_cuda", [&] {
    using dev_t = typename DeviceType<scalar_t>::type;
    examples_bound_device(a.w.defined() ? dev_ptr(a.w.const_data_ptr<scalar_t>()) : static_cast<const dev_t*>(nullptr),
                          a.b.defined() ? dev_ptr(a.b.const_data_ptr<scalar_t>()) : static_cast<const dev_t*>(nullptr),
                          a.s.B, a.s.Nw, a.s.Nb, a.like.scalar_type() == at::kDouble, out.mutable_data_ptr<double>(),
                          counter.defined()
                              ? reinterpret_cast<unsigned long long*>(counter.mutable_data_ptr<int64_t>())
                              : nullptr);
  });
  if (nonfinite && !counter.is_same(*nonfinite)) nonfinite->copy_(counter);
  return out;
}

std::tuple<at::Tensor, at::Tensor> examples_factors_cuda(const std::optional<at::Tensor>& weight,
                                                         const std::optional<at::Tensor>& bias, at::Tensor& nonfinite,
                                                         double max_norm, c10::string_view clip_fn, double gamma,
                                                         bool fp64) {
  const ExamplesArgs a = check_examples_args(weight, bias, "examples_factors");
  check_counter(nonfinite, a.like);
  const FactorsArgs f = factor_params(a.s.B, 1, max_norm, clip_fn, gamma);
  const c10::cuda::CUDAGuard guard(a.like.device());
  at::Tensor bound = at::empty({a.s.B}, a.like.options().dtype(at::kDouble));
  at::Tensor factor = at::empty({a.s.B}, a.like.options().dtype(fp64 ? at::kDouble : at::kFloat));
  if (a.s.B == 0) return {factor, bound};
  at::Tensor counter = nonfinite.is_contiguous() ? nonfinite : nonfinite.contiguous();
  auto* cp = reinterpret_cast<unsigned long long*>(counter.mutable_data_ptr<int64_t>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.like.scalar_type(), "examples_factors_cuda", [&] {
    using dev_t = typename DeviceType<scalar_t>::type;
    const dev_t* wp = a.w.defined() ? dev_ptr(a.w.const_data_ptr<scalar_t>()) : static_cast<const dev_t*>(nullptr);
    const dev_t* bp = a.b.defined() ? dev_ptr(a.b.const_data_ptr<scalar_t>()) : static_cast<const dev_t*>(nullptr);
    const bool f64 = a.like.scalar_type() == at::kDouble;
    if (fp64) {
      examples_factors_device(wp, bp, a.s.B, a.s.Nw, a.s.Nb, f64, bound.mutable_data_ptr<double>(), cp,
                              factor.mutable_data_ptr<double>(), f.bound_eff, f.fn, gamma);
    } else {
      examples_factors_device(wp, bp, a.s.B, a.s.Nw, a.s.Nb, f64, bound.mutable_data_ptr<double>(), cp,
                              factor.mutable_data_ptr<float>(), f.bound_eff, f.fn, gamma);
    }
  });
  if (!counter.is_same(nonfinite)) nonfinite.copy_(counter);
  return {factor, bound};
}

std::tuple<at::Tensor, at::Tensor> examples_release_cuda(const std::optional<at::Tensor>& weight,
                                                         const std::optional<at::Tensor>& bias,
                                                         const at::Tensor& factor_in, at::IntArrayRef noise_key,
                                                         double noise_std, double scale) {
  const ExamplesArgs a = check_examples_args(weight, bias, "examples_release");
  const ReleaseNoise k = check_release_args(a, factor_in, noise_key, noise_std, scale);
  const c10::cuda::CUDAGuard guard(a.like.device());
  const at::Tensor factor = factor_in.contiguous();
  at::Tensor ow = a.w.defined() ? at::empty(a.w.sizes().slice(1), a.like.options()) : a.like.new_empty({0});
  at::Tensor ob = a.b.defined() ? at::empty(a.b.sizes().slice(1), a.like.options()) : a.like.new_empty({0});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.like.scalar_type(), "examples_release_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using dev_t = typename DeviceType<scalar_t>::type;
    examples_release_device<dev_t, acc_t>(
        a.w.defined() ? dev_ptr(a.w.const_data_ptr<scalar_t>()) : static_cast<const dev_t*>(nullptr),
        a.b.defined() ? dev_ptr(a.b.const_data_ptr<scalar_t>()) : static_cast<const dev_t*>(nullptr),
        factor.const_data_ptr<acc_t>(), a.s.B, a.s.Nw, a.s.Nb, k.seed, k.offset, k.stdv, static_cast<acc_t>(scale),
        a.w.defined() ? dev_ptr(ow.mutable_data_ptr<scalar_t>()) : static_cast<dev_t*>(nullptr),
        a.b.defined() ? dev_ptr(ob.mutable_data_ptr<scalar_t>()) : static_cast<dev_t*>(nullptr));
  });
  return {ow, ob};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) {
  m.impl("examples_bound", &cuda::examples_bound_cuda);
  m.impl("examples_factors", &cuda::examples_factors_cuda);
  m.impl("examples_release", &cuda::examples_release_cuda);
}

}  // namespace bpclip
