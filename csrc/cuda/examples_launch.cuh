// The launches of examples_bound and examples_release over raw device pointers, shared by the
// tensor launchers (examples_cuda.cu) and the test emulator. Declare `launch` first.
#pragma once

#include <stdint.h>

#include "examples_kernels.cuh"

namespace bpclip {
namespace cuda {

// bound [B] (double) of B examples with Nw weight and Nb bias values each (w / bias null where
// absent); nonfinite may be null.
template <typename T>
void examples_bound_device(const T* w, const T* bias, int64_t B, int64_t Nw, int64_t Nb, bool fp64, double* out,
                           unsigned long long* nonfinite) {
  const int64_t n = Nw + Nb;
  launch(examples_bound_kernel<T, float>, B, kBoundParts, w, bias, Nw, Nb, examples_bound_tiny(n, fp64),
         examples_bound_factor(n), out, nonfinite, static_cast<float*>(nullptr), 0.0, 0, 0.0);
}

// examples_bound_device's bound [B] and, in the same launch, factor [B] (fac_t double for fp64 data,
// else float) of each bound against bound_eff (exact_factors of the one layer); nonfinite (not null)
// += the examples exact_factors would count.
template <typename T, typename fac_t>
void examples_factors_device(const T* w, const T* bias, int64_t B, int64_t Nw, int64_t Nb, bool fp64, double* out,
                             unsigned long long* nonfinite, fac_t* factor, double bound_eff, int fn, double gamma) {
  const int64_t n = Nw + Nb;
  launch(examples_bound_kernel<T, fac_t>, B, kBoundParts, w, bias, Nw, Nb, examples_bound_tiny(n, fp64),
         examples_bound_factor(n), out, nonfinite, factor, bound_eff, fn, gamma);
}

// out_w [Nw], out_b [Nb] from the per-example values w [B, Nw], bias [B, Nb] and factor [B].
template <typename T, typename acc_t>
void examples_release_device(const T* w, const T* bias, const acc_t* factor, int64_t B, int64_t Nw, int64_t Nb,
                             uint64_t seed, uint64_t offset, double stdv, acc_t scale, T* out_w, T* out_b) {
  const int64_t tiles_w = (Nw + kReleaseTile - 1) / kReleaseTile;
  const int64_t tiles_b = (Nb + kReleaseTile - 1) / kReleaseTile;
  launch(examples_release_kernel<T, acc_t>, tiles_w + tiles_b, kReleaseParts * kReleaseTile, w, bias, factor, B, Nw,
         Nb, tiles_w, seed, offset, stdv, scale, out_w, out_b);
}

}  // namespace cuda
}  // namespace bpclip
