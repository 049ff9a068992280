// CUDA launcher of layer_tail_ (bpclip_fast/tail.h): checks, workspace and dtype dispatch. The launch
// sequence is tail_launch.cuh (shared with the test emulator), the kernel tail_kernels.cuh.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common.h"
#include "launch.h"
// launch.h first: the launch sequence calls its launch().
#include "tail_launch.cuh"

namespace bpclip {
namespace cuda {
namespace {

at::Tensor layer_tail_cuda(at::Tensor& w, at::Tensor& b, const c10::optional<at::Tensor>& bias_rows,
                           const c10::optional<at::Tensor>& grad, const c10::optional<at::Tensor>& clipped,
                           const c10::optional<at::Tensor>& factor, const c10::optional<at::Tensor>& norm,
                           double input_bound, c10::string_view clip_fn, int64_t seed, int64_t offset, double stdv,
                           double scale) {
  const int fn = check_tail_args(w, b, bias_rows, grad, clipped, factor, norm, input_bound, clip_fn, stdv, scale);
  const c10::cuda::CUDAGuard guard(w.device());
  const bool rows = bias_rows.has_value() && bias_rows->defined();
  const bool jvp = grad.has_value() && grad->defined();
  const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto seed_u = static_cast<uint64_t>(seed), offset_u = static_cast<uint64_t>(offset);
  const int64_t R = rows ? bias_rows->size(0) : 0;
  if (!jvp) {
    AT_DISPATCH_FLOATING_TYPES(w.scalar_type(), "layer_tail_cuda", [&] {
      layer_tail_device<scalar_t, scalar_t>(
          w.mutable_data_ptr<scalar_t>(), w.numel(), b.mutable_data_ptr<scalar_t>(), b.numel(), rows,
          rows ? bias_rows->const_data_ptr<scalar_t>() : nullptr, R, seed_u, offset_u, stdv, stdv > 0.0, scale,
          static_cast<const scalar_t*>(nullptr), nullptr, nullptr, nullptr, make_row_geometry(0, 0, 1, 0, 1), 0.0, 0,
          nullptr, nullptr, nullptr, sm_count);
    });
    return w.new_empty({0});
  }
  const at::Tensor g = grad->contiguous();
  const at::Tensor xc = clipped->contiguous();
  const at::Tensor fc = factor->contiguous(), nc = norm->contiguous();
  const RowGeometry r = row_geometry(g, kL2, kReduceChunk);
  at::Tensor out = at::empty_like(g, at::MemoryFormat::Contiguous);
  const auto work_opts = g.options().dtype(at::kDouble);
  at::Tensor partial = at::empty({r.B > 0 ? backward_partial_count(r) : 0}, work_opts);
  at::Tensor sums = at::empty({r.B > 0 ? backward_sums_count(r) : 0}, work_opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "layer_tail_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    layer_tail_device<typename DeviceType<scalar_t>::type, acc_t>(
        w.mutable_data_ptr<acc_t>(), w.numel(), b.mutable_data_ptr<acc_t>(), b.numel(), rows,
        rows ? bias_rows->const_data_ptr<acc_t>() : nullptr, R, seed_u, offset_u, stdv, stdv > 0.0, scale,
        dev_ptr(g.const_data_ptr<scalar_t>()), dev_ptr(xc.const_data_ptr<scalar_t>()), fc.const_data_ptr<acc_t>(),
        nc.const_data_ptr<acc_t>(), r, input_bound, fn, partial.mutable_data_ptr<double>(),
        sums.mutable_data_ptr<double>(), dev_ptr(out.mutable_data_ptr<scalar_t>()), sm_count);
  });
  return out;
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) { m.impl("layer_tail_", &cuda::layer_tail_cuda); }

}  // namespace bpclip
