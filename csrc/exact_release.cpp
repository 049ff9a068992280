// The release of exact per-example clipping (modes flat and per_layer): a Linear's or Conv2d's
// clipped weight and bias gradients, sum_i c_i G_i with the noise, from the factors the norms ops'
// bounds gave (csrc/exact.cpp, whose file comment proves what the release may hold), either by one
// GEMM / convolution weight-gradient over the scaled upstream gradient or from the norms ops' kept
// per-example gradients. Written once over ATen and our dispatcher ops, for CPU and CUDA alike.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <tuple>
#include <vector>

#include "common.h"
#include "dispatch.h"
#include "host_cache.h"
#include "bpclip_fast/tail.h"

namespace bpclip {
namespace {

using Pair = std::tuple<at::Tensor, at::Tensor>;

using ops::philox_noise2_;
using ops::philox_noise_;
using ops::scale_rows2;

// The gradient the release holds: each example's upstream gradient scaled by its factor (rounded
// toward zero to the accumulation dtype, zeros where the factor is 0), its input row zeroed where
// the factor is 0 (so a non-finite example cannot reach the sum through 0 * Inf). fp16/bf16 data
// is upcast first (exactly): c g rounded to fp16 would land in its subnormals (csrc/exact.cpp's file comment).
std::tuple<at::Tensor, at::Tensor> scaled_inputs(const at::Tensor& grad_out, const at::Tensor& x,
                                                 const at::Tensor& factor) {
  TORCH_CHECK(factor.dim() == 1 && factor.size(0) == x.size(0), "bpclip_fast: factor needs one entry per example");
  const at::ScalarType acc = acc_type_of(x);
  // Both in one launch (scale_rows2); the mask scales x's rows by 1 where c > 0 and by 0 where c = 0
  // (factors are never negative or NaN), and RZ(1 * x) = x.
  return scale_rows2(grad_out.to(acc), factor, x.to(acc), factor, true);
}

// The weight's noise at the key's offset, the bias' at offset + 1 (added); both in one launch; then
// the mean-loss scale in the same launch (without noise, one mul_ each: a pass with no draw).
void add_noise(at::Tensor& gw, at::Tensor& gb, bool weight, bool bias, at::IntArrayRef noise_key, double noise_std,
               bool accumulate_weight, double scale) {
  if (noise_std <= 0.0) {
    if (scale != 1.0) {
      if (weight) gw.mul_(scale);
      if (bias) gb.mul_(scale);
    }
    return;
  }
  if (weight && bias) {
    philox_noise2_(gw, gb, noise_key[0], noise_key[1], noise_std, accumulate_weight, true, scale);
  } else if (weight) {
    philox_noise_(gw, noise_key[0], noise_key[1], noise_std, accumulate_weight, scale);
  } else if (bias) {
    philox_noise_(gb, noise_key[0], noise_key[1] + 1, noise_std, true, scale);
  }
}

// The release from kept per-example gradients G^_i = [G^_W, G^_b] (the accumulation dtype A: fp32,
// fp64 for fp64 data; so fp16/bf16 data's are fp32 too): examples_release, one launch, sum_i
// RZ_A(c_i G^_i) in examples.h's fixed order, rows with c_i = 0 adding exact zeros whatever they
// hold (a non-finite example), the noise drawn inside as philox_noise_ (weight at offset, bias at
// offset + 1), then the scale, no rounding (its output dtype is A; the caller rounds to the parameter
// dtype once, after the noise and the scale).
// Why the bound covers it: the norms op normed exactly these values. G^_W is the GEMM's [G_W] per
// row that exact_bound_ squared and summed in double (wa = wb = the kept tensor), so sqrt(sq grow)
// >= ||G^_W|| (csrc/exact.cpp's file comment, instantiation: the double squares and sum); G^_b is the acc-dtype sum
// over the positions that the kernel read as the bias itself (kBoundBiasSummed: one position,
// squared exactly in double), so the same sq covers ||[G^_W, G^_b]||, and bound >= sqrt(sq grow).
// Entrywise |RZ_A(c y)| <= c |y| (rounding toward zero never grows a magnitude, and a result below
// the smallest subnormal becomes 0), so ||RZ_A(c_i G^_i)|| <= c_i ||G^_i|| <= c_i bound <= C: the
// release needs none of the terms r, q or the GEMM's error that the recomputing path spends. An
// overflow to +-Inf (or NaN) in G^_i is in sq too: bound +Inf, factor 0, the example adds exact zeros.
// The factor has the dtype A (exact.factors: fp64 for fp64 data), as examples_release requires.
Pair kept_release(const at::Tensor& kept_w, const at::Tensor& kept_b, const at::Tensor& factor,
                  const at::Tensor& weight, std::array<bool, 2> params, at::IntArrayRef noise_key, double noise_std,
                  double scale) {
  TORCH_CHECK(params[0], "bpclip_fast: kept per-example gradients need the weight to train");
  TORCH_CHECK(!params[1] || kept_b.numel() > 0, "bpclip_fast: the bias trains but its kept per-example gradients "
              "are missing (the norms op ran with the bias frozen)");
  const c10::optional<at::Tensor> b = params[1] ? c10::optional<at::Tensor>(kept_b) : c10::nullopt;
  auto [gw, gb] = ops::examples_release(kept_w, b, factor, noise_key, noise_std, scale);
  return {gw.reshape(weight.sizes()), gb};
}

bool has_kept(const c10::optional<at::Tensor>& kept) { return kept.has_value() && kept->defined() && kept->numel() > 0; }

void check_grads_args(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                      at::IntArrayRef noise_key, double noise_std, double scale, const char* op) {
  check_same_device(grad_out, x, "grad_out", "the input");
  check_same_device(grad_out, weight, "grad_out", "the weight");
  TORCH_CHECK(grad_out.scalar_type() == x.scalar_type() && x.scalar_type() == weight.scalar_type(), "bpclip_fast.",
              op, ": grad_out, the input and the weight must share a dtype");
  TORCH_CHECK(noise_key.size() == 2, "bpclip_fast.", op, ": noise_key must be [seed, offset]");
  TORCH_CHECK(noise_std_ok(noise_std), "bpclip_fast.", op, ": noise_std must be " BPCLIP_NOISE_STD_RULE ", got ",
              noise_std);
  check_noise_scale(scale, op);
}

Pair linear_clipped_grads(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& factor,
                          const at::Tensor& weight, std::array<bool, 2> params, at::IntArrayRef noise_key,
                          double noise_std, const c10::optional<at::Tensor>& kept_w,
                          const c10::optional<at::Tensor>& kept_b, double scale) {
  if (has_kept(kept_w)) {
    check_noise_scale(scale, "linear_clipped_grads");
    return kept_release(*kept_w, *kept_b, factor, weight, params, noise_key, noise_std, scale);
  }
  check_grads_args(grad_out, x, weight, noise_key, noise_std, scale, "linear_clipped_grads");
  auto [gs, xs] = scaled_inputs(grad_out, x, factor);
  const at::Tensor g2 = gs.reshape({-1, weight.size(0)}), x2 = xs.reshape({-1, weight.size(1)});
  const at::TensorOptions out = weight.options().dtype(acc_type_of(weight));
  at::Tensor gw = at::empty({0}, out), gb = gw;
  // The draw written first and the GEMM accumulated onto it (beta = 1), at scale 1: the gradient's
  // update happens inside the GEMM's blocks while they are in cache, where adding the draw after the
  // GEMM is one more pass over it (4-8% of the CIFAR-10 net's 29.4M-weight Linear at b32).
  const bool draw_first = params[0] && noise_std > 0.0 && scale == 1.0;
  // Otherwise (a mean-loss scale: almost every Poisson step) the draw, the scale and the bias' sum
  // over the rows follow the GEMM in one launch (layer_tail_, bpclip_fast/tail.h), up to
  // kTailBiasRowsMax rows; the bias summed by ATen first above that.
  const bool rows_in_tail = params[1] && !draw_first && tail_sums_bias(g2.size(0));
  if (params[1]) gb = rows_in_tail ? at::empty({weight.size(0)}, out) : g2.sum(0);
  if (params[0]) {
    gw = host_empty(weight.sizes(), out);
    if (draw_first) {
      add_noise(gw, gb, true, params[1], noise_key, noise_std, false, 1.0);
      gw.addmm_(g2.t(), x2);
      return {gw, gb};
    }
    at::mm_out(gw, g2.t(), x2);
  }
  ops::layer_tail_if_needed(gw, gb, rows_in_tail ? c10::optional<at::Tensor>(g2) : c10::nullopt, c10::nullopt,
                            c10::nullopt, c10::nullopt, c10::nullopt, 1.0, "clip", noise_key[0], noise_key[1],
                            noise_std, scale);
  return {gw, gb};
}

Pair conv2d_clipped_grads(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& factor,
                          const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding,
                          at::IntArrayRef dilation, int64_t groups, std::array<bool, 2> params,
                          at::IntArrayRef noise_key, double noise_std, const c10::optional<at::Tensor>& kept_w,
                          const c10::optional<at::Tensor>& kept_b, double scale) {
  if (has_kept(kept_w)) {
    check_noise_scale(scale, "conv2d_clipped_grads");
    return kept_release(*kept_w, *kept_b, factor, weight, params, noise_key, noise_std, scale);
  }
  check_grads_args(grad_out, x, weight, noise_key, noise_std, scale, "conv2d_clipped_grads");
  const at::TensorOptions out = weight.options().dtype(acc_type_of(weight));
  at::Tensor gw = at::empty({0}, out), gb = gw;
  if (x.size(0) == 0) {
    if (params[0]) gw = at::zeros(weight.sizes(), out);
    if (params[1]) gb = at::zeros({weight.size(0)}, out);
  } else if (params[0] || params[1]) {
    auto [gs, xs] = scaled_inputs(grad_out, x, factor);
    const std::vector<int64_t> bias_sizes{weight.size(0)};
    auto grads = at::convolution_backward(gs, xs, weight.to(gs.scalar_type()),
                                          params[1] ? c10::OptionalIntArrayRef(bias_sizes) : c10::nullopt, stride,
                                          padding, dilation, false, {0, 0}, groups, {false, params[0], params[1]});
    if (params[0]) gw = std::get<1>(grads).contiguous();
    if (params[1]) gb = std::get<2>(grads);
  }
  // ATen's convolution backward has no accumulate-into-output form: the noise is added in place.
  add_noise(gw, gb, params[0], params[1], noise_key, noise_std, true, scale);
  return {gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CompositeExplicitAutograd, m) {
  m.impl("linear_clipped_grads", &linear_clipped_grads);
  m.impl("conv2d_clipped_grads", &conv2d_clipped_grads);
}

}  // namespace bpclip
