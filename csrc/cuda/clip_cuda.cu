// CUDA launchers of clip_rows and clip_rows_backward; the kernels are in clip_kernels.cuh.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common.h"
#include "clip_kernels.cuh"
#include "launch.h"

namespace bpclip {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kWarpsPerBlock = kThreads / kWarpSize;

int64_t warp_blocks(int64_t warps) { return (warps + kWarpsPerBlock - 1) / kWarpsPerBlock; }

// Partial sums of one reduction mode, then the per-row finalisation.
template <typename scalar_t, typename acc_t>
void reduce_rows(const scalar_t* x, const scalar_t* y, const RowGeometry& r, int mode, bool square_groups,
                 bool want_factor, double bound, int fn, double gamma, acc_t* norm_or_total, acc_t* factor,
                 int64_t* nonfinite, const at::TensorOptions& acc_opts) {
  using T = typename DeviceType<scalar_t>::type;
  const int64_t warps = r.B * r.G * r.K;
  at::Tensor partial = at::empty({warps}, acc_opts);
  acc_t* pp = partial.mutable_data_ptr<acc_t>();
  const T* xd = dev_ptr(x);
  const T* yd = y == nullptr ? nullptr : dev_ptr(y);
  if (mode == kSumSquares) {
    launch(row_partial_kernel<T, acc_t, kSumSquares>, warp_blocks(warps), kThreads, xd, yd, r.S, r.K, r.chunk, warps, pp);
  } else if (mode == kSumAbs) {
    launch(row_partial_kernel<T, acc_t, kSumAbs>, warp_blocks(warps), kThreads, xd, yd, r.S, r.K, r.chunk, warps, pp);
  } else {
    launch(row_partial_kernel<T, acc_t, kDot>, warp_blocks(warps), kThreads, xd, yd, r.S, r.K, r.chunk, warps, pp);
  }
  launch(finalize_rows_kernel<acc_t>, warp_blocks(r.B), kThreads, static_cast<const acc_t*>(pp), r.B, r.G, r.K,
         square_groups ? 1 : 0, want_factor ? 1 : 0, static_cast<acc_t>(bound), fn, static_cast<acc_t>(gamma),
         norm_or_total, factor, reinterpret_cast<unsigned long long*>(nonfinite));
}

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
  const bool l15 = norm == kL15;
  const int clip_fn = fn;
  // The counter's storage is int64; CUDA's 64-bit atomicAdd takes unsigned long long.
  at::Tensor counter = nonfinite.is_contiguous() ? nonfinite : nonfinite.contiguous();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "clip_rows_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using T = typename DeviceType<scalar_t>::type;
    acc_t* fp = factor.mutable_data_ptr<acc_t>();
    reduce_rows<scalar_t, acc_t>(x.const_data_ptr<scalar_t>(), nullptr, r, l15 ? kSumAbs : kSumSquares, l15, true,
                                 bound, clip_fn, gamma, norms.mutable_data_ptr<acc_t>(), fp,
                                 counter.mutable_data_ptr<int64_t>(), acc_opts);
    const int64_t tiles = (r.N + kScaleTile - 1) / kScaleTile;
    launch(scale_rows_kernel<T, acc_t>, r.B * tiles, kThreads, dev_ptr(x.const_data_ptr<scalar_t>()),
           static_cast<const acc_t*>(fp), r.N, tiles, dev_ptr(out.mutable_data_ptr<scalar_t>()));
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
  at::Tensor dot = at::empty({r.B}, acc_opts);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "clip_rows_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using T = typename DeviceType<scalar_t>::type;
    acc_t* dp = dot.mutable_data_ptr<acc_t>();
    reduce_rows<scalar_t, acc_t>(xc.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), r, kDot, false, false,
                                 bound, fn, 0.0, dp, nullptr, nullptr, acc_opts);
    const int64_t tiles = (r.N + kScaleTile - 1) / kScaleTile;
    launch(clip_jvp_kernel<T, acc_t>, r.B * tiles, kThreads, dev_ptr(g.const_data_ptr<scalar_t>()),
           dev_ptr(xc.const_data_ptr<scalar_t>()), fc.const_data_ptr<acc_t>(), nc.const_data_ptr<acc_t>(),
           static_cast<const acc_t*>(dp), static_cast<acc_t>(bound), fn, r.N, tiles,
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
