// Device code of examples_bound and examples_release (the arithmetic and the summation orders:
// bpclip_fast/examples.h, shared with the CPU kernels of csrc/cpu/examples_cpu.cpp).
#pragma once

#include <stdint.h>

#include "bpclip_fast/examples.h"
#include "dtypes.cuh"
#include "noise_kernels.cuh"  // noise_store_value: the noise added exactly as philox_noise_ adds it

namespace bpclip {
namespace cuda {

// Block b bounds example b: thread t sums the squares of entries j = t, t + kBoundParts, .. of the
// example's row (weight values, then bias values), then the block halves its partials in shared
// memory. blockDim.x == kBoundParts. Without `factor` (examples_bound): nonfinite (may be null) +=
// the examples whose bound is not finite. With it (examples_factors): factor[b] is exact_factors'
// factor of this one bound (bound.h, example_factor, as exact_factors_kernel) and nonfinite += the
// examples that function counts.
template <typename T, typename fac_t>
__global__ void examples_bound_kernel(const T* __restrict__ w, const T* __restrict__ bias, int64_t Nw, int64_t Nb,
                                      double tiny, double r, double* __restrict__ out,
                                      unsigned long long* __restrict__ nonfinite, fac_t* __restrict__ factor,
                                      double bound_eff, int fn, double gamma) {
  __shared__ double part[kBoundParts];
  const int64_t b = blockIdx.x;
  const int t = threadIdx.x;
  const int64_t n = Nw + Nb;
  double s = 0;
  for (int64_t j = t; j < n; j += kBoundParts) {
    const double v = j < Nw ? to_f64(w[b * Nw + j]) : to_f64(bias[b * Nb + (j - Nw)]);
    s += v * v;
  }
  part[t] = s;
  __syncthreads();
  for (int half = kBoundParts / 2; half > 0; half >>= 1) {
    if (t < half) part[t] += part[t + half];
    __syncthreads();
  }
  if (t != 0) return;
  const double bound = examples_bound_of(part[0], tiny, r);
  out[b] = bound;
  if (factor == nullptr) {
    if (nonfinite != nullptr && !finite_bound(bound)) atomicAdd(nonfinite, 1ull);
    return;
  }
  bool odd = false;
  factor[b] = static_cast<fac_t>(example_factor(bound, sizeof(fac_t) == 8, bound_eff, fn, gamma, &odd));
  if (odd) atomicAdd(nonfinite, 1ull);
}

// Block k releases a tile of kReleaseTile consecutive elements: tiles [0, tiles_w) of the weight
// (counter offset `offset`), the rest of the bias (offset + 1). Lane l of warp p sums element
// tile * kReleaseTile + l over the examples b = p, p + kReleaseParts, ..; warp 0 adds the parts,
// the noise and the scale and stores. blockDim.x == kReleaseParts * kReleaseTile.
template <typename T, typename acc_t>
__global__ void examples_release_kernel(const T* __restrict__ w, const T* __restrict__ bias,
                                        const acc_t* __restrict__ factor, int64_t B, int64_t Nw, int64_t Nb,
                                        int64_t tiles_w, uint64_t seed, uint64_t offset, double stdv, acc_t scale,
                                        T* __restrict__ out_w, T* __restrict__ out_b) {
  __shared__ acc_t part[kReleaseParts][kReleaseTile];
  const bool is_w = static_cast<int64_t>(blockIdx.x) < tiles_w;
  const int64_t tile = is_w ? blockIdx.x : blockIdx.x - tiles_w;
  const T* x = is_w ? w : bias;
  T* out = is_w ? out_w : out_b;
  const int64_t N = is_w ? Nw : Nb;
  const uint64_t off = is_w ? offset : offset + 1;
  const int lane = threadIdx.x % kReleaseTile;
  const int p = threadIdx.x / kReleaseTile;
  const int64_t o = tile * kReleaseTile + lane;
  acc_t s = 0;
  if (o < N) {
    for (int64_t b = p; b < B; b += kReleaseParts) {
      const acc_t f = factor[b];
      if (f != acc_t(0)) s += to_acc(scale_store(f, x[b * N + o]));  // never 0 * x: x may be NaN/Inf
    }
  }
  part[p][lane] = s;
  __syncthreads();
  if (p != 0 || o >= N) return;
  acc_t column[kReleaseParts];
  for (int q = 0; q < kReleaseParts; ++q) column[q] = part[q][lane];
  acc_t v = release_parts_total(column);
  if (stdv > 0.0) {
    normal_t<acc_t> z[kNormalsPerGroup];
    philox_normal8(seed, off, static_cast<uint64_t>(o / kNormalsPerGroup), z);
    v = noise_store_value<acc_t, true>(v, z[o % kNormalsPerGroup], static_cast<normal_t<acc_t>>(stdv));
  }
  if (scale != acc_t(1)) v = v * scale;
  out[o] = from_acc<T>(v);
}

}  // namespace cuda
}  // namespace bpclip
