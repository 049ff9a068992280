// CUDA launcher of norm_affine_example_grads: checks, allocation and dtype dispatch; the launch
// sequence is norm_affine_launch.cuh (shared with the test emulator).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common.h"
#include "launch.h"
// launch.h first: the launch sequence calls its launch().
#include "norm_affine_launch.cuh"

namespace bpclip {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> norm_affine_example_grads_cuda(const at::Tensor& grad_out, const at::Tensor& x_in,
                                                                  const at::Tensor& mean_in, const at::Tensor& rstd_in,
                                                                  int64_t batch, int64_t groups, bool layer_norm) {
  const NormAffineShape s = check_norm_affine_args(grad_out, x_in, mean_in, rstd_in, batch, groups, layer_norm);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto acc = acc_type_of(x_in);
  const auto acc_opts = x_in.options().dtype(acc);
  at::Tensor gw = at::empty({s.B, s.D}, acc_opts);
  at::Tensor gb = at::empty({s.B, s.D}, acc_opts);
  if (s.B * s.D == 0) return {gw, gb};
  const at::Tensor g = grad_out.contiguous();
  const at::Tensor x = x_in.contiguous();
  // The kernels read the statistics as acc_t (exact for half-typed ones); they are 1/D (1/(C/G * R))
  // of the data, so the conversion costs little.
  const at::Tensor mean = mean_in.reshape({-1}).to(acc).contiguous();
  const at::Tensor rstd = rstd_in.reshape({-1}).to(acc).contiguous();
  const int64_t work_n = affine_workspace_count(s.layer_norm, s.B, s.R, s.D);
  at::Tensor work = at::empty({work_n}, acc_opts);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "norm_affine_example_grads_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    norm_affine_device(dev_ptr(g.const_data_ptr<scalar_t>()), dev_ptr(x.const_data_ptr<scalar_t>()),
                       mean.const_data_ptr<acc_t>(), rstd.const_data_ptr<acc_t>(), s.layer_norm, s.B, s.R, s.D, s.G,
                       work_n ? work.mutable_data_ptr<acc_t>() : static_cast<acc_t*>(nullptr),
                       gw.mutable_data_ptr<acc_t>(), gb.mutable_data_ptr<acc_t>());
  });
  return {gw, gb};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) { m.impl("norm_affine_example_grads", &cuda::norm_affine_example_grads_cuda); }

}  // namespace bpclip
