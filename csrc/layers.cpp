// The layer ops of Linear and Conv2d, written once over ATen and our dispatcher ops, so that the
// same code serves CPU and CUDA: the heavy math goes to ATen (oneDNN/MKL, cuBLAS/cuDNN).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "common.h"
#include "dispatch.h"
#include "host_cache.h"
#include "bpclip_fast/tail.h"

namespace bpclip {
namespace {

using Triple = ops::Triple;
using ops::clip_rows;
using ops::clip_rows_rescale;

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

// The scalars of a backward op, in the groups of its schema (csrc/bpclip_fast.cpp): the two bounds,
// the clip function, what to compute, and the noise draw.
struct BackwardArgs {
  double input_bound, grad_bound;
  c10::string_view clip_fn;
  double gamma;
  bool input_grad, has_bias;
  int64_t seed, offset;
  double noise_std;
  double scale;  // the engine's mean-loss scale, applied after the noise (post-processing)
};

BackwardArgs backward_args(at::ArrayRef<double> bounds, c10::string_view clip_fn, double gamma,
                           std::array<bool, 2> output_mask, at::IntArrayRef noise_key, double noise_std,
                           double scale, const char* layer) {
  TORCH_CHECK(bounds.size() == 2, "bpclip_fast.", layer, ": bounds must be [input_bound, grad_bound]");
  TORCH_CHECK(noise_key.size() == 2, "bpclip_fast.", layer, ": noise_key must be [seed, offset]");
  check_bound(bounds[1], "grad_bound");
  TORCH_CHECK(noise_std_ok(noise_std), "bpclip_fast.", layer, ": noise_std must be " BPCLIP_NOISE_STD_RULE ", got ",
              noise_std);
  check_noise_scale(scale, layer);
  return {bounds[0], bounds[1], clip_fn, gamma, output_mask[0], output_mask[1], noise_key[0], noise_key[1], noise_std,
          scale};
}

void check_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                           const char* layer) {
  check_same_device(grad_out, x, "grad_out", "the saved input");
  check_same_device(grad_out, weight, "grad_out", "the weight");
  TORCH_CHECK(grad_out.scalar_type() == x.scalar_type(), "bpclip_fast.", layer, ": grad_out is ",
              grad_out.scalar_type(), " but the input was ", x.scalar_type());
}

// The backward's prologue, one op (clip_rows_rescale): the upstream gradient clipped per example
// (clip_rows), and x~ = RZ(s x) again, bit for bit as clip_rows wrote it in the forward, in the same
// elementwise launch as the gradient's scaling: scale_rows' element function (the exact product
// rounded toward zero to x's dtype, zeros where s = 0 whatever x holds; bpclip_fast/clip.h) into a
// row-major buffer (the layout clip_rows wrote; a non-contiguous x is made contiguous first, as
// clip_rows did in the forward).
// Why recompute rather than save x~: the layer's input x is usually saved anyway by the op that
// produced it (tanh and ReLU save their output), so saving x costs nothing, while x~ is a second
// copy of every layer input, measured as +24-32% peak memory on the CIFAR-10 net over non-private
// training. Recomputing costs one elementwise pass in the backward.
ops::Quad clipped_pair(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& x_factor,
                       at::Tensor& nonfinite, const BackwardArgs& a, c10::string_view grad_norm) {
  return clip_rows_rescale(grad_out, nonfinite, a.grad_bound, grad_norm, a.clip_fn, a.gamma, x, x_factor);
}

// The backward's epilogue, one op (layer_tail_, bpclip_fast/tail.h): the weight's noise (stream
// offset) and the bias' (offset + 1) added to the gradients, then the mean-loss scale; the bias' sum
// over the rows where bias_rows is given; and, where the input gradient is wanted, the input
// clipping's VJP of grad_xc. One launch for what were three (noise, bias sum, VJP).
at::Tensor layer_tail(at::Tensor& gw, at::Tensor& gb, const c10::optional<at::Tensor>& bias_rows,
                      const at::Tensor& grad_xc, const at::Tensor& x_clipped, const at::Tensor& x_factor,
                      const at::Tensor& x_norm, const BackwardArgs& a) {
  const bool jvp = a.input_grad && grad_xc.defined();
  return ops::layer_tail_if_needed(gw, gb, bias_rows, jvp ? c10::optional<at::Tensor>(grad_xc) : c10::nullopt,
                          jvp ? c10::optional<at::Tensor>(x_clipped) : c10::nullopt,
                          jvp ? c10::optional<at::Tensor>(x_factor) : c10::nullopt,
                          jvp ? c10::optional<at::Tensor>(x_norm) : c10::nullopt, a.input_bound, a.clip_fn, a.seed,
                          a.offset, a.noise_std, a.scale);
}

// fp16/bf16 weight and bias gradients are summed over the batch, noised and scaled (the mean-loss
// d/B) in fp32, and rounded to the parameter dtype once, after both (until the fifteenth session
// the scale was a mul_ in the parameter dtype, a second rounding): a sum rounded to fp16 before the noise would move
// by up to half an ulp of |sum| per entry, a rounding that depends on every example (so one
// example could move the release by more than Delta). The clipped values are exact in fp32.
bool low_precision(const at::Tensor& t) { return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16; }
at::Tensor widened(const at::Tensor& t) { return low_precision(t) ? t.to(at::kFloat) : t; }

Triple linear_forward(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      at::Tensor& nonfinite, double input_bound, c10::string_view clip_fn, double gamma) {
  check_layer_inputs(x, weight, bias, "linear_forward");
  TORCH_CHECK(x.dim() >= 2, "bpclip_fast.linear_forward: the input needs a batch dimension, [B, *, in_features]");
  auto [xc, factor, norm] = clip_rows(x, nonfinite, input_bound, "l2", clip_fn, gamma);
  return {at::linear(xc, weight, bias), factor, norm};
}

Triple linear_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& x_factor,
                       const at::Tensor& x_norm, const at::Tensor& weight, at::Tensor& nonfinite,
                       at::ArrayRef<double> bounds, c10::string_view clip_fn, double gamma,
                       std::array<bool, 2> output_mask, at::IntArrayRef noise_key, double noise_std, double scale) {
  const BackwardArgs a = backward_args(bounds, clip_fn, gamma, output_mask, noise_key, noise_std, scale,
                                       "linear_backward");
  check_backward_inputs(grad_out, x, weight, "linear_backward");
  const int64_t in_f = weight.size(1), out_f = weight.size(0);
  auto [gc, gfactor, gnorm, x_clipped] = clipped_pair(grad_out, x, x_factor, nonfinite, a, "l2");
  const at::Tensor g2 = gc.reshape({-1, out_f});
  const at::Tensor x2 = x_clipped.reshape({-1, in_f});

  // fp16/bf16: the weight and bias gradients in fp32 (see widened), the input gradient in the data dtype.
  const at::Tensor g2w = widened(g2), x2w = widened(x2);
  at::Tensor gw = host_empty(weight.sizes(), weight.options().dtype(g2w.scalar_type()));
  at::mm_out(gw, g2w.t(), x2w);
  // The bias' sum inside the tail's launch up to kTailBiasRowsMax rows (bpclip_fast/tail.h), ATen's above.
  const bool rows_in_tail = a.has_bias && tail_sums_bias(g2w.size(0));
  at::Tensor gb = !a.has_bias ? gw.new_empty({0}) : rows_in_tail ? gw.new_empty({out_f}) : g2w.sum(0);
  at::Tensor gxc;
  if (a.input_grad) gxc = at::mm(g2, weight).reshape(x_clipped.sizes());
  at::Tensor gx = layer_tail(gw, gb, rows_in_tail ? c10::optional<at::Tensor>(g2w) : c10::nullopt, gxc, x_clipped,
                             x_factor, x_norm, a);
  gw = gw.to(weight.scalar_type());
  gb = a.has_bias ? gb.to(weight.scalar_type()) : weight.new_empty({0});
  if (!a.input_grad) gx = x_clipped.new_empty({0});
  return {gx, gw, gb};
}

Triple conv2d_forward(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      at::Tensor& nonfinite, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                      int64_t groups, double input_bound, c10::string_view clip_fn, double gamma) {
  check_layer_inputs(x, weight, bias, "conv2d_forward");
  TORCH_CHECK(x.dim() == 4, "bpclip_fast.conv2d_forward: the input must be [B, C, H, W], got ", x.dim(), " dims");
  auto [xc, factor, norm] = clip_rows(x, nonfinite, input_bound, "l2", clip_fn, gamma);
  return {at::convolution(xc, weight, bias, stride, padding, dilation, false, {0, 0}, groups), factor, norm};
}

Triple conv2d_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& x_factor,
                       const at::Tensor& x_norm, const at::Tensor& weight, at::Tensor& nonfinite,
                       at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                       c10::string_view grad_norm, at::ArrayRef<double> bounds, c10::string_view clip_fn,
                       double gamma, std::array<bool, 2> output_mask, at::IntArrayRef noise_key, double noise_std,
                       double scale) {
  const BackwardArgs a = backward_args(bounds, clip_fn, gamma, output_mask, noise_key, noise_std, scale,
                                       "conv2d_backward");
  check_backward_inputs(grad_out, x, weight, "conv2d_backward");
  TORCH_CHECK(grad_out.dim() == 4, "bpclip_fast.conv2d_backward: grad_out must be [B, C, H, W]");
  auto [gc, gfactor, gnorm, x_clipped] = clipped_pair(grad_out, x, x_factor, nonfinite, a, grad_norm);
  at::Tensor gx_c, gw, gb;
  if (x_clipped.size(0) == 0) {
    const auto acc = weight.options().dtype(low_precision(weight) ? at::kFloat : weight.scalar_type());
    gw = at::zeros(weight.sizes(), acc);
    if (a.has_bias) gb = at::zeros({weight.size(0)}, acc);
    if (a.input_grad) gx_c = at::zeros_like(x_clipped);
  } else {
    const std::vector<int64_t> bias_sizes{weight.size(0)};
    const auto bias = a.has_bias ? c10::OptionalIntArrayRef(bias_sizes) : c10::nullopt;
    // fp16/bf16: the input gradient in the data dtype, the parameters' in fp32 (see widened).
    const bool wide = low_precision(weight);
    auto grads = at::convolution_backward(wide ? widened(gc) : gc, wide ? widened(x_clipped) : x_clipped,
                                          wide ? widened(weight) : weight, bias, stride, padding, dilation, false,
                                          {0, 0}, groups, {a.input_grad && !wide, true, a.has_bias});
    if (wide && a.input_grad) {
      gx_c = std::get<0>(at::convolution_backward(gc, x_clipped, weight, c10::nullopt, stride, padding, dilation,
                                                  false, {0, 0}, groups, {true, false, false}));
    } else {
      gx_c = std::get<0>(grads);
    }
    gw = std::get<1>(grads).contiguous();
    gb = std::get<2>(grads);
  }
  // ATen's convolution backward has no accumulate-into-output form, so the noise is added to the
  // fresh gradient buffers in place: the same memory traffic as writing them first.
  if (!a.has_bias) gb = gw.new_empty({0});
  at::Tensor gx = layer_tail(gw, gb, c10::nullopt, gx_c, x_clipped, x_factor, x_norm, a);
  gw = gw.to(weight.scalar_type());
  gb = a.has_bias ? gb.to(weight.scalar_type()) : weight.new_empty({0});
  if (!a.input_grad) gx = x_clipped.new_empty({0});
  return {gx, gw, gb};
}

}  // namespace

// One registration for every backend: these ops only compose dispatcher ops (ours, whose CPU and
// CUDA kernels are in cpu/ and cuda/, and ATen's), so nothing here is device-specific. Explicit,
// not CompositeImplicitAutograd: their gradient is the autograd Function's (bpclip_fast/autograd.py),
// which must not be differentiated through.
TORCH_LIBRARY_IMPL(bpclip_fast, CompositeExplicitAutograd, m) {
  m.impl("linear_forward", &linear_forward);
  m.impl("linear_backward", &linear_backward);
  m.impl("conv2d_forward", &conv2d_forward);
  m.impl("conv2d_backward", &conv2d_backward);
}

}  // namespace bpclip
