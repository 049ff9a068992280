// CPU kernel of conv_patches (layout: bpclip_fast/patches.h): one pass over the output, a row's
// positions contiguous, so that the padded input, its im2col copy and the upcast of fp16/bf16 input
// are one op (ATen's chain was constant_pad_nd's fill and copy, then the strided view's copy).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "../patches_args.h"

namespace bpclip {
namespace {

// The output positions ox whose tap ox sw + off (off = kj dw - pw) lies inside [0, w): [lo, hi).
inline void valid_range(int64_t off, int64_t w, int64_t sw, int64_t wo, int64_t* lo, int64_t* hi) {
  *lo = off >= 0 ? 0 : std::min<int64_t>(wo, (-off + sw - 1) / sw);
  *hi = w - off <= 0 ? 0 : std::min<int64_t>(wo, (w - off + sw - 1) / sw);
  if (*hi < *lo) *hi = *lo;
}

template <typename T, typename acc_t>
void patches_rows(const T* x, const PatchGeometry& g, acc_t* out) {
  const int64_t rows = g.c * g.kh * g.kw, T_ = g.ho * g.wo;
  at::parallel_for(0, g.n * rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r / rows, row = r % rows;
      const int64_t kj = row % g.kw, ki = (row / g.kw) % g.kh, ch = row / (g.kh * g.kw);
      const int64_t off = kj * g.dw - g.pw;
      int64_t lo = 0, hi = 0;
      valid_range(off, g.w, g.sw, g.wo, &lo, &hi);
      const T* xc = x + i * g.s0 + ch * g.s1;
      acc_t* o = out + r * T_;
      for (int64_t oy = 0; oy < g.ho; ++oy, o += g.wo) {
        const int64_t iy = oy * g.sh - g.ph + ki * g.dh;
        if (iy < 0 || iy >= g.h) {
          std::fill(o, o + g.wo, acc_t(0));
          continue;
        }
        std::fill(o, o + lo, acc_t(0));
        std::fill(o + hi, o + g.wo, acc_t(0));
        if (hi == lo) continue;
        const T* src = xc + iy * g.s2 + (lo * g.sw + off) * g.s3;  // the tap of ox = lo
        acc_t* dst = o + lo;
        const int64_t len = hi - lo, step = g.sw * g.s3;
        if (step == 1) {  // contiguous taps: a vectorised copy and upcast
          for (int64_t k = 0; k < len; ++k) dst[k] = static_cast<acc_t>(src[k]);
        } else {
          for (int64_t k = 0; k < len; ++k) dst[k] = static_cast<acc_t>(src[k * step]);
        }
      }
    }
  });
}

at::Tensor conv_patches_cpu(const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation) {
  const PatchGeometry g = check_patches_args(x, kernel_size, stride, padding, dilation);
  at::Tensor out = patches_output(x, g);
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "conv_patches_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    patches_rows<scalar_t, acc_t>(x.const_data_ptr<scalar_t>(), g, out.mutable_data_ptr<acc_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) { m.impl("conv_patches", &conv_patches_cpu); }

}  // namespace bpclip
