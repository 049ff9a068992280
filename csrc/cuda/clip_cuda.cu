// CUDA launchers of clip_rows, scale_rows and clip_rows_backward: checks, allocation and dtype
// dispatch. The launch sequences are clip_launch.cuh (shared with the test emulator), the kernels
// clip_kernels.cuh.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common.h"
#include "launch.h"
// launch.h first: the launch sequences call its launch().
#include "clip_launch.cuh"

namespace bpclip {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> clip_rows_cuda(const at::Tensor& x_in, at::Tensor& nonfinite,
                                                               double bound, c10::string_view norm_s,
                                                               c10::string_view clip_fn_s, double gamma) {
  const auto [norm, fn] = check_clip_rows_args(x_in, nonfinite, bound, norm_s, clip_fn_s, gamma);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const RowGeometry r = row_geometry(x, norm, kReduceChunk);
  const auto fac_opts = x.options().dtype(acc_type_of(x));
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor factor = at::empty({r.B}, fac_opts);
  at::Tensor norms = at::empty({r.B}, fac_opts);
  if (r.B == 0) return {out, factor, norms};
  at::Tensor partial = at::empty({partial_count(r)}, x.options().dtype(at::kDouble));
  // The counter's storage is int64; CUDA's 64-bit atomicAdd takes unsigned long long.
  at::Tensor counter = nonfinite.is_contiguous() ? nonfinite : nonfinite.contiguous();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "clip_rows_cuda", [&] {
    using fac_t = at::opmath_type<scalar_t>;
    clip_rows_device(dev_ptr(x.const_data_ptr<scalar_t>()), r, norm == kL15, bound, fn, gamma,
                     partial.mutable_data_ptr<double>(), norms.mutable_data_ptr<fac_t>(),
                     factor.mutable_data_ptr<fac_t>(),
                     reinterpret_cast<unsigned long long*>(counter.mutable_data_ptr<int64_t>()),
                     dev_ptr(out.mutable_data_ptr<scalar_t>()));
  });
  if (!counter.is_same(nonfinite)) nonfinite.copy_(counter);
  return {out, factor, norms};
}

at::Tensor scale_rows_cuda(const at::Tensor& x_in, const at::Tensor& factor_in) {
  check_scale_rows_args(x_in, factor_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor factor = factor_in.contiguous();
  const RowGeometry r = row_geometry(x, kL2, kReduceChunk);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "scale_rows_cuda", [&] {
    using fac_t = at::opmath_type<scalar_t>;
    scale_rows_device(dev_ptr(x.const_data_ptr<scalar_t>()), factor.const_data_ptr<fac_t>(), r.B, r.N,
                      dev_ptr(out.mutable_data_ptr<scalar_t>()));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> scale_rows2_cuda(const at::Tensor& x_in, const at::Tensor& fx_in,
                                                    const at::Tensor& y_in, const at::Tensor& fy_in, bool mask_y) {
  check_scale_rows2_args(x_in, fx_in, y_in, fy_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), y = y_in.contiguous();
  const at::Tensor fx = fx_in.contiguous(), fy = fy_in.contiguous();
  const RowGeometry rx = row_geometry(x, kL2, kReduceChunk), ry = row_geometry(y, kL2, kReduceChunk);
  at::Tensor ox = at::empty_like(x, at::MemoryFormat::Contiguous), oy = at::empty_like(y, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "scale_rows2_cuda", [&] {
    using fac_t = at::opmath_type<scalar_t>;
    scale_rows2_device(dev_ptr(x.const_data_ptr<scalar_t>()), fx.const_data_ptr<fac_t>(), rx.N,
                       dev_ptr(ox.mutable_data_ptr<scalar_t>()), dev_ptr(y.const_data_ptr<scalar_t>()),
                       fy.const_data_ptr<fac_t>(), ry.N, mask_y, rx.B, dev_ptr(oy.mutable_data_ptr<scalar_t>()));
  });
  return {ox, oy};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> clip_rows_rescale_cuda(
    const at::Tensor& g_in, at::Tensor& nonfinite, double bound, c10::string_view norm_s, c10::string_view clip_fn_s,
    double gamma, const at::Tensor& x_in, const at::Tensor& x_factor_in) {
  const auto [norm, fn] = check_clip_rows_args(g_in, nonfinite, bound, norm_s, clip_fn_s, gamma);
  check_clip_rows_rescale_args(g_in, x_in, x_factor_in);
  const c10::cuda::CUDAGuard guard(g_in.device());
  const at::Tensor g = g_in.contiguous(), x = x_in.contiguous(), x_factor = x_factor_in.contiguous();
  const RowGeometry r = row_geometry(g, norm, kReduceChunk);
  const RowGeometry rx = row_geometry(x, kL2, kReduceChunk);
  const auto fac_opts = g.options().dtype(acc_type_of(g));
  at::Tensor out = at::empty_like(g, at::MemoryFormat::Contiguous);
  at::Tensor x_out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor factor = at::empty({r.B}, fac_opts);
  at::Tensor norms = at::empty({r.B}, fac_opts);
  if (r.B == 0) return {out, factor, norms, x_out};
  at::Tensor partial = at::empty({partial_count(r)}, g.options().dtype(at::kDouble));
  at::Tensor counter = nonfinite.is_contiguous() ? nonfinite : nonfinite.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "clip_rows_rescale_cuda", [&] {
    using fac_t = at::opmath_type<scalar_t>;
    clip_rows_rescale_device(dev_ptr(g.const_data_ptr<scalar_t>()), r, norm == kL15, bound, fn, gamma,
                             partial.mutable_data_ptr<double>(), norms.mutable_data_ptr<fac_t>(),
                             factor.mutable_data_ptr<fac_t>(),
                             reinterpret_cast<unsigned long long*>(counter.mutable_data_ptr<int64_t>()),
                             dev_ptr(out.mutable_data_ptr<scalar_t>()), dev_ptr(x.const_data_ptr<scalar_t>()),
                             x_factor.const_data_ptr<fac_t>(), rx.N, dev_ptr(x_out.mutable_data_ptr<scalar_t>()));
  });
  if (!counter.is_same(nonfinite)) nonfinite.copy_(counter);
  return {out, factor, norms, x_out};
}

at::Tensor clip_rows_backward_cuda(const at::Tensor& grad_in, const at::Tensor& clipped_in, const at::Tensor& factor,
                                   const at::Tensor& norms, double bound, c10::string_view clip_fn_s) {
  const int fn = check_clip_backward_args(grad_in, clipped_in, factor, norms, bound, clip_fn_s);
  const c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor g = grad_in.contiguous();
  const at::Tensor xc = clipped_in.contiguous();
  const RowGeometry r = row_geometry(g, kL2, kReduceChunk);
  at::Tensor out = at::empty_like(g, at::MemoryFormat::Contiguous);
  if (r.B == 0) return out;
  const at::Tensor fc = factor.contiguous(), nc = norms.contiguous();
  const auto work_opts = g.options().dtype(at::kDouble);
  at::Tensor partial = at::empty({backward_partial_count(r)}, work_opts);
  at::Tensor sums = at::empty({backward_sums_count(r)}, work_opts);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "clip_rows_backward_cuda", [&] {
    using fac_t = at::opmath_type<scalar_t>;
    clip_rows_backward_device(dev_ptr(g.const_data_ptr<scalar_t>()), dev_ptr(xc.const_data_ptr<scalar_t>()),
                              fc.const_data_ptr<fac_t>(), nc.const_data_ptr<fac_t>(), r, bound, fn,
                              partial.mutable_data_ptr<double>(), sums.mutable_data_ptr<double>(),
                              dev_ptr(out.mutable_data_ptr<scalar_t>()));
  });
  return out;
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) {
  m.impl("clip_rows", &cuda::clip_rows_cuda);
  m.impl("clip_rows_backward", &cuda::clip_rows_backward_cuda);
  m.impl("scale_rows", &cuda::scale_rows_cuda);
  m.impl("scale_rows2", &cuda::scale_rows2_cuda);
  m.impl("clip_rows_rescale", &cuda::clip_rows_rescale_cuda);
}

}  // namespace bpclip
