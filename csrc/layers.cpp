// The layer ops of Linear and Conv2d, written once over ATen and our dispatcher ops, so that the
// same code serves CPU and CUDA: the heavy math goes to ATen (oneDNN/MKL, cuBLAS/cuDNN).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "common.h"

namespace bpclip {
namespace {

using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Quad = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Triple clip_rows(const at::Tensor& x, at::Tensor& nonfinite, double bound, c10::string_view norm,
                 c10::string_view clip_fn, double gamma) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("bpclip_fast::clip_rows", "")
                       .typed<Triple(const at::Tensor&, at::Tensor&, double, c10::string_view, c10::string_view, double)>();
  return op.call(x, nonfinite, bound, norm, clip_fn, gamma);
}

at::Tensor clip_rows_backward(const at::Tensor& grad, const at::Tensor& clipped, const at::Tensor& factor,
                              const at::Tensor& norm, double bound, c10::string_view clip_fn) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("bpclip_fast::clip_rows_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                            c10::string_view)>();
  return op.call(grad, clipped, factor, norm, bound, clip_fn);
}

void philox_noise_(at::Tensor& buf, int64_t seed, int64_t offset, double stdv, bool accumulate) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("bpclip_fast::philox_noise_", "")
                       .typed<void(at::Tensor&, int64_t, int64_t, double, bool)>();
  op.call(buf, seed, offset, stdv, accumulate);
}

void check_layer_inputs(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        const char* layer) {
  check_float_tensor(x, "the input");
  check_same_device(x, weight, "the input", "the weight");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "bpclip_fast.", layer, ": the input is ", x.scalar_type(),
              " but the weight is ", weight.scalar_type());
  if (bias.has_value() && bias->defined()) {
    check_same_device(*bias, weight, "the bias", "the weight");
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type(), "bpclip_fast.", layer, ": bias dtype differs from weight");
  }
}

void check_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x_clipped, const at::Tensor& weight,
                           double grad_bound, double noise_std, const char* layer) {
  check_same_device(grad_out, x_clipped, "grad_out", "the saved input");
  check_same_device(grad_out, weight, "grad_out", "the weight");
  TORCH_CHECK(grad_out.scalar_type() == x_clipped.scalar_type(), "bpclip_fast.", layer, ": grad_out is ",
              grad_out.scalar_type(), " but the input was ", x_clipped.scalar_type());
  check_bound(grad_bound, "grad_bound");
  TORCH_CHECK(noise_std >= 0.0 && noise_std < 1e30, "bpclip_fast.", layer, ": noise_std must be finite and >= 0");
}

Quad linear_forward(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                    at::Tensor& nonfinite, double input_bound, c10::string_view clip_fn, double gamma) {
  check_layer_inputs(x, weight, bias, "linear_forward");
  TORCH_CHECK(x.dim() >= 2, "bpclip_fast.linear_forward: the input needs a batch dimension, [B, *, in_features]");
  auto [xc, factor, norm] = clip_rows(x, nonfinite, input_bound, "l2", clip_fn, gamma);
  at::Tensor out = at::linear(xc, weight, bias);
  return {out, xc, factor, norm};
}

Triple linear_backward(const at::Tensor& grad_out, const at::Tensor& x_clipped, const at::Tensor& x_factor,
                       const at::Tensor& x_norm, const at::Tensor& weight, at::Tensor& nonfinite, double grad_bound,
                       double input_bound, c10::string_view clip_fn, double gamma, bool has_bias, bool input_grad,
                       int64_t seed, int64_t offset, double noise_std) {
  check_backward_inputs(grad_out, x_clipped, weight, grad_bound, noise_std, "linear_backward");
  const int64_t in_f = weight.size(1), out_f = weight.size(0);
  auto [gc, gfactor, gnorm] = clip_rows(grad_out, nonfinite, grad_bound, "l2", clip_fn, gamma);
  const at::Tensor g2 = gc.reshape({-1, out_f});
  const at::Tensor x2 = x_clipped.reshape({-1, in_f});

  // The noise goes in first and the GEMM accumulates into it: one buffer, no extra pass.
  at::Tensor gw = at::empty_like(weight, at::MemoryFormat::Contiguous);
  if (noise_std > 0.0) {
    philox_noise_(gw, seed, offset, noise_std, false);
    gw.addmm_(g2.t(), x2);
  } else {
    at::mm_out(gw, g2.t(), x2);
  }
  at::Tensor gb = weight.new_empty({0});
  if (has_bias) {
    gb = g2.sum(0);
    if (noise_std > 0.0) philox_noise_(gb, seed, offset + 1, noise_std, true);
  }
  at::Tensor gx = x_clipped.new_empty({0});
  if (input_grad) {
    const at::Tensor gxc = at::mm(g2, weight).reshape(x_clipped.sizes());
    gx = clip_rows_backward(gxc, x_clipped, x_factor, x_norm, input_bound, clip_fn);
  }
  return {gx, gw, gb};
}

Quad conv2d_forward(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                    at::Tensor& nonfinite, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                    int64_t groups, double input_bound, c10::string_view clip_fn, double gamma) {
  check_layer_inputs(x, weight, bias, "conv2d_forward");
  TORCH_CHECK(x.dim() == 4, "bpclip_fast.conv2d_forward: the input must be [B, C, H, W], got ", x.dim(), " dims");
  auto [xc, factor, norm] = clip_rows(x, nonfinite, input_bound, "l2", clip_fn, gamma);
  at::Tensor out = at::convolution(xc, weight, bias, stride, padding, dilation, false, {0, 0}, groups);
  return {out, xc, factor, norm};
}

Triple conv2d_backward(const at::Tensor& grad_out, const at::Tensor& x_clipped, const at::Tensor& x_factor,
                       const at::Tensor& x_norm, const at::Tensor& weight, at::Tensor& nonfinite,
                       at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                       double grad_bound, c10::string_view grad_norm, double input_bound, c10::string_view clip_fn,
                       double gamma, bool has_bias, bool input_grad, int64_t seed, int64_t offset,
                       double noise_std) {
  check_backward_inputs(grad_out, x_clipped, weight, grad_bound, noise_std, "conv2d_backward");
  TORCH_CHECK(grad_out.dim() == 4, "bpclip_fast.conv2d_backward: grad_out must be [B, C, H, W]");
  auto [gc, gfactor, gnorm] = clip_rows(grad_out, nonfinite, grad_bound, grad_norm, clip_fn, gamma);
  at::Tensor gx_c, gw, gb;
  if (x_clipped.size(0) == 0) {
    gw = at::zeros_like(weight, at::MemoryFormat::Contiguous);
    if (has_bias) gb = at::zeros({weight.size(0)}, weight.options());
    if (input_grad) gx_c = at::zeros_like(x_clipped);
  } else {
    const std::vector<int64_t> bias_sizes{weight.size(0)};
    auto grads = at::convolution_backward(gc, x_clipped, weight, has_bias ? c10::OptionalIntArrayRef(bias_sizes) : c10::nullopt,
                                          stride, padding, dilation, false, {0, 0}, groups,
                                          {input_grad, true, has_bias});
    gx_c = std::get<0>(grads);
    gw = std::get<1>(grads).contiguous();
    gb = std::get<2>(grads);
  }
  // ATen's convolution backward has no accumulate-into-output form, so here the noise is added to
  // the fresh gradient buffer in place: the same memory traffic as writing it first.
  if (noise_std > 0.0) {
    philox_noise_(gw, seed, offset, noise_std, true);
    if (has_bias) philox_noise_(gb, seed, offset + 1, noise_std, true);
  }
  if (!has_bias) gb = weight.new_empty({0});
  at::Tensor gx = x_clipped.new_empty({0});
  if (input_grad) gx = clip_rows_backward(gx_c, x_clipped, x_factor, x_norm, input_bound, clip_fn);
  return {gx, gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) {
  m.impl("linear_forward", &linear_forward);
  m.impl("linear_backward", &linear_backward);
  m.impl("conv2d_forward", &conv2d_forward);
  m.impl("conv2d_backward", &conv2d_backward);
}

#ifdef BPCLIP_WITH_CUDA
TORCH_LIBRARY_IMPL(bpclip_fast, CUDA, m) {
  m.impl("linear_forward", &linear_forward);
  m.impl("linear_backward", &linear_backward);
  m.impl("conv2d_forward", &conv2d_forward);
  m.impl("conv2d_backward", &conv2d_backward);
}
#endif

}  // namespace bpclip
