// CUDA launchers of clip_rows and clip_rows_backward: checks, allocation and dtype dispatch. The
// launch sequence is clip_launch.cuh (shared with the test emulator), the kernels clip_kernels.cuh.
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
  const auto acc_opts = x.options().dtype(acc_type_of(x));
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor factor = at::empty({r.B}, acc_opts);
  at::Tensor norms = at::empty({r.B}, acc_opts);
  if (r.B == 0) return {out, factor, norms};
  at::Tensor partial = at::empty({partial_count(r)}, acc_opts);
  // The counter's storage is int64; CUDA's 64-bit atomicAdd takes unsigned long long.
  at::Tensor counter = nonfinite.is_contiguous() ? nonfinite : nonfinite.contiguous();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "clip_rows_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    clip_rows_device(dev_ptr(x.const_data_ptr<scalar_t>()), r, norm == kL15, static_cast<acc_t>(bound), fn,
                     static_cast<acc_t>(gamma), partial.mutable_data_ptr<acc_t>(), norms.mutable_data_ptr<acc_t>(),
                     factor.mutable_data_ptr<acc_t>(),
                     reinterpret_cast<unsigned long long*>(counter.mutable_data_ptr<int64_t>()),
                     dev_ptr(out.mutable_data_ptr<scalar_t>()));
  });
  if (!counter.is_same(nonfinite)) nonfinite.copy_(counter);
  return {out, factor, norms};
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
  const auto acc_opts = g.options().dtype(acc_type_of(g));
  at::Tensor partial = at::empty({partial_count(r)}, acc_opts);
  at::Tensor dot = at::empty({r.B}, acc_opts);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "clip_rows_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    clip_rows_backward_device(dev_ptr(g.const_data_ptr<scalar_t>()), dev_ptr(xc.const_data_ptr<scalar_t>()),
                              fc.const_data_ptr<acc_t>(), nc.const_data_ptr<acc_t>(), r, static_cast<acc_t>(bound),
                              fn, partial.mutable_data_ptr<acc_t>(), dot.mutable_data_ptr<acc_t>(),
                              dev_ptr(out.mutable_data_ptr<scalar_t>()));
  });
  return out;
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) {
  m.impl("clip_rows", &cuda::clip_rows_cuda);
  m.impl("clip_rows_backward", &cuda::clip_rows_backward_cuda);
}

}  // namespace bpclip
