// CPU kernel of layer_tail_ (csrc/include/bpclip_fast/tail.h): one op, as the CUDA kernel is one
// launch after the VJP's reductions. It calls the CPU kernels of philox_noise_ and
// clip_rows_backward directly (not through the dispatcher), so each job is the same code and bits
// as those ops'.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../common.h"
#include "bpclip_fast/tail.h"

namespace bpclip {

void philox_noise_into(at::Tensor& buf, int64_t seed, int64_t offset, double stdv, bool accumulate, double scale);
at::Tensor clip_rows_backward_into(const at::Tensor& grad, const at::Tensor& clipped, const at::Tensor& factor,
                                   const at::Tensor& norms, double bound, c10::string_view clip_fn);

namespace {

// b[j] = sum_r rows[r, j], in the order of tail.h, rounded once to scalar_t.
template <typename scalar_t>
void column_sums(const scalar_t* rows, int64_t R, int64_t n, scalar_t* b) {
  at::parallel_for(0, n, 256, [&](int64_t lo, int64_t hi) {
    std::vector<double> slice(static_cast<size_t>(kTailSlices * (hi - lo)), 0.0);
    for (int64_t r = 0; r < R; ++r) {
      double* acc = slice.data() + (r % kTailSlices) * (hi - lo);
      const scalar_t* row = rows + r * n + lo;
      for (int64_t j = 0; j < hi - lo; ++j) acc[j] += static_cast<double>(row[j]);
    }
    for (int64_t j = 0; j < hi - lo; ++j) {
      double s = 0.0;
      for (int k = 0; k < kTailSlices; ++k) s += slice[static_cast<size_t>(k * (hi - lo) + j)];
      b[lo + j] = static_cast<scalar_t>(s);
    }
  });
}

// Without a draw (std 0) the values are only scaled, as mul_(scale) would (no Philox at all).
void noise_or_scale(at::Tensor& buf, int64_t seed, int64_t offset, double stdv, double scale) {
  if (buf.numel() == 0) return;
  if (stdv > 0.0) {
    philox_noise_into(buf, seed, offset, stdv, true, scale);
  } else if (scale != 1.0) {
    AT_DISPATCH_FLOATING_TYPES(buf.scalar_type(), "layer_tail_cpu", [&] {
      scalar_t* p = buf.mutable_data_ptr<scalar_t>();
      const scalar_t s = static_cast<scalar_t>(scale);
      at::parallel_for(0, buf.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) p[i] = p[i] * s;
      });
    });
  }
}

at::Tensor layer_tail_cpu(at::Tensor& w, at::Tensor& b, const c10::optional<at::Tensor>& bias_rows,
                          const c10::optional<at::Tensor>& grad, const c10::optional<at::Tensor>& clipped,
                          const c10::optional<at::Tensor>& factor, const c10::optional<at::Tensor>& norm,
                          double input_bound, c10::string_view clip_fn, int64_t seed, int64_t offset, double stdv,
                          double scale) {
  check_tail_args(w, b, bias_rows, grad, clipped, factor, norm, input_bound, clip_fn, stdv, scale);
  // The VJP first: it reads nothing the rest writes, and whatever it raises leaves w and b untouched.
  at::Tensor gx = grad.has_value() && grad->defined()
                      ? clip_rows_backward_into(*grad, *clipped, *factor, *norm, input_bound, clip_fn)
                      : w.new_empty({0});
  if (bias_rows.has_value() && bias_rows->defined()) {
    AT_DISPATCH_FLOATING_TYPES(b.scalar_type(), "layer_tail_cpu", [&] {
      column_sums<scalar_t>(bias_rows->const_data_ptr<scalar_t>(), bias_rows->size(0), b.numel(),
                            b.mutable_data_ptr<scalar_t>());
    });
  }
  noise_or_scale(w, seed, offset, stdv, scale);
  noise_or_scale(b, seed, static_cast<int64_t>(static_cast<uint64_t>(offset) + 1u), stdv, scale);
  return gx;
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) { m.impl("layer_tail_", &layer_tail_cpu); }

}  // namespace bpclip
