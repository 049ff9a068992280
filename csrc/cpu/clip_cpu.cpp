// CPU kernels of clip_rows (per-example norm + clip factor + scaling), scale_rows (the scaling
// alone, from a saved factor) and clip_rows_backward (the exact VJP of the input clipping). Two
// passes over the data each: a reduction, then an elementwise pass; the per-example step in
// between touches B numbers.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#include "../common.h"
#include "bpclip_fast/clip.h"
#include "bpclip_fast/rows.h"
#include "scale_f32.h"
#include "vector_clones.h"

namespace bpclip {
namespace {

constexpr int64_t kChunk = 16384;  // elements per partial sum: large enough to amortise, small enough to split a row
constexpr int64_t kTile = 16384;   // elements per task of the elementwise passes

// fp32, the common case, gets its loops in AVX-512/AVX2/baseline clones (vector_clones.h): with
// the baseline SSE2 loops alone the fused op was slower than torch's own vectorised ops.
//
// Every reduction accumulates in double (bpclip_fast/clip.h, step (a)): an fp32 square is exact
// there, so no finite row overflows and the norm's error is proven. The per-example factor and
// norm are stored as fp32 (fp64 for fp64 data).

// Sixteen independent double accumulators: two AVX-512 registers, four AVX2 ones; the compiler
// vectorises them without reassociating the sums.
BPCLIP_VECTOR_CLONES double reduce_f32(const float* x, const float* y, int64_t n, int mode) {
  double a[16] = {};
  int64_t j = 0;
  if (mode == kSumSquares) {
    for (; j + 16 <= n; j += 16)
      for (int u = 0; u < 16; ++u) {
        const double v = x[j + u];
        a[u] += v * v;
      }
    for (; j < n; ++j) {
      const double v = x[j];
      a[0] += v * v;
    }
  } else if (mode == kSumAbs) {
    for (; j + 16 <= n; j += 16)
      for (int u = 0; u < 16; ++u) a[u] += std::fabs(static_cast<double>(x[j + u]));
    for (; j < n; ++j) a[0] += std::fabs(static_cast<double>(x[j]));
  } else {
    for (; j + 16 <= n; j += 16)
      for (int u = 0; u < 16; ++u) a[u] += static_cast<double>(x[j + u]) * static_cast<double>(y[j + u]);
    for (; j < n; ++j) a[0] += static_cast<double>(x[j]) * static_cast<double>(y[j]);
  }
  for (int w = 8; w > 0; w >>= 1)
    for (int u = 0; u < w; ++u) a[u] += a[u + w];
  return a[0];
}

}  // namespace

// out = RZ(f * x) = scale_rz_f32(f, x), the element function of clip.h. Its portable form
// (a comparison of the double product with its rounding to float) costs the vectorised loop five
// shuffles per eight elements to move 64-bit masks to 32-bit lanes, so CPUs with FMA (x86-64-v3:
// every AVX2 server CPU) use an equivalent float form: p = RN(|f| |x|) and the exact residual
// r = fma(|f|, |x|, -p); a negative residual (IEEE keeps its sign even when it underflows; an exact
// zero is +0) means p rounded up, so its bit pattern steps back by one. Overflow (p = Inf,
// r = -Inf) steps back to FLT_MAX; subnormals need nothing special. FMA only computes the residual,
// it contracts nothing, so no result changes: both forms are RZ exactly, and give the bits of the
// CUDA kernel. A non-finite x (only possible through scale_rows) flags the tile, which is then
// redone with scale_rz_f32 so that even NaN payloads match.
static BPCLIP_VECTOR_CLONES void scale_f32_portable(const float* x, float f, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = scale_rz_f32(f, x[i]);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BPCLIP_SCALE_FMA 1
static __attribute__((target("avx2,fma"))) bool scale_f32_fma(const float* x, float f, float* out, int64_t n) {
  const float a = std::fabs(f);
  const uint32_t fsign = float_bits(f) & 0x80000000u;
  uint32_t odd = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t xb = float_bits(x[i]);
    const float b = bits_float(xb & 0x7fffffffu);
    const float p = a * b;
    const float r = __builtin_fmaf(a, b, -p);
    out[i] = bits_float((float_bits(p) - (float_bits(r) >> 31)) | ((xb & 0x80000000u) ^ fsign));
    odd |= static_cast<uint32_t>(!(b <= 3.40282347e38f));  // x is Inf or NaN
  }
  return odd != 0;
}
#endif

static bool has_fma() {
#ifdef BPCLIP_SCALE_FMA
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

void scale_f32(const float* x, float f, float* out, int64_t n) {
#ifdef BPCLIP_SCALE_FMA
  static const bool fma = has_fma();
  if (fma && std::fabs(f) <= 3.40282347e38f) {  // (a non-finite factor, only through scale_rows: portable)
    if (scale_f32_fma(x, f, out, n)) scale_f32_portable(x, f, out, n);
    return;
  }
#endif
  scale_f32_portable(x, f, out, n);
}

namespace {

BPCLIP_VECTOR_CLONES void jvp_f32(const float* g, const float* xc, double s, double c, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<float>(s * static_cast<double>(g[i]) - c * static_cast<double>(xc[i]));
}

// Eight independent accumulators so that the compiler vectorises the loop without reassociating.
// Modes kSumSquares and kSumAbs: out[0]; kDot: out[0] = x . y and out[1] = x . x.
template <typename scalar_t>
void reduce_span(const scalar_t* x, const scalar_t* y, int64_t n, int mode, double out[2]) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    // kDot: two passes over the chunk (64 KB, still in cache for the second): GCC vectorises each
    // cleanly, not the fused loop.
    out[0] = reduce_f32(x, y, n, mode);
    if (mode == kDot) out[1] = reduce_f32(x, nullptr, n, kSumSquares);
    return;
  }
  double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  if (mode == kSumSquares) {
    for (; j + 8 <= n; j += 8)
      for (int u = 0; u < 8; ++u) {
        const double v = static_cast<double>(x[j + u]);
        a[u] += v * v;
      }
    for (; j < n; ++j) {
      const double v = static_cast<double>(x[j]);
      a[0] += v * v;
    }
  } else if (mode == kSumAbs) {
    for (; j + 8 <= n; j += 8)
      for (int u = 0; u < 8; ++u) a[u] += std::abs(static_cast<double>(x[j + u]));
    for (; j < n; ++j) a[0] += std::abs(static_cast<double>(x[j]));
  } else {
    double q[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; j + 8 <= n; j += 8)
      for (int u = 0; u < 8; ++u) {
        const double v = static_cast<double>(x[j + u]);
        a[u] += v * static_cast<double>(y[j + u]);
        q[u] += v * v;
      }
    for (; j < n; ++j) {
      const double v = static_cast<double>(x[j]);
      a[0] += v * static_cast<double>(y[j]);
      q[0] += v * v;
    }
    out[1] = ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]));
  }
  out[0] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// partial[w] for chunk w of the B*G*K chunks; for kDot also partial[B*G*K + w] (x . x).
template <typename scalar_t>
void partial_sums(const scalar_t* x, const scalar_t* y, const RowGeometry& r, int mode, double* partial) {
  const int64_t total = r.B * r.G * r.K;
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t k = w % r.K;
      const int64_t bg = w / r.K;  // b*G + g
      const int64_t start = bg * r.S + k * r.chunk;
      const int64_t len = std::min(r.chunk, r.S - k * r.chunk);
      double out[2] = {0, 0};
      reduce_span<scalar_t>(x + start, y == nullptr ? nullptr : y + start, len, mode, out);
      partial[w] = out[0];
      if (mode == kDot) partial[total + w] = out[1];
    }
  });
}

// total[b] = sum_g q(sum_k partial[b, g, k]),  q(a) = a^2 for l15, a otherwise.
double row_total(const double* partial, const RowGeometry& r, int64_t b, bool square_groups) {
  double total = 0;
  for (int64_t g = 0; g < r.G; ++g) {
    double a = 0;
    const double* p = partial + (b * r.G + g) * r.K;
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

// The stored element: RZ(f * x) in the storage type (clip.h); f is the stored factor.
inline float scale_elem(float f, float x) { return scale_rz_f32(f, x); }
inline double scale_elem(double f, double x) { return scale_rz_f64(f, x); }
inline c10::Half scale_elem(float f, c10::Half x) {
  return c10::Half(scale_rz_f16_bits(f, static_cast<float>(x)), c10::Half::from_bits());
}
inline c10::BFloat16 scale_elem(float f, c10::BFloat16 x) {
  return c10::BFloat16(scale_rz_bf16_bits(f, static_cast<float>(x)), c10::BFloat16::from_bits());
}

// The stored factor: rounded toward zero to fp32 (never up: clip.h step (c)), or kept in fp64.
inline float store_factor(double s, float*) { return f64_to_f32_rz(s); }
inline double store_factor(double s, double*) { return s; }

// A value computed in double, stored with one rounding to fp32 (then the storage type).
template <typename scalar_t>
scalar_t from_double(double v) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return v;
  } else {
    return static_cast<scalar_t>(static_cast<float>(v));
  }
}

// out[row b] = RZ(factor[b] * x[row b]), zeros where factor[b] = 0 (never 0 * x: x may hold the
// NaN/Inf that caused it). The one elementwise pass of clip_rows and scale_rows. mask: the factor
// used is 1 where factor[b] > 0 and 0 otherwise (RZ(1 * x) = x: the row kept as it is, or zeros).
template <typename scalar_t, typename fac_t>
void scale_pass(const scalar_t* xp, const fac_t* fp, const RowGeometry& r, scalar_t* op, bool mask = false) {
  for_each_row_tile(r, [&](int64_t b, int64_t lo, int64_t hi) {
    const fac_t f = mask ? (fp[b] > fac_t(0) ? fac_t(1) : fac_t(0)) : fp[b];
    if (f == fac_t(0)) {
      for (int64_t i = lo; i < hi; ++i) op[i] = scalar_t(0);
    } else if constexpr (std::is_same_v<scalar_t, float>) {
      scale_f32(xp + lo, f, op + lo, hi - lo);
    } else {
      for (int64_t i = lo; i < hi; ++i) op[i] = scale_elem(f, xp[i]);
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
  const double bound_eff = effective_bound(bound, r.N);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "clip_rows_cpu", [&] {
    using fac_t = at::opmath_type<scalar_t>;  // fp32, or fp64 for fp64 data
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    std::vector<double> partial(static_cast<size_t>(r.B * r.G * r.K));
    partial_sums<scalar_t>(xp, nullptr, r, norm == kL15 ? kSumAbs : kSumSquares, partial.data());

    fac_t* fp = factor.mutable_data_ptr<fac_t>();
    fac_t* np = norms.mutable_data_ptr<fac_t>();
    int64_t bad = 0;
    for (int64_t b = 0; b < r.B; ++b) {
      const double n = std::sqrt(row_total(partial.data(), r, b, norm == kL15));
      np[b] = static_cast<fac_t>(n);
      fp[b] = store_factor(clip_factor(n, bound_eff, fn, gamma), fp);
      bad += is_finite_norm(n) ? 0 : 1;
    }
    if (bad) nonfinite.add_(bad);
    scale_pass<scalar_t, fac_t>(xp, fp, r, out.mutable_data_ptr<scalar_t>());
  });
  return {out, factor, norms};
}

at::Tensor scale_rows_cpu(const at::Tensor& x_in, const at::Tensor& factor_in) {
  check_scale_rows_args(x_in, factor_in);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor factor = factor_in.contiguous();
  const RowGeometry r = row_geometry(x, kL2, kChunk);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "scale_rows_cpu", [&] {
    using fac_t = at::opmath_type<scalar_t>;
    scale_pass<scalar_t, fac_t>(x.const_data_ptr<scalar_t>(), factor.const_data_ptr<fac_t>(), r,
                                out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> scale_rows2_cpu(const at::Tensor& x_in, const at::Tensor& fx_in,
                                                   const at::Tensor& y_in, const at::Tensor& fy_in, bool mask_y) {
  check_scale_rows2_args(x_in, fx_in, y_in, fy_in);
  const at::Tensor x = x_in.contiguous(), y = y_in.contiguous();
  const at::Tensor fx = fx_in.contiguous(), fy = fy_in.contiguous();
  const RowGeometry rx = row_geometry(x, kL2, kChunk), ry = row_geometry(y, kL2, kChunk);
  at::Tensor ox = at::empty_like(x, at::MemoryFormat::Contiguous), oy = at::empty_like(y, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "scale_rows2_cpu", [&] {
    using fac_t = at::opmath_type<scalar_t>;
    scale_pass<scalar_t, fac_t>(x.const_data_ptr<scalar_t>(), fx.const_data_ptr<fac_t>(), rx,
                                ox.mutable_data_ptr<scalar_t>());
    scale_pass<scalar_t, fac_t>(y.const_data_ptr<scalar_t>(), fy.const_data_ptr<fac_t>(), ry,
                                oy.mutable_data_ptr<scalar_t>(), mask_y);
  });
  return {ox, oy};
}

// clip_rows(g) with scale_rows(x, x_factor): on a GPU the two scalings are one launch (clip_launch.cuh).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> clip_rows_rescale_cpu(
    const at::Tensor& g, at::Tensor& nonfinite, double bound, c10::string_view norm, c10::string_view clip_fn,
    double gamma, const at::Tensor& x, const at::Tensor& x_factor) {
  check_clip_rows_rescale_args(g, x, x_factor);
  auto [gc, factor, norms] = clip_rows_cpu(g, nonfinite, bound, norm, clip_fn, gamma);
  return {gc, factor, norms, scale_rows_cpu(x, x_factor)};
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
  const double bound_eff = effective_bound(bound, r.N);  // the bound the forward applied

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "clip_rows_backward_cpu", [&] {
    using fac_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    const fac_t* fp = fc.const_data_ptr<fac_t>();
    const fac_t* np = nc.const_data_ptr<fac_t>();
    std::vector<double> partial(static_cast<size_t>(2 * r.B * r.K));
    partial_sums<scalar_t>(xp, gp, r, kDot, partial.data());
    std::vector<double> coef(static_cast<size_t>(r.B));
    for (int64_t b = 0; b < r.B; ++b) {
      const double dot = row_total(partial.data(), r, b, false);
      const double sq = row_total(partial.data() + r.B * r.K, r, b, false);
      coef[b] = clip_jvp_coef(np[b], fp[b], bound_eff, fn, dot, sq);
    }
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    for_each_row_tile(r, [&](int64_t b, int64_t lo, int64_t hi) {
      const double sb = fp[b], c = coef[b];
      if (sb == 0.0) {
        for (int64_t i = lo; i < hi; ++i) op[i] = scalar_t(0);
      } else if constexpr (std::is_same_v<scalar_t, float>) {
        // (the casts are no-ops; the branch is compiled, not taken, for the other dtypes)
        jvp_f32(reinterpret_cast<const float*>(gp + lo), reinterpret_cast<const float*>(xp + lo), sb, c,
                reinterpret_cast<float*>(op + lo), hi - lo);
      } else {
        for (int64_t i = lo; i < hi; ++i)
          op[i] = from_double<scalar_t>(sb * static_cast<double>(gp[i]) - c * static_cast<double>(xp[i]));
      }
    });
  });
  return out;
}

}  // namespace

at::Tensor clip_rows_backward_into(const at::Tensor& grad, const at::Tensor& clipped, const at::Tensor& factor,
                                   const at::Tensor& norms, double bound, c10::string_view clip_fn) {
  return clip_rows_backward_cpu(grad, clipped, factor, norms, bound, clip_fn);
}

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) {
  m.impl("clip_rows", &clip_rows_cpu);
  m.impl("clip_rows_backward", &clip_rows_backward_cpu);
  m.impl("scale_rows", &scale_rows_cpu);
  m.impl("scale_rows2", &scale_rows2_cpu);
  m.impl("clip_rows_rescale", &clip_rows_rescale_cpu);
}

}  // namespace bpclip
