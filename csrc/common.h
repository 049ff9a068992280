// Host-side helpers shared by the CPU and CUDA launchers: argument parsing, checks, and a tensor's
// RowGeometry (the struct itself is in bpclip_fast/rows.h, where the emulator can include it).
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <string_view>
#include <utility>

#include "bpclip_fast/clip.h"
#include "bpclip_fast/rows.h"

namespace bpclip {

inline int parse_clip_fn(std::string_view s) {
  if (s == "clip") return kClip;
  if (s == "global") return kGlobal;
  if (s == "normalize") return kNormalize;
  TORCH_CHECK(false, "bpclip_fast: clip_fn must be 'clip', 'global' or 'normalize', got '", std::string(s), "'");
}

inline int parse_norm(std::string_view s) {
  if (s == "l2") return kL2;
  if (s == "l15") return kL15;
  TORCH_CHECK(false, "bpclip_fast: norm must be 'l2' or 'l15', got '", std::string(s), "'");
}

// A noise std the kernels can draw with: 0 (no draw), or in [2^-80, 1e30). The draws are float32
// normals z times the std as a float32 (bpclip_fast/philox.h), so std·z must be a float32 normal
// number for every z != 0 the construction gives, or a CPU running with flush-to-zero
// (torch.set_flush_denormal(True)) draws exactly 0 on some coordinates and the release carries them
// unnoised (review 39 F2; review 38 F2: below float32's smallest normal every draw is subnormal). The
// smallest nonzero |z| is r·|sin| at the largest u1 below 1 (r = 3.45e-4) and the angle step
// (|sin| = 3.7e-7), 1.29e-10 = 2^-32.85 (tests/test_noise_floor.py enumerates both), so std·|z| >=
// 2^-80 · 2^-32.85 = 2^-112.85, 2^13 above FLT_MIN = 2^-126: margin for the GPU's FMA contraction.
// A float64 buffer's draws are float64 normals times the std in double: their smallest nonzero |z| is
// 2^-26 sin(2 pi 2^-53) > 2^-77, so std·|z| > 2^-157, far above DBL_MIN = 2^-1022.
constexpr double kMinNoiseStd = 0x1p-80;  // 8.27e-25
inline bool noise_std_ok(double stdv) { return stdv == 0.0 || (stdv >= kMinNoiseStd && stdv < 1e30); }
#define BPCLIP_NOISE_STD_RULE "0 or between 2^-80 = 8.27e-25 (every float32 draw times it a normal number) and 1e30"

inline void check_bound(double bound, const char* what) {
  TORCH_CHECK(bound > 0.0 && bound < 1e300, "bpclip_fast: ", what, " must be a positive finite number, got ", bound);
}

inline void check_float_tensor(const at::Tensor& t, const char* what) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble,
              "bpclip_fast: ", what, " must be float32, float16, bfloat16 or float64, got ", st);
}

inline void check_counter(const at::Tensor& counter, const at::Tensor& like) {
  TORCH_CHECK(counter.scalar_type() == at::kLong && counter.numel() == 1,
              "bpclip_fast: the non-finite counter must be a one-element int64 tensor");
  TORCH_CHECK(counter.device() == like.device(), "bpclip_fast: the non-finite counter is on ", counter.device(),
              " but the data is on ", like.device());
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* an, const char* bn) {
  TORCH_CHECK(a.device() == b.device(), "bpclip_fast: ", an, " is on ", a.device(), " but ", bn, " is on ",
              b.device());
}

// The per-example factors and norms are stored as fp32, or fp64 for fp64 data (the reductions and
// the factor computation themselves are double for every dtype: bpclip_fast/clip.h).
inline at::ScalarType acc_type_of(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline RowGeometry row_geometry(const at::Tensor& x, int norm, int64_t chunk) {
  const int64_t B = x.size(0);
  const int64_t N = B == 0 ? 0 : (x.dim() == 1 ? 1 : x.numel() / B);
  if (norm == kL15) {
    TORCH_CHECK(x.dim() == 4, "bpclip_fast: the l15 norm needs a [B, C, H, W] tensor, got ", x.dim(), " dims");
    return make_row_geometry(B, N, x.size(1), x.size(2) * x.size(3), chunk);
  }
  return make_row_geometry(B, N, 1, N, chunk);
}

// Validation of clip_rows' arguments, shared by the backends; returns the parsed (norm, clip_fn).
inline std::pair<int, int> check_clip_rows_args(const at::Tensor& x, const at::Tensor& nonfinite, double bound,
                                                c10::string_view norm, c10::string_view clip_fn, double gamma) {
  check_float_tensor(x, "x");
  TORCH_CHECK(x.dim() >= 1, "bpclip_fast.clip_rows: x needs a batch dimension");
  check_counter(nonfinite, x);
  check_bound(bound, "bound");
  const int fn = parse_clip_fn(clip_fn);
  TORCH_CHECK(fn != kNormalize || gamma > 0, "bpclip_fast: clip_fn='normalize' needs gamma > 0, got ", gamma);
  return {parse_norm(norm), fn};
}

inline int check_clip_backward_args(const at::Tensor& grad, const at::Tensor& clipped, const at::Tensor& factor,
                                    const at::Tensor& norms, double bound, c10::string_view clip_fn) {
  check_float_tensor(grad, "grad");
  TORCH_CHECK(grad.sizes() == clipped.sizes(), "bpclip_fast.clip_rows_backward: grad has shape ", grad.sizes(),
              " but clipped has shape ", clipped.sizes());
  TORCH_CHECK(grad.scalar_type() == clipped.scalar_type(), "bpclip_fast.clip_rows_backward: grad is ",
              grad.scalar_type(), " but clipped is ", clipped.scalar_type());
  check_same_device(grad, clipped, "grad", "clipped");
  check_same_device(grad, factor, "grad", "factor");
  check_same_device(grad, norms, "grad", "norm");
  check_bound(bound, "bound");
  const int64_t b = grad.dim() == 0 ? 0 : grad.size(0);
  TORCH_CHECK(factor.numel() == b && norms.numel() == b, "bpclip_fast.clip_rows_backward: factor and norm need ", b,
              " entries");
  TORCH_CHECK(factor.scalar_type() == acc_type_of(grad) && norms.scalar_type() == acc_type_of(grad),
              "bpclip_fast.clip_rows_backward: factor and norm must be ", acc_type_of(grad));
  return parse_clip_fn(clip_fn);
}

inline void check_scale_rows_args(const at::Tensor& x, const at::Tensor& factor) {
  check_float_tensor(x, "x");
  TORCH_CHECK(x.dim() >= 1, "bpclip_fast.scale_rows: x needs a batch dimension");
  check_same_device(x, factor, "x", "factor");
  TORCH_CHECK(factor.dim() == 1 && factor.numel() == x.size(0), "bpclip_fast.scale_rows: factor needs ", x.size(0),
              " entries (one per example), got shape ", factor.sizes());
  TORCH_CHECK(factor.scalar_type() == acc_type_of(x), "bpclip_fast.scale_rows: factor must be ", acc_type_of(x),
              " for ", x.scalar_type(), " data, got ", factor.scalar_type());
}

// The geometry of norm_affine_example_grads: B examples, each with D affine parameters (LayerNorm:
// the normalized numel; GroupNorm: the channels) summed over R positions (LayerNorm: the T rows of
// an example, strided by D; GroupNorm: the S contiguous elements of a channel), with G groups
// (GroupNorm only; one statistic per (example, group)).
struct NormAffineShape {
  int64_t B, R, D, G;
  bool layer_norm;
};

// What LayerNorm normalizes over, from its statistics: x.numel() / mean.numel() when there are
// any; with none (an empty batch) the trailing size-1 dims of mean in native_layer_norm's layout
// ([*leading, 1, ...]) name the normalized dims (a size-1 leading dim taken along changes nothing).
inline int64_t layer_norm_row_size(const at::Tensor& x, const at::Tensor& mean) {
  const int64_t M = mean.numel();
  if (M > 0) {
    TORCH_CHECK(x.numel() % M == 0, "bpclip_fast.norm_affine_example_grads: x has ", x.numel(),
                " elements, not a multiple of mean's ", M, " rows");
    return x.numel() / M;
  }
  TORCH_CHECK(x.numel() == 0, "bpclip_fast.norm_affine_example_grads: mean is empty but x has ", x.numel(),
              " elements");
  TORCH_CHECK(mean.dim() == x.dim(), "bpclip_fast.norm_affine_example_grads: with an empty mean, its shape must be",
              " native_layer_norm's (", x.dim(), " dims, size 1 over the normalized ones) to tell the row size; got ",
              mean.sizes());
  int64_t axis = mean.dim();
  while (axis > 0 && mean.size(axis - 1) == 1) --axis;
  int64_t D = 1;
  for (int64_t i = axis; i < x.dim(); ++i) D *= x.size(i);
  return D;
}

inline NormAffineShape check_norm_affine_args(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mean,
                                              const at::Tensor& rstd, int64_t batch, int64_t groups,
                                              bool layer_norm) {
  constexpr const char* op = "bpclip_fast.norm_affine_example_grads: ";
  check_float_tensor(x, "x");
  TORCH_CHECK(grad_out.scalar_type() == x.scalar_type(), op, "grad_out is ", grad_out.scalar_type(), " but x is ",
              x.scalar_type());
  TORCH_CHECK(grad_out.sizes() == x.sizes(), op, "grad_out has shape ", grad_out.sizes(), " but x has shape ",
              x.sizes());
  check_same_device(x, grad_out, "x", "grad_out");
  check_same_device(x, mean, "x", "mean");
  check_same_device(x, rstd, "x", "rstd");
  // ATen's statistics are fp32 for half data on CUDA, the data dtype on CPU (and fp32 again with
  // mixed-dtype affine parameters): both are accepted, read as the accumulation dtype.
  const auto st = mean.scalar_type();
  if (x.scalar_type() == acc_type_of(x)) {
    TORCH_CHECK(st == x.scalar_type(), op, "mean must be ", x.scalar_type(), " for ", x.scalar_type(), " data, got ",
                st);
  } else {
    TORCH_CHECK(st == x.scalar_type() || st == acc_type_of(x), op, "mean must be ", x.scalar_type(), " or ",
                acc_type_of(x), " for ", x.scalar_type(), " data, got ", st);
  }
  TORCH_CHECK(rstd.scalar_type() == st, op, "rstd is ", rstd.scalar_type(), " but mean is ", st);
  TORCH_CHECK(rstd.numel() == mean.numel(), op, "rstd has ", rstd.numel(), " entries but mean has ", mean.numel());
  TORCH_CHECK(batch >= 0, op, "batch must be >= 0, got ", batch);
  NormAffineShape s{};
  s.B = batch;
  s.layer_norm = layer_norm;
  if (layer_norm) {
    s.G = 1;
    s.D = layer_norm_row_size(x, mean);
    const int64_t M = mean.numel();
    TORCH_CHECK(batch == 0 ? M == 0 : M % batch == 0, op, "mean has ", M, " rows, not a multiple of batch = ", batch);
    s.R = batch == 0 ? 0 : M / batch;
    return s;
  }
  TORCH_CHECK(x.dim() >= 2, op, "group norm needs x of shape [B, C, *], got ", x.sizes());
  TORCH_CHECK(x.size(0) == batch, op, "x has ", x.size(0), " examples but batch = ", batch);
  TORCH_CHECK(groups >= 1 && x.size(1) % groups == 0, op, "groups must be >= 1 and divide C = ", x.size(1), ", got ",
              groups);
  TORCH_CHECK(mean.numel() == batch * groups, op, "mean needs batch * groups = ", batch * groups,
              " entries, got ", mean.numel());
  s.G = groups;
  s.D = x.size(1);
  s.R = batch * s.D == 0 ? 0 : x.numel() / (batch * s.D);
  return s;
}

// scale: what the stored values are multiplied by after the noise (the engine's mean-loss scale
// d/B, post-processing of the noised sum), as a separate mul_(scale) would.
inline void check_noise_scale(double scale, const char* op) {
  TORCH_CHECK(scale > 0.0 && scale < 1e30, "bpclip_fast.", op, ": scale must be finite and > 0, got ", scale);
}

inline void check_noise_args(const at::Tensor& buf, double stdv, double scale) {
  check_float_tensor(buf, "buf");
  TORCH_CHECK(noise_std_ok(stdv), "bpclip_fast.philox_noise_: std must be " BPCLIP_NOISE_STD_RULE ", got ", stdv);
  check_noise_scale(scale, "philox_noise_");
}

// One launch covers both tensors on a GPU, so they share a device and a dtype (a layer's weight and
// bias gradients always do: both in the accumulation dtype, or both in the parameters').
inline void check_noise2_args(const at::Tensor& w, const at::Tensor& b, double stdv, double scale) {
  check_float_tensor(w, "w");
  check_float_tensor(b, "b");
  check_same_device(w, b, "w", "b");
  // One launch, both buffers __restrict__, a non-contiguous one copied before it and back after:
  // buffers sharing memory would not get the two calls' values (an interleaved pair of views of one
  // storage is "too hard" for ATen to decide, and refused with the rest).
  const at::MemOverlapStatus overlap = at::get_overlap_status(w, b);
  TORCH_CHECK(w.numel() == 0 || b.numel() == 0 || overlap == at::MemOverlapStatus::No ||
                  (overlap == at::MemOverlapStatus::TooHard && !w.storage().is_alias_of(b.storage())),
              "bpclip_fast.philox_noise2_: w and b overlap in memory; pass separate buffers, or call "
              "philox_noise_ on each");
  TORCH_CHECK(w.scalar_type() == b.scalar_type(), "bpclip_fast.philox_noise2_: w is ", w.scalar_type(),
              " but b is ", b.scalar_type(), "; both tensors need one dtype (or call philox_noise_ on each)");
  TORCH_CHECK(noise_std_ok(stdv), "bpclip_fast.philox_noise2_: std must be " BPCLIP_NOISE_STD_RULE ", got ", stdv);
  check_noise_scale(scale, "philox_noise2_");
}

// The bytes a tensor's elements span, [first, last + 1): what it can read or write.
inline std::pair<uintptr_t, uintptr_t> byte_extent(const at::Tensor& t) {
  int64_t lo = 0, hi = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t span = (t.size(d) - 1) * t.stride(d);
    (span < 0 ? lo : hi) += span;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const auto size = static_cast<int64_t>(t.element_size());
  return {base + static_cast<uintptr_t>(lo * size), base + static_cast<uintptr_t>((hi + 1) * size)};
}

// Whether two tensors may share memory: within one storage, ATen's overlap test (an interleaved pair
// of views, "too hard" for it to decide, counts as sharing); across storages, whether the bytes they
// span intersect (two storages can wrap the same memory: torch.from_numpy of one array twice,
// review 39 L2).
inline bool may_share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.device() != b.device()) return false;
  if (a.storage().is_alias_of(b.storage())) return at::get_overlap_status(a, b) != at::MemOverlapStatus::No;
  const auto ea = byte_extent(a), eb = byte_extent(b);
  return ea.first < eb.second && eb.first < ea.second;
}

// layer_tail_ (csrc/include/bpclip_fast/tail.h), every check before anything is written (a refused
// call leaves w and b as they were on every device): w and b are a layer's gradients in the
// accumulation dtype (fp32, fp64), contiguous (the stream is indexed by position), disjoint; bias_rows,
// where given, the [rows, b.numel()] matrix whose column sums b receives; grad, where given, the input
// gradient whose clipping VJP is returned, with the forward's clipped input, factor and norm (the
// factor in w's dtype: the clip kernels' fac_t is the accumulation dtype), and input_bound the bound
// the forward clipped against. Nothing read may share memory with w or b. Returns the parsed clip_fn.
inline int check_tail_args(const at::Tensor& w, const at::Tensor& b, const c10::optional<at::Tensor>& bias_rows,
                           const c10::optional<at::Tensor>& grad, const c10::optional<at::Tensor>& clipped,
                           const c10::optional<at::Tensor>& factor, const c10::optional<at::Tensor>& norm,
                           double input_bound, c10::string_view clip_fn, double stdv, double scale) {
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kDouble, "bpclip_fast.layer_tail_: w is ",
              w.scalar_type(), "; the layer's gradients are noised in their accumulation dtype (float32 or float64)");
  TORCH_CHECK(b.scalar_type() == w.scalar_type(), "bpclip_fast.layer_tail_: w is ", w.scalar_type(), " but b is ",
              b.scalar_type(), "; a layer's two gradients share the accumulation dtype");
  check_same_device(w, b, "w", "b");
  TORCH_CHECK(w.is_contiguous() && b.is_contiguous(), "bpclip_fast.layer_tail_: w and b must be contiguous");
  TORCH_CHECK(!may_share_memory(w, b), "bpclip_fast.layer_tail_: w and b overlap in memory; pass separate buffers");
  TORCH_CHECK(noise_std_ok(stdv), "bpclip_fast.layer_tail_: std must be " BPCLIP_NOISE_STD_RULE ", got ", stdv);
  check_noise_scale(scale, "layer_tail_");
  const int fn = parse_clip_fn(clip_fn);
  auto disjoint = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(!may_share_memory(t, w) && !may_share_memory(t, b), "bpclip_fast.layer_tail_: ", what,
                " shares memory with w or b, which the op writes; pass a separate tensor");
  };
  if (bias_rows.has_value() && bias_rows->defined()) {
    check_same_device(*bias_rows, w, "bias_rows", "w");
    TORCH_CHECK(bias_rows->dim() == 2 && bias_rows->size(1) == b.numel() && b.numel() > 0 &&
                    bias_rows->is_contiguous() && bias_rows->scalar_type() == w.scalar_type(),
                "bpclip_fast.layer_tail_: bias_rows must be a contiguous [rows, ", b.numel(), "] tensor of w's dtype",
                " (", w.scalar_type(), ") and b non-empty; got ", bias_rows->sizes(), " ", bias_rows->scalar_type());
    disjoint(*bias_rows, "bias_rows");
  }
  if (grad.has_value() && grad->defined()) {
    TORCH_CHECK(clipped.has_value() && clipped->defined() && factor.has_value() && factor->defined() &&
                    norm.has_value() && norm->defined(),
                "bpclip_fast.layer_tail_: grad needs the forward's clipped input, factor and norm");
    check_same_device(*grad, w, "grad", "w");
    check_clip_backward_args(*grad, *clipped, *factor, *norm, input_bound, clip_fn);
    TORCH_CHECK(factor->scalar_type() == w.scalar_type(), "bpclip_fast.layer_tail_: the factor is ",
                factor->scalar_type(), " but w is ", w.scalar_type(), "; both are the data's accumulation dtype");
    disjoint(*grad, "grad");
    disjoint(*clipped, "clipped");
    disjoint(*factor, "factor");
    disjoint(*norm, "norm");
  }
  return fn;
}

// clip_rows_rescale: g clipped as clip_rows does, x rescaled by x_factor as scale_rows does; one batch.
inline void check_clip_rows_rescale_args(const at::Tensor& g, const at::Tensor& x, const at::Tensor& x_factor) {
  check_scale_rows_args(x, x_factor);
  check_same_device(g, x, "g", "x");
  TORCH_CHECK(g.dim() >= 1 && g.size(0) == x.size(0), "bpclip_fast.clip_rows_rescale: g has ",
              g.dim() >= 1 ? g.size(0) : 0, " examples but x has ", x.size(0));
  TORCH_CHECK(g.scalar_type() == x.scalar_type(), "bpclip_fast.clip_rows_rescale: g is ", g.scalar_type(),
              " but x is ", x.scalar_type(), "; both need one dtype");
}

// scale_rows2: both tensors scaled per example of one batch, each by a factor of its own dtype's.
inline void check_scale_rows2_args(const at::Tensor& x, const at::Tensor& fx, const at::Tensor& y,
                                   const at::Tensor& fy) {
  check_scale_rows_args(x, fx);
  check_scale_rows_args(y, fy);
  check_same_device(x, y, "x", "y");
  TORCH_CHECK(x.size(0) == y.size(0), "bpclip_fast.scale_rows2: x has ", x.size(0), " examples but y has ", y.size(0));
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "bpclip_fast.scale_rows2: x is ", x.scalar_type(), " but y is ",
              y.scalar_type(), "; both need one dtype");
}

}  // namespace bpclip
