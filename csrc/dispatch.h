// Calls into our own dispatcher ops from the composite layer ops (layers.cpp, exact.cpp): through the
// dispatcher, so that each call reaches the kernel of the tensors' device (cpu/ or cuda/).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <tuple>

namespace bpclip {
namespace ops {

using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

inline Triple clip_rows(const at::Tensor& x, at::Tensor& nonfinite, double bound, c10::string_view norm,
                 c10::string_view clip_fn, double gamma) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("bpclip_fast::clip_rows", "")
                       .typed<Triple(const at::Tensor&, at::Tensor&, double, c10::string_view, c10::string_view, double)>();
  return op.call(x, nonfinite, bound, norm, clip_fn, gamma);
}

inline at::Tensor clip_rows_backward(const at::Tensor& grad, const at::Tensor& clipped, const at::Tensor& factor,
                              const at::Tensor& norm, double bound, c10::string_view clip_fn) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("bpclip_fast::clip_rows_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                            c10::string_view)>();
  return op.call(grad, clipped, factor, norm, bound, clip_fn);
}

inline at::Tensor scale_rows(const at::Tensor& x, const at::Tensor& factor) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("bpclip_fast::scale_rows", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(x, factor);
}

inline void philox_noise_(at::Tensor& buf, int64_t seed, int64_t offset, double stdv, bool accumulate,
                          double scale = 1.0) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("bpclip_fast::philox_noise_", "")
                       .typed<void(at::Tensor&, int64_t, int64_t, double, bool, double)>();
  op.call(buf, seed, offset, stdv, accumulate, scale);
}

inline void philox_noise2_(at::Tensor& w, at::Tensor& b, int64_t seed, int64_t offset, double stdv, bool accumulate_w,
                           bool accumulate_b, double scale = 1.0) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("bpclip_fast::philox_noise2_", "")
                       .typed<void(at::Tensor&, at::Tensor&, int64_t, int64_t, double, bool, bool, double)>();
  op.call(w, b, seed, offset, stdv, accumulate_w, accumulate_b, scale);
}

using OptTensor = c10::optional<at::Tensor>;

inline at::Tensor layer_tail_(at::Tensor& w, at::Tensor& b, const OptTensor& bias_rows, const OptTensor& grad,
                              const OptTensor& clipped, const OptTensor& factor, const OptTensor& norm,
                              double input_bound, c10::string_view clip_fn, int64_t seed, int64_t offset, double stdv,
                              double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("bpclip_fast::layer_tail_", "")
                       .typed<at::Tensor(at::Tensor&, at::Tensor&, const OptTensor&, const OptTensor&,
                                         const OptTensor&, const OptTensor&, const OptTensor&, double,
                                         c10::string_view, int64_t, int64_t, double, double)>();
  return op.call(w, b, bias_rows, grad, clipped, factor, norm, input_bound, clip_fn, seed, offset, stdv, scale);
}

// layer_tail_ where it has work (a draw, a scale, a bias sum or a VJP); otherwise no launch and an
// empty result, as the op returns without a VJP. The layers' one way to call it.
inline at::Tensor layer_tail_if_needed(at::Tensor& w, at::Tensor& b, const OptTensor& bias_rows, const OptTensor& grad,
                                       const OptTensor& clipped, const OptTensor& factor, const OptTensor& norm,
                                       double input_bound, c10::string_view clip_fn, int64_t seed, int64_t offset,
                                       double stdv, double scale) {
  const bool rows = bias_rows.has_value() && bias_rows->defined(), vjp = grad.has_value() && grad->defined();
  if (!rows && !vjp && stdv == 0.0 && scale == 1.0) return w.new_empty({0});  // anything else: the op checks it
  return layer_tail_(w, b, bias_rows, grad, clipped, factor, norm, input_bound, clip_fn, seed, offset, stdv, scale);
}

inline std::tuple<at::Tensor, at::Tensor> scale_rows2(const at::Tensor& x, const at::Tensor& x_factor,
                                                      const at::Tensor& y, const at::Tensor& y_factor, bool mask_y) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("bpclip_fast::scale_rows2", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, bool)>();
  return op.call(x, x_factor, y, y_factor, mask_y);
}

using Quad = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

inline Quad clip_rows_rescale(const at::Tensor& g, at::Tensor& nonfinite, double bound, c10::string_view norm,
                              c10::string_view clip_fn, double gamma, const at::Tensor& x, const at::Tensor& x_factor) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("bpclip_fast::clip_rows_rescale", "")
                       .typed<Quad(const at::Tensor&, at::Tensor&, double, c10::string_view, c10::string_view, double,
                                   const at::Tensor&, const at::Tensor&)>();
  return op.call(g, nonfinite, bound, norm, clip_fn, gamma, x, x_factor);
}

// sum_b RZ(factor[b] * values[b]) of the weight's and the bias's per-example values, with the noise
// (weight at offset, bias at offset + 1), times scale; one launch (bpclip_fast/examples.h).
inline std::tuple<at::Tensor, at::Tensor> examples_release(const c10::optional<at::Tensor>& weight,
                                                           const c10::optional<at::Tensor>& bias,
                                                           const at::Tensor& factor, at::IntArrayRef noise_key,
                                                           double noise_std, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("bpclip_fast::examples_release", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const c10::optional<at::Tensor>&,
                                                                 const c10::optional<at::Tensor>&, const at::Tensor&,
                                                                 at::IntArrayRef, double, double)>();
  return op.call(weight, bias, factor, noise_key, noise_std, scale);
}

}  // namespace ops
}  // namespace bpclip
