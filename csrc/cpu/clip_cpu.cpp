// CPU kernels of clip_rows (per-example norm + clip factor + scaling) and clip_rows_backward
// (the exact VJP of the input clipping). Two passes over the data each: a reduction, then an
// elementwise pass; the per-example step in between touches B numbers.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#include "../common.h"
#include "bpclip_fast/clip.h"
#include "vector_clones.h"

namespace bpclip {
namespace {

constexpr int64_t kChunk = 16384;  // elements per partial sum: large enough to amortise, small enough to split a row
constexpr int64_t kTile = 16384;   // elements per task of the elementwise passes

enum ReduceMode { kSumSquares = 0, kSumAbs = 1, kDot = 2 };

// fp32, the common case, gets its loops in AVX-512/AVX2/baseline clones (vector_clones.h): with
// the baseline SSE2 loops alone the fused op was slower than torch's own vectorised ops.

// Sixteen independent accumulators: one AVX-512 register, two AVX2 ones; the compiler vectorises
// them without reassociating the sums.
BPCLIP_VECTOR_CLONES float reduce_f32(const float* x, const float* y, int64_t n, int mode) {
  float a[16] = {};
  int64_t j = 0;
  if (mode == kSumSquares) {
    for (; j + 16 <= n; j += 16)
      for (int u = 0; u < 16; ++u) a[u] += x[j + u] * x[j + u];
    for (; j < n; ++j) a[0] += x[j] * x[j];
  } else if (mode == kSumAbs) {
    for (; j + 16 <= n; j += 16)
      for (int u = 0; u < 16; ++u) a[u] += std::fabs(x[j + u]);
    for (; j < n; ++j) a[0] += std::fabs(x[j]);
  } else {
    for (; j + 16 <= n; j += 16)
      for (int u = 0; u < 16; ++u) a[u] += x[j + u] * y[j + u];
    for (; j < n; ++j) a[0] += x[j] * y[j];
  }
  for (int w = 8; w > 0; w >>= 1)
    for (int u = 0; u < w; ++u) a[u] += a[u + w];
  return a[0];
}

BPCLIP_VECTOR_CLONES void scale_f32(const float* x, float f, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * f;
}

BPCLIP_VECTOR_CLONES void jvp_f32(const float* g, const float* xc, float s, float c, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = s * g[i] - c * xc[i];
}

// Eight independent accumulators so that the compiler vectorises the loop without reassociating.
template <typename scalar_t, typename acc_t>
acc_t reduce_span(const scalar_t* x, const scalar_t* y, int64_t n, int mode) {
  if constexpr (std::is_same_v<scalar_t, float>) return reduce_f32(x, y, n, mode);
  acc_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  if (mode == kSumSquares) {
    for (; j + 8 <= n; j += 8)
      for (int u = 0; u < 8; ++u) {
        const acc_t v = static_cast<acc_t>(x[j + u]);
        a[u] += v * v;
      }
    for (; j < n; ++j) {
      const acc_t v = static_cast<acc_t>(x[j]);
      a[0] += v * v;
    }
  } else if (mode == kSumAbs) {
    for (; j + 8 <= n; j += 8)
      for (int u = 0; u < 8; ++u) a[u] += std::abs(static_cast<acc_t>(x[j + u]));
    for (; j < n; ++j) a[0] += std::abs(static_cast<acc_t>(x[j]));
  } else {
    for (; j + 8 <= n; j += 8)
      for (int u = 0; u < 8; ++u) a[u] += static_cast<acc_t>(x[j + u]) * static_cast<acc_t>(y[j + u]);
    for (; j < n; ++j) a[0] += static_cast<acc_t>(x[j]) * static_cast<acc_t>(y[j]);
  }
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

template <typename scalar_t, typename acc_t>
void partial_sums(const scalar_t* x, const scalar_t* y, const RowGeometry& r, int mode, acc_t* partial) {
  const int64_t total = r.B * r.G * r.K;
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t k = w % r.K;
      const int64_t bg = w / r.K;  // b*G + g
      const int64_t start = bg * r.S + k * r.chunk;
      const int64_t len = std::min(r.chunk, r.S - k * r.chunk);
      partial[w] = reduce_span<scalar_t, acc_t>(x + start, y == nullptr ? nullptr : y + start, len, mode);
    }
  });
}

// total[b] = sum_g q(sum_k partial[b, g, k]),  q(a) = a^2 for l15, a otherwise.
template <typename acc_t>
acc_t row_total(const acc_t* partial, const RowGeometry& r, int64_t b, bool square_groups) {
  acc_t total = 0;
  for (int64_t g = 0; g < r.G; ++g) {
    acc_t a = 0;
    const acc_t* p = partial + (b * r.G + g) * r.K;
    for (int64_t k = 0; k < r.K; ++k) a += p[k];
    total += square_groups ? a * a : a;
  }
  return total;
}

// Calls fn(b, lo, hi) for every tile [lo, hi) of at most kTile elements of every row b, in parallel.
template <typename Fn>
void for_each_row_tile(const RowGeometry& r, const Fn& fn) {
  const int64_t tiles = (r.N + kTile - 1) / kTile;
  at::parallel_for(0, r.B * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / tiles;
      const int64_t lo = b * r.N + (t % tiles) * kTile;
      fn(b, lo, std::min(lo + kTile, (b + 1) * r.N));
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> clip_rows_cpu(const at::Tensor& x_in, at::Tensor& nonfinite,
                                                              double bound, c10::string_view norm_s,
                                                              c10::string_view clip_fn_s, double gamma) {
  const auto [norm, fn] = check_clip_rows_args(x_in, nonfinite, bound, norm_s, clip_fn_s, gamma);
  const at::Tensor x = x_in.contiguous();
  const RowGeometry r = row_geometry(x, norm, kChunk);
  const auto acc = acc_type_of(x);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor factor = at::empty({r.B}, x.options().dtype(acc));
  at::Tensor norms = at::empty({r.B}, x.options().dtype(acc));
  if (r.B == 0) return {out, factor, norms};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "clip_rows_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    std::vector<acc_t> partial(static_cast<size_t>(r.B * r.G * r.K));
    partial_sums<scalar_t, acc_t>(xp, nullptr, r, norm == kL15 ? kSumAbs : kSumSquares, partial.data());

    acc_t* fp = factor.mutable_data_ptr<acc_t>();
    acc_t* np = norms.mutable_data_ptr<acc_t>();
    int64_t bad = 0;
    for (int64_t b = 0; b < r.B; ++b) {
      const acc_t n = std::sqrt(row_total(partial.data(), r, b, norm == kL15));
      np[b] = n;
      fp[b] = clip_factor<acc_t>(n, static_cast<acc_t>(bound), fn, static_cast<acc_t>(gamma));
      bad += is_finite_norm(n) ? 0 : 1;
    }
    if (bad) nonfinite.add_(bad);

    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    for_each_row_tile(r, [&](int64_t b, int64_t lo, int64_t hi) {
      const acc_t f = fp[b];
      // A zero factor writes zeros, never 0 * x: x may hold the NaN/Inf that caused it.
      if (f == acc_t(0)) {
        for (int64_t i = lo; i < hi; ++i) op[i] = scalar_t(0);
      } else if constexpr (std::is_same_v<scalar_t, float>) {
        // (the casts are no-ops; the branch is compiled, not taken, for the other dtypes)
        scale_f32(reinterpret_cast<const float*>(xp + lo), f, reinterpret_cast<float*>(op + lo), hi - lo);
      } else {
        for (int64_t i = lo; i < hi; ++i) op[i] = static_cast<scalar_t>(static_cast<acc_t>(xp[i]) * f);
      }
    });
  });
  return {out, factor, norms};
}

at::Tensor clip_rows_backward_cpu(const at::Tensor& grad_in, const at::Tensor& clipped_in, const at::Tensor& factor,
                                  const at::Tensor& norms, double bound, c10::string_view clip_fn_s) {
  const int fn = check_clip_backward_args(grad_in, clipped_in, factor, norms, bound, clip_fn_s);
  const at::Tensor g = grad_in.contiguous();
  const at::Tensor xc = clipped_in.contiguous();
  const RowGeometry r = row_geometry(g, kL2, kChunk);
  at::Tensor out = at::empty_like(g, at::MemoryFormat::Contiguous);
  if (r.B == 0) return out;
  const at::Tensor fc = factor.contiguous(), nc = norms.contiguous();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "clip_rows_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    const acc_t* fp = fc.const_data_ptr<acc_t>();
    const acc_t* np = nc.const_data_ptr<acc_t>();
    std::vector<acc_t> partial(static_cast<size_t>(r.B * r.K));
    partial_sums<scalar_t, acc_t>(xp, gp, r, kDot, partial.data());
    std::vector<acc_t> coef(static_cast<size_t>(r.B));
    for (int64_t b = 0; b < r.B; ++b) {
      coef[b] = clip_jvp_kappa<acc_t>(np[b], fp[b], static_cast<acc_t>(bound), fn) * row_total(partial.data(), r, b, false);
    }
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    for_each_row_tile(r, [&](int64_t b, int64_t lo, int64_t hi) {
      const acc_t sb = fp[b], c = coef[b];
      if (sb == acc_t(0)) {
        for (int64_t i = lo; i < hi; ++i) op[i] = scalar_t(0);
      } else if constexpr (std::is_same_v<scalar_t, float>) {
        jvp_f32(reinterpret_cast<const float*>(gp + lo), reinterpret_cast<const float*>(xp + lo), sb, c,
                reinterpret_cast<float*>(op + lo), hi - lo);
      } else {
        for (int64_t i = lo; i < hi; ++i)
          op[i] = static_cast<scalar_t>(sb * static_cast<acc_t>(gp[i]) - c * static_cast<acc_t>(xp[i]));
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) {
  m.impl("clip_rows", &clip_rows_cpu);
  m.impl("clip_rows_backward", &clip_rows_backward_cpu);
}

}  // namespace bpclip
