// CPU kernel of banded_row_: one row of the banded mechanism's correlated noise (bpclip_fast/banded.py),
//   w_i = std z_i + sum_{a = 1..b-1} weights[a-1] ring[slot(a), i],  slot(a) = (newest - a + 1) mod (b-1),
// stored into the oldest slot (newest + 1) mod (b-1) and added to the out covering i. z is
// philox_noise_'s stream at (seed, offset), element i of a flat buffer of P (noise_cpu.h).
//
// Order of the arithmetic, which the CUDA kernel (band_kernels.cuh) repeats so that the two agree bit
// for bit without FMA contraction: in T (fp32 for float32, fp64 for float64), std z first, then the
// ages a = 1, 2, ... each as one multiply and one add; then out = out + w (one rounding, as torch's
// add of the stored row). The slot of age b-1 is read before it is overwritten, element by element,
// so the row is made in place.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "../band_args.h"
#include "bpclip_fast/philox.h"
#include "noise_cpu.h"

namespace bpclip {
namespace {

constexpr int64_t kGroupsPerTask = 512;  // 4096 elements per parallel task
constexpr int64_t kGroupsPerBatch = 64;  // normals drawn at a time (whole Philox batches of 16 groups)

template <typename T>
void band_span(T* ring, int64_t P, int slots, int newest, const T* weights, T stdv, T* const* outs,
               const int64_t* starts, const int64_t* ends, int n_outs, uint64_t seed, uint64_t offset, int64_t glo,
               int64_t ghi) {
  normal_t<T> z[kGroupsPerBatch * kNormalsPerGroup];  // float64 rows draw float64 normals (philox.h)
  T* dst = ring + static_cast<int64_t>((newest + 1) % slots) * P;
  for (int64_t g = glo; g < ghi; g += kGroupsPerBatch) {
    const int64_t groups = std::min<int64_t>(kGroupsPerBatch, ghi - g);
    philox_normals(seed, offset, static_cast<uint64_t>(g), groups, z);
    const int64_t lo = g * kNormalsPerGroup, hi = std::min<int64_t>(P, (g + groups) * kNormalsPerGroup);
    for (int64_t i = lo; i < hi; ++i) {
      T v = stdv * static_cast<T>(z[i - lo]);
      int s = newest;
      for (int a = 0; a < slots; ++a) {
        v = v + weights[a] * ring[static_cast<int64_t>(s) * P + i];
        s = s == 0 ? slots - 1 : s - 1;
      }
      dst[i] = v;
      for (int k = 0; k < n_outs; ++k) {
        if (i >= starts[k] && i < ends[k]) outs[k][i - starts[k]] = outs[k][i - starts[k]] + v;
      }
    }
  }
}

void banded_row_cpu(at::Tensor& ring, at::TensorList outs, at::IntArrayRef starts, int64_t newest,
                    at::ArrayRef<double> weights, int64_t seed, int64_t offset, double stdv) {
  const int slots = check_banded_row_args(ring, outs, starts, newest, weights, stdv);
  const int64_t P = ring.size(1);
  if (P == 0) return;
  const int64_t groups = (P + kNormalsPerGroup - 1) / kNormalsPerGroup;
  AT_DISPATCH_FLOATING_TYPES(ring.scalar_type(), "banded_row_cpu", [&] {
    scalar_t w[kBandMaxSlots];
    for (int a = 0; a < slots; ++a) w[a] = static_cast<scalar_t>(weights[a]);
    scalar_t* o[kBandMaxOuts];
    int64_t s0[kBandMaxOuts], s1[kBandMaxOuts];
    const int n_outs = static_cast<int>(outs.size());
    for (int k = 0; k < n_outs; ++k) {
      o[k] = outs[k].mutable_data_ptr<scalar_t>();
      s0[k] = starts[k];
      s1[k] = starts[k] + outs[k].numel();
    }
    scalar_t* r = ring.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, groups, kGroupsPerTask, [&](int64_t glo, int64_t ghi) {
      band_span<scalar_t>(r, P, slots, static_cast<int>(newest), w, static_cast<scalar_t>(stdv), o, s0, s1, n_outs,
                          static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), glo, ghi);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) { m.impl("banded_row_", &banded_row_cpu); }

}  // namespace bpclip
