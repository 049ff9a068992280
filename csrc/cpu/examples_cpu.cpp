// CPU kernels of examples_bound and examples_release: the bound and the clipped, noised release of
// instantiated per-example gradients (bpclip_fast/exact.py, DenseExamples). The arithmetic and the
// summation orders are bpclip_fast/examples.h's, the same as the CUDA kernels'
// (csrc/cuda/examples_kernels.cuh), so both give the same bits (the noise up to the GPU's FMA
// contraction, as philox_noise_).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>

#include "../bound_args.h"
#include "../common.h"
#include "../examples_args.h"
#include "../host_cache.h"
#include "bpclip_fast/examples.h"
#include "bpclip_fast/philox.h"
#include "noise_cpu.h"
#include "scale_f32.h"
#include "vector_clones.h"

namespace bpclip {
namespace {

inline double square_f64(float v) { return static_cast<double>(v) * static_cast<double>(v); }
inline double square_f64(double v) { return v * v; }
inline double square_f64(c10::Half v) { return square_f64(static_cast<float>(v)); }
inline double square_f64(c10::BFloat16 v) { return square_f64(static_cast<float>(v)); }

template <typename scalar_t>
void bound_rows(const scalar_t* w, const scalar_t* bias, const ExamplesShape& s, double* out, int64_t* bad) {
  const int64_t n = s.Nw + s.Nb;
  const double r = examples_bound_factor(n);
  const double tiny = examples_bound_tiny(n, std::is_same_v<scalar_t, double>);
  int64_t count = 0;
  for (int64_t b = 0; b < s.B; ++b) {
    double part[kBoundParts] = {};
    // Entry j goes to part j mod kBoundParts (the CUDA thread that reads it), in increasing j.
    for (int64_t j0 = 0; j0 < n; j0 += kBoundParts) {
      const int64_t m = std::min<int64_t>(kBoundParts, n - j0);
      for (int64_t t = 0; t < m; ++t) {
        const int64_t j = j0 + t;
        part[t] += j < s.Nw ? square_f64(w[b * s.Nw + j]) : square_f64(bias[b * s.Nb + (j - s.Nw)]);
      }
    }
    for (int half = kBoundParts / 2; half > 0; half >>= 1)
      for (int t = 0; t < half; ++t) part[t] += part[t + half];
    out[b] = examples_bound_of(part[0], tiny, r);
    count += finite_bound(out[b]) ? 0 : 1;
  }
  *bad = count;
}

at::Tensor examples_bound_cpu(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                              std::optional<at::Tensor> nonfinite) {
  const ExamplesArgs a = check_examples_args(weight, bias, "examples_bound");
  if (nonfinite) check_counter(*nonfinite, a.like);
  at::Tensor out = at::empty({a.s.B}, a.like.options().dtype(at::kDouble));
  if (a.s.B == 0) return out;
  int64_t bad = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.like.scalar_type(), "examples_bound_cpu", [&] {
    bound_rows<scalar_t>(a.w.defined() ? a.w.const_data_ptr<scalar_t>() : nullptr,
                         a.b.defined() ? a.b.const_data_ptr<scalar_t>() : nullptr, a.s,
                         out.mutable_data_ptr<double>(), &bad);
  });
  if (bad && nonfinite) nonfinite->add_(bad);  // a launch only when some example is not finite
  return out;
}

// examples_bound_cpu's bound, then exact_factors_cpu's factor of that one layer's bound (bound.h,
// example_factor), counted as exact_factors counts: the CUDA kernel does both in one launch.
std::tuple<at::Tensor, at::Tensor> examples_factors_cpu(const std::optional<at::Tensor>& weight,
                                                        const std::optional<at::Tensor>& bias, at::Tensor& nonfinite,
                                                        double max_norm, c10::string_view clip_fn, double gamma,
                                                        bool fp64) {
  const ExamplesArgs a = check_examples_args(weight, bias, "examples_factors");
  check_counter(nonfinite, a.like);
  const FactorsArgs f = factor_params(a.s.B, 1, max_norm, clip_fn, gamma);
  at::Tensor bound = at::empty({a.s.B}, a.like.options().dtype(at::kDouble));
  at::Tensor factor = at::empty({a.s.B}, a.like.options().dtype(fp64 ? at::kDouble : at::kFloat));
  if (a.s.B == 0) return {factor, bound};
  int64_t unused = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.like.scalar_type(), "examples_factors_cpu", [&] {
    bound_rows<scalar_t>(a.w.defined() ? a.w.const_data_ptr<scalar_t>() : nullptr,
                         a.b.defined() ? a.b.const_data_ptr<scalar_t>() : nullptr, a.s,
                         bound.mutable_data_ptr<double>(), &unused);
  });
  const double* bp = bound.const_data_ptr<double>();
  int64_t bad = 0;
  for (int64_t i = 0; i < a.s.B; ++i) {
    bool odd = false;
    const double c = example_factor(bp[i], fp64, f.bound_eff, f.fn, gamma, &odd);
    if (fp64) {
      factor.mutable_data_ptr<double>()[i] = c;
    } else {
      factor.mutable_data_ptr<float>()[i] = static_cast<float>(c);  // already an fp32 value
    }
    bad += odd ? 1 : 0;
  }
  // Written in place (not add_): the op then launches no ATen kernel of its own.
  if (bad) nonfinite.mutable_data_ptr<int64_t>()[0] += bad;
  return {factor, bound};
}

// RZ_T(f x) widened to acc_t (bpclip_fast/clip.h, as scale_rows stores it); f != 0.
inline float scaled(float f, float x) { return scale_rz_f32(f, x); }
inline double scaled(double f, double x) { return scale_rz_f64(f, x); }
inline float scaled(float f, c10::Half x) {
  return static_cast<float>(c10::Half(scale_rz_f16_bits(f, static_cast<float>(x)), c10::Half::from_bits()));
}
inline float scaled(float f, c10::BFloat16 x) {
  return static_cast<float>(
      c10::BFloat16(scale_rz_bf16_bits(f, static_cast<float>(x)), c10::BFloat16::from_bits()));
}

constexpr int64_t kReleaseSpan = 512;  // elements per CPU task

// p[t] += v[t]: one float addition per element, in the scalar loop's order (no reassociation).
BPCLIP_VECTOR_CLONES void add_row(float* p, const float* v, int64_t m) {
  for (int64_t t = 0; t < m; ++t) p[t] += v[t];
}

// out[o] for o in [lo, hi) of one tensor ([B, N] per-example values x), counter offset `offset`.
template <typename scalar_t, typename acc_t>
void release_span(const scalar_t* x, const acc_t* factor, int64_t B, int64_t N, int64_t lo, int64_t hi,
                  uint64_t seed, uint64_t offset, double std_in, acc_t scale, scalar_t* out) {
  using Z = normal_t<scalar_t>;  // float64 values draw float64 normals times the double std (philox.h)
  const Z stdv = static_cast<Z>(std_in);
  const int64_t m = hi - lo;
  acc_t part[kReleaseParts][kReleaseSpan] = {};
  for (int64_t b = 0; b < B; ++b) {  // example b into part b mod kReleaseParts, in increasing b
    const acc_t f = factor[b];
    if (f == acc_t(0)) continue;  // adds +0 (exactly nothing) on the GPU; x may be NaN/Inf here
    acc_t* p = part[b % kReleaseParts];
    const scalar_t* row = x + b * N + lo;
    if constexpr (std::is_same_v<scalar_t, float>) {
      // The same RZ values (scale_f32 is scale_rz_f32 bit for bit), vectorised, then the same adds:
      // the scalar loop's double compare per element ran ~20x slower than a GEMV.
      float rz[kReleaseSpan];
      scale_f32(row, f, rz, m);
      add_row(p, rz, m);
    } else {
      for (int64_t t = 0; t < m; ++t) p[t] += scaled(f, row[t]);
    }
  }
  // The span's normals in one batch (philox_normals: philox_normal8's values, its groups kLanes at a
  // time through the vectorised Philox and Box-Muller; one group at a time was 17 ns a normal, 16x
  // philox_noise_'s, and most of a kept conv's release).
  Z z[(kReleaseSpan / kNormalsPerGroup + 1) * kNormalsPerGroup];
  const int64_t g_lo = lo / kNormalsPerGroup;
  if (stdv > Z(0) && m > 0)
    philox_normals(seed, offset, static_cast<uint64_t>(g_lo), (hi - 1) / kNormalsPerGroup + 1 - g_lo, z);
  for (int64_t t = 0; t < m; ++t) {
    const int64_t o = lo + t;
    acc_t column[kReleaseParts];
    for (int q = 0; q < kReleaseParts; ++q) column[q] = part[q][t];
    acc_t v = release_parts_total(column);
    if (stdv > Z(0))  // philox_noise_'s accumulate: one product (float, or double for float64), one add in acc_t
      v = v + static_cast<acc_t>(stdv * z[o - g_lo * kNormalsPerGroup]);
    if (scale != acc_t(1)) v = v * scale;
    out[o] = static_cast<scalar_t>(v);
  }
}

template <typename scalar_t>
void release_tensor(const at::Tensor& x, const at::Tensor& factor, int64_t B, int64_t N, uint64_t seed,
                    uint64_t offset, double stdv, double scale, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* xp = B ? x.const_data_ptr<scalar_t>() : nullptr;
  const acc_t* fp = factor.const_data_ptr<acc_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const int64_t spans = (N + kReleaseSpan - 1) / kReleaseSpan;
  at::parallel_for(0, spans, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t lo = s * kReleaseSpan;
      release_span<scalar_t, acc_t>(xp, fp, B, N, lo, std::min(lo + kReleaseSpan, N), seed, offset, stdv,
                                    static_cast<acc_t>(scale), op);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> examples_release_cpu(const std::optional<at::Tensor>& weight,
                                                        const std::optional<at::Tensor>& bias,
                                                        const at::Tensor& factor_in, at::IntArrayRef noise_key,
                                                        double noise_std, double scale) {
  const ExamplesArgs a = check_examples_args(weight, bias, "examples_release");
  const ReleaseNoise k = check_release_args(a, factor_in, noise_key, noise_std, scale);
  const at::Tensor factor = factor_in.contiguous();
  at::Tensor ow = a.w.defined() ? host_empty(a.w.sizes().slice(1), a.like.options()) : a.like.new_empty({0});
  at::Tensor ob = a.b.defined() ? host_empty(a.b.sizes().slice(1), a.like.options()) : a.like.new_empty({0});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.like.scalar_type(), "examples_release_cpu", [&] {
    if (a.w.defined())
      release_tensor<scalar_t>(a.w, factor, a.s.B, a.s.Nw, k.seed, k.offset, k.stdv, scale, ow);
    if (a.b.defined())
      release_tensor<scalar_t>(a.b, factor, a.s.B, a.s.Nb, k.seed, k.offset + 1, k.stdv, scale, ob);
  });
  return {ow, ob};
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) {
  m.impl("examples_bound", &examples_bound_cpu);
  m.impl("examples_factors", &examples_factors_cpu);
  m.impl("examples_release", &examples_release_cpu);
}

}  // namespace bpclip
