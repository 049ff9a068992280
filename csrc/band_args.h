// Validation of banded_row_'s arguments, shared by its CPU and CUDA kernels (the Python wrapper,
// bpclip_fast/_ops.py, checks the same with longer messages; these keep a direct torch.ops call
// memory-safe).
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cmath>

#include "bpclip_fast/band.h"
#include "common.h"

namespace bpclip {

// Returns the ring's slot count (bands - 1).
inline int check_banded_row_args(const at::Tensor& ring, at::TensorList outs, at::IntArrayRef starts, int64_t newest,
                                 at::ArrayRef<double> weights, double stdv) {
  constexpr const char* op = "bpclip_fast.banded_row_: ";
  TORCH_CHECK(ring.dim() == 2 && ring.is_contiguous(), op, "ring must be a contiguous [bands - 1, P] tensor, got ",
              ring.sizes(), ring.is_contiguous() ? "" : " (not contiguous)");
  const auto st = ring.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble, op, "ring must be float32 or float64, got ", st);
  const int64_t slots = ring.size(0), P = ring.size(1);
  TORCH_CHECK(slots >= 1 && slots <= kBandMaxSlots, op, "ring needs 1 to ", kBandMaxSlots, " slots, got ", slots);
  TORCH_CHECK(newest >= 0 && newest < slots, op, "newest must be a slot in [0, ", slots, "), got ", newest);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == slots, op, "weights needs one entry per ring slot (", slots,
              "), got ", weights.size());
  for (double w : weights) TORCH_CHECK(std::isfinite(w), op, "weights must be finite, got ", w);
  TORCH_CHECK(noise_std_ok(stdv), op, "std must be " BPCLIP_NOISE_STD_RULE ", got ", stdv);
  TORCH_CHECK(static_cast<int64_t>(outs.size()) <= kBandMaxOuts, op, "at most ", kBandMaxOuts, " outs, got ",
              outs.size());
  TORCH_CHECK(starts.size() == outs.size(), op, "starts needs one entry per out (", outs.size(), "), got ",
              starts.size());
  for (size_t k = 0; k < outs.size(); ++k) {
    const at::Tensor& o = outs[k];
    TORCH_CHECK(o.scalar_type() == st && o.device() == ring.device() && o.is_contiguous(), op, "out ", k,
                " must be contiguous ", st, " on ", ring.device(), " (the ring's), got ", o.scalar_type(), " on ",
                o.device(), o.is_contiguous() ? "" : " (not contiguous)");
    TORCH_CHECK(starts[k] >= 0 && starts[k] <= P - o.numel(), op, "out ", k, " covers elements [", starts[k], ", ",
                starts[k] + o.numel(), ") outside the row's [0, ", P, ")");
    TORCH_CHECK(o.numel() == 0 || at::get_overlap_status(o, ring) == at::MemOverlapStatus::No, op, "out ", k,
                " shares memory with the ring");
    for (size_t j = 0; j < k; ++j) {
      const at::Tensor& q = outs[j];
      TORCH_CHECK(o.numel() == 0 || q.numel() == 0 || at::get_overlap_status(o, q) == at::MemOverlapStatus::No, op,
                  "outs ", j, " and ", k, " share memory");
      TORCH_CHECK(starts[k] + o.numel() <= starts[j] || starts[j] + q.numel() <= starts[k] || o.numel() == 0 ||
                      q.numel() == 0,
                  op, "outs ", j, " and ", k, " cover the same elements of the row");
    }
  }
  return static_cast<int>(slots);
}

}  // namespace bpclip
