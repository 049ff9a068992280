// CPU kernel of norm_affine_example_grads: the per-example gradients of the LayerNorm/GroupNorm
// affine weight and bias, gw[b, d] = sum_r g * ((x - mean) * rstd) and gb[b, d] = sum_r g, summed
// in the accumulation dtype (fp32 for fp32/fp16/bf16 data, fp64 for fp64) with the same
// per-element arithmetic as the CUDA kernels (csrc/cuda/norm_affine_kernels.cuh).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "../common.h"
#include "../host_cache.h"

namespace bpclip {
namespace {

// Parameters per LayerNorm task: the inner loop runs along d (contiguous, vectorisable, one
// accumulator per d) and every task still reads whole cache lines.
constexpr int64_t kLnTile = 512;

// LayerNorm, x as [B, R, D]: task (b, tile of d) walks the R rows of example b, accumulating
// straight into its slice of the output rows.
template <typename scalar_t, typename acc_t>
void ln_affine(const scalar_t* g, const scalar_t* x, const acc_t* mean, const acc_t* rstd, const NormAffineShape& s,
               acc_t* gw, acc_t* gb) {
  const int64_t tiles = (s.D + kLnTile - 1) / kLnTile;
  at::parallel_for(0, s.B * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / tiles;
      const int64_t lo = (t % tiles) * kLnTile;
      const int64_t n = std::min(kLnTile, s.D - lo);
      acc_t* w = gw + b * s.D + lo;
      acc_t* bias = gb + b * s.D + lo;
      std::fill(w, w + n, acc_t(0));
      std::fill(bias, bias + n, acc_t(0));
      for (int64_t r = 0; r < s.R; ++r) {
        const int64_t row = b * s.R + r;
        const acc_t m = mean[row], q = rstd[row];
        const scalar_t* gr = g + row * s.D + lo;
        const scalar_t* xr = x + row * s.D + lo;
        for (int64_t j = 0; j < n; ++j) {
          const acc_t gv = static_cast<acc_t>(gr[j]);
          w[j] += gv * ((static_cast<acc_t>(xr[j]) - m) * q);
          bias[j] += gv;
        }
      }
    }
  });
}

// GroupNorm, x as [B, D, R]: one contiguous row of R per (b, channel), eight independent
// accumulators per sum so that the loop vectorises without reassociating.
template <typename scalar_t, typename acc_t>
void gn_affine(const scalar_t* g, const scalar_t* x, const acc_t* mean, const acc_t* rstd, const NormAffineShape& s,
               acc_t* gw, acc_t* gb) {
  const int64_t per_group = s.D / s.G;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(s.R, 1));
  at::parallel_for(0, s.B * s.D, grain, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const int64_t stat = (o / s.D) * s.G + (o % s.D) / per_group;
      const acc_t m = mean[stat], q = rstd[stat];
      const scalar_t* gr = g + o * s.R;
      const scalar_t* xr = x + o * s.R;
      acc_t aw[8] = {}, ab[8] = {};
      int64_t j = 0;
      for (; j + 8 <= s.R; j += 8)
        for (int u = 0; u < 8; ++u) {
          const acc_t gv = static_cast<acc_t>(gr[j + u]);
          aw[u] += gv * ((static_cast<acc_t>(xr[j + u]) - m) * q);
          ab[u] += gv;
        }
      for (; j < s.R; ++j) {
        const acc_t gv = static_cast<acc_t>(gr[j]);
        aw[0] += gv * ((static_cast<acc_t>(xr[j]) - m) * q);
        ab[0] += gv;
      }
      gw[o] = ((aw[0] + aw[1]) + (aw[2] + aw[3])) + ((aw[4] + aw[5]) + (aw[6] + aw[7]));
      gb[o] = ((ab[0] + ab[1]) + (ab[2] + ab[3])) + ((ab[4] + ab[5]) + (ab[6] + ab[7]));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> norm_affine_example_grads_cpu(const at::Tensor& grad_out, const at::Tensor& x_in,
                                                                 const at::Tensor& mean_in, const at::Tensor& rstd_in,
                                                                 int64_t batch, int64_t groups, bool layer_norm) {
  const NormAffineShape s = check_norm_affine_args(grad_out, x_in, mean_in, rstd_in, batch, groups, layer_norm);
  const auto acc = acc_type_of(x_in);
  at::Tensor gw = host_empty({s.B, s.D}, x_in.options().dtype(acc));
  at::Tensor gb = host_empty({s.B, s.D}, x_in.options().dtype(acc));
  if (s.B * s.D == 0) return {gw, gb};
  const at::Tensor g = grad_out.contiguous();
  const at::Tensor x = x_in.contiguous();
  const at::Tensor mean = mean_in.reshape({-1}).to(acc).contiguous();
  const at::Tensor rstd = rstd_in.reshape({-1}).to(acc).contiguous();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "norm_affine_example_grads_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto fn = s.layer_norm ? ln_affine<scalar_t, acc_t> : gn_affine<scalar_t, acc_t>;
    fn(g.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), mean.const_data_ptr<acc_t>(),
       rstd.const_data_ptr<acc_t>(), s, gw.mutable_data_ptr<acc_t>(), gb.mutable_data_ptr<acc_t>());
  });
  return {gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) { m.impl("norm_affine_example_grads", &norm_affine_example_grads_cpu); }

}  // namespace bpclip
