// Runs the unmodified device code and launch sequences of csrc/cuda under the emulator, behind a
// C ABI for tests/test_emulator.py (ctypes). Buffers are host memory owned by the caller.
#include "simt.h"

#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace bpclip {
namespace cuda {

// The emulator's version of launch.h's launch(): same signature, same early return, same check.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), int64_t blocks, int threads, Args&&... args) {
  if (blocks <= 0) return;
  if (blocks > INT_MAX) simt::fail("bpclip_fast: tensor too large for one launch");
  simt::launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(threads)), 0,
               std::forward<Args>(args)...);
}

}  // namespace cuda
}  // namespace bpclip

#include "band_launch.cuh"
#include "bound_launch.cuh"
#include "checksum_launch.cuh"
#include "clip_launch.cuh"
#include "dgauss_launch.cuh"
#include "examples_launch.cuh"
#include "noise_launch.cuh"
#include "norm_affine_launch.cuh"
#include "patches_launch.cuh"
#include "tail_launch.cuh"

namespace {

using namespace bpclip;
using namespace bpclip::cuda;

enum Dtype : int { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3 };

// Calls fn.template operator()<T, fac_t>() for the dtype code, as AT_DISPATCH does in the launchers
// (fac_t: the type of the stored factor and norm).
template <typename Fn>
int dispatch(int dtype, Fn&& fn) {
  switch (dtype) {
    case kF32: fn.template operator()<float, float>(); break;
    case kF64: fn.template operator()<double, double>(); break;
    case kF16: fn.template operator()<__half, float>(); break;
    case kBF16: fn.template operator()<__nv_bfloat16, float>(); break;
    default: return 2;  // not a dtype the launchers dispatch
  }
  return simt::has_error() ? 1 : 0;
}

// Workspace the launchers would take from the caching allocator (double: the reductions'
// accumulation type), poisoned with NaN here so that a partial sum that is read but never
// written shows up.
std::vector<double> poisoned(int64_t n) { return std::vector<double>(static_cast<size_t>(n > 0 ? n : 1), NAN); }

}  // namespace

// Test-only: Box-Muller (bpclip_fast/philox.h) as device code, on caller-chosen words (hi, lo,
// angle) per pair, so that the Gaussian tail's extreme value (radius words 0, which no Philox output
// can be found to give) is checked in the emulated device build too.
namespace bpclip_test {

__global__ void box_muller_probe_kernel(const uint32_t* words, int64_t pairs, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  bpclip::box_muller(words[3 * i], words[3 * i + 1], words[3 * i + 2], &out[2 * i], &out[2 * i + 1]);
}

// The float64 construction: (hi, lo, angle, angle_lo) per pair.
__global__ void box_muller_f64_probe_kernel(const uint32_t* words, int64_t pairs, double* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  bpclip::box_muller_f64(words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3], &out[2 * i],
                         &out[2 * i + 1]);
}

}  // namespace bpclip_test

extern "C" {

int simt_box_muller_probe(const uint32_t* words, int64_t pairs, float* out) {
  launch(bpclip_test::box_muller_probe_kernel, (pairs + 63) / 64, 64, words, pairs, out);
  return simt::has_error() ? 1 : 0;
}

int simt_box_muller_f64_probe(const uint32_t* words, int64_t pairs, double* out) {
  launch(bpclip_test::box_muller_f64_probe_kernel, (pairs + 63) / 64, 64, words, pairs, out);
  return simt::has_error() ? 1 : 0;
}

int simt_clip_rows(int dtype, const void* x, int64_t B, int64_t N, int64_t G, int64_t S, int l15, double bound,
                   int fn, double gamma, void* out, void* factor, void* norm, int64_t* nonfinite) {
  const RowGeometry r = make_row_geometry(B, N, G, S, kReduceChunk);
  return dispatch(dtype, [&]<typename T, typename fac_t>() {
    auto partial = poisoned(partial_count(r));
    clip_rows_device<T, fac_t>(static_cast<const T*>(x), r, l15 != 0, bound, fn, gamma, partial.data(),
                               static_cast<fac_t*>(norm), static_cast<fac_t*>(factor),
                               reinterpret_cast<unsigned long long*>(nonfinite), static_cast<T*>(out));
  });
}

int simt_scale_rows(int dtype, const void* x, const void* factor, int64_t B, int64_t N, void* out) {
  return dispatch(dtype, [&]<typename T, typename fac_t>() {
    scale_rows_device<T, fac_t>(static_cast<const T*>(x), static_cast<const fac_t*>(factor), B, N,
                                static_cast<T*>(out));
  });
}

int simt_clip_rows_backward(int dtype, const void* g, const void* xc, const void* factor, const void* norm, int64_t B,
                            int64_t N, double bound, int fn, void* out) {
  const RowGeometry r = make_row_geometry(B, N, 1, N, kReduceChunk);
  return dispatch(dtype, [&]<typename T, typename fac_t>() {
    auto partial = poisoned(backward_partial_count(r));
    auto sums = poisoned(backward_sums_count(r));
    clip_rows_backward_device<T, fac_t>(static_cast<const T*>(g), static_cast<const T*>(xc),
                                        static_cast<const fac_t*>(factor), static_cast<const fac_t*>(norm), r, bound,
                                        fn, partial.data(), sums.data(), static_cast<T*>(out));
  });
}

// blocks <= 0: the launcher's own grid (noise_launch.cuh) for a device of sm_count multiprocessors;
// otherwise this grid, to exercise the kernel's grid-stride loop on small buffers (the variant is
// chosen by buf's alignment, as the launcher does).
int simt_philox_noise(int dtype, void* buf, int64_t n, uint64_t seed, uint64_t offset, double stdv, int accumulate,
                      int64_t blocks, int threads, int sm_count, double scale) {
  return dispatch(dtype, [&]<typename T, typename fac_t>() {
    if (blocks <= 0) {
      philox_noise_device<T>(static_cast<T*>(buf), n, seed, offset, stdv, accumulate != 0, sm_count, scale);
    } else {
      launch_philox_noise<T>(static_cast<T*>(buf), n, seed, offset, stdv, accumulate != 0, blocks, threads, scale);
    }
  });
}

// banded_row_ over a caller ring [slots, P] and n_outs caller outs (outs[k] covering starts[k] onward,
// lens[k] elements); blocks as simt_philox_noise.
int simt_banded_row(int dtype, void* ring, int64_t slots, int64_t P, void* const* outs, const int64_t* starts,
                    const int64_t* lens, int n_outs, int newest, const double* weights, uint64_t seed, uint64_t offset,
                    double stdv, int64_t blocks, int threads, int sm_count) {
  if (slots < 1 || slots > kBandMaxSlots || n_outs < 0 || n_outs > kBandMaxOuts) return 2;
  auto run = [&]<typename T>() {
    BandRowArgs<T> a{};
    for (int k = 0; k < slots; ++k) a.weights[k] = static_cast<T>(weights[k]);
    a.n_outs = n_outs;
    for (int k = 0; k < n_outs; ++k) {
      a.outs[k] = static_cast<T*>(outs[k]);
      a.starts[k] = starts[k];
      a.ends[k] = starts[k] + lens[k];
    }
    a.stdv = static_cast<T>(stdv);
    a.slots = static_cast<int>(slots);
    a.newest = newest;
    banded_row_device<T>(static_cast<T*>(ring), P, seed, offset, a, sm_count, blocks, threads);
  };
  // float32 and float64 only, as the op's AT_DISPATCH_FLOATING_TYPES
  if (dtype == kF32) {
    run.template operator()<float>();
  } else if (dtype == kF64) {
    run.template operator()<double>();
  } else {
    return 2;
  }
  return simt::has_error() ? 1 : 0;
}

// philox_noise2_ over two caller buffers; blocks as simt_philox_noise.
int simt_philox_noise2(int dtype, void* w, int64_t nw, void* b, int64_t nb, uint64_t seed, uint64_t offset, double stdv,
                       int accumulate_w, int accumulate_b, int64_t blocks, int threads, int sm_count, double scale) {
  return dispatch(dtype, [&]<typename T, typename fac_t>() {
    if (blocks <= 0) {
      philox_noise2_device<T>(static_cast<T*>(w), nw, static_cast<T*>(b), nb, seed, offset, stdv, accumulate_w != 0,
                              accumulate_b != 0, sm_count, scale);
    } else {
      launch_philox_noise2<T>(static_cast<T*>(w), nw, static_cast<T*>(b), nb, seed, offset, stdv, accumulate_w != 0,
                              accumulate_b != 0, blocks, threads, scale);
    }
  });
}

// layer_tail_ over caller buffers: w, b and rows in dtype's accumulation type (fac_t), g, xc and out
// in dtype; g null: no VJP (B = N = 0); sum_rows 0: b noised as it holds (rows ignored).
int simt_layer_tail(int dtype, void* w, int64_t nw, void* b, int64_t nb, int sum_rows, const void* rows, int64_t R,
                    uint64_t seed,
                    uint64_t offset, double stdv, int draw, double scale, const void* g, const void* xc,
                    const void* factor, const void* norm, int64_t B, int64_t N, double bound, int fn, void* out,
                    int sm_count) {
  const RowGeometry r = make_row_geometry(B, N, 1, N, kReduceChunk);
  return dispatch(dtype, [&]<typename T, typename fac_t>() {
    auto partial = poisoned(backward_partial_count(r));
    auto sums = poisoned(backward_sums_count(r));
    layer_tail_device<T, fac_t>(static_cast<fac_t*>(w), nw, static_cast<fac_t*>(b), nb, sum_rows != 0,
                                static_cast<const fac_t*>(rows), R, seed, offset, stdv, draw != 0, scale,
                                static_cast<const T*>(g), static_cast<const T*>(xc),
                                static_cast<const fac_t*>(factor), static_cast<const fac_t*>(norm), r, bound, fn,
                                partial.data(), sums.data(), static_cast<T*>(out), sm_count);
  });
}

int simt_scale_rows2(int dtype, const void* x, const void* fx, int64_t Nx, void* ox, const void* y, const void* fy,
                     int64_t Ny, int mask_y, int64_t B, void* oy) {
  return dispatch(dtype, [&]<typename T, typename fac_t>() {
    scale_rows2_device<T, fac_t>(static_cast<const T*>(x), static_cast<const fac_t*>(fx), Nx, static_cast<T*>(ox),
                                 static_cast<const T*>(y), static_cast<const fac_t*>(fy), Ny, mask_y != 0, B,
                                 static_cast<T*>(oy));
  });
}

int simt_clip_rows_rescale(int dtype, const void* g, int64_t B, int64_t N, int64_t G, int64_t S, int l15, double bound,
                           int fn, double gamma, void* out, void* factor, void* norm, int64_t* nonfinite,
                           const void* x, const void* x_factor, int64_t Nx, void* x_out) {
  const RowGeometry r = make_row_geometry(B, N, G, S, kReduceChunk);
  return dispatch(dtype, [&]<typename T, typename fac_t>() {
    auto partial = poisoned(partial_count(r));
    clip_rows_rescale_device<T, fac_t>(static_cast<const T*>(g), r, l15 != 0, bound, fn, gamma, partial.data(),
                                       static_cast<fac_t*>(norm), static_cast<fac_t*>(factor),
                                       reinterpret_cast<unsigned long long*>(nonfinite), static_cast<T*>(out),
                                       static_cast<const T*>(x), static_cast<const fac_t*>(x_factor), Nx,
                                       static_cast<T*>(x_out));
  });
}

// mean and rstd in the accumulation dtype (as the launcher converts them); gw, gb [B, D] likewise.
int simt_norm_affine(int dtype, const void* g, const void* x, const void* mean, const void* rstd, int layer_norm,
                     int64_t B, int64_t R, int64_t D, int64_t G, void* gw, void* gb) {
  return dispatch(dtype, [&]<typename T, typename acc_t>() {
    // NaN-poisoned like the launchers' workspace, so that a partial read before it is written shows.
    std::vector<acc_t> work(static_cast<size_t>(std::max<int64_t>(1, affine_workspace_count(layer_norm, B, R, D))),
                            static_cast<acc_t>(NAN));
    norm_affine_device<T, acc_t>(static_cast<const T*>(g), static_cast<const T*>(x), static_cast<const acc_t*>(mean),
                                 static_cast<const acc_t*>(rstd), layer_norm != 0, B, R, D, G, work.data(),
                                 static_cast<acc_t*>(gw), static_cast<acc_t*>(gb));
  });
}

// examples_bound over w [B, Nw] and bias [B, Nb] (either null); nonfinite may be null.
int simt_examples_bound(int dtype, const void* w, const void* bias, int64_t B, int64_t Nw, int64_t Nb, double* out,
                        int64_t* nonfinite) {
  return dispatch(dtype, [&]<typename T, typename acc_t>() {
    examples_bound_device<T>(static_cast<const T*>(w), static_cast<const T*>(bias), B, Nw, Nb, dtype == kF64, out,
                             reinterpret_cast<unsigned long long*>(nonfinite));
  });
}

// examples_factors: examples_bound's out [B] and exact_factors' factor [B] (fp32; fp64 when fp64) of
// each bound, in one launch; nonfinite not null.
int simt_examples_factors(int dtype, const void* w, const void* bias, int64_t B, int64_t Nw, int64_t Nb, double* out,
                          int64_t* nonfinite, int fp64, void* factor, double bound_eff, int fn, double gamma) {
  auto* counter = reinterpret_cast<unsigned long long*>(nonfinite);
  return dispatch(dtype, [&]<typename T, typename acc_t>() {
    const T* wp = static_cast<const T*>(w);
    const T* bp = static_cast<const T*>(bias);
    if (fp64) {
      examples_factors_device<T, double>(wp, bp, B, Nw, Nb, dtype == kF64, out, counter, static_cast<double*>(factor),
                                         bound_eff, fn, gamma);
    } else {
      examples_factors_device<T, float>(wp, bp, B, Nw, Nb, dtype == kF64, out, counter, static_cast<float*>(factor),
                                        bound_eff, fn, gamma);
    }
  });
}

// examples_release: out_w [Nw], out_b [Nb] of the values' dtype; factor [B] of the accumulation dtype.
int simt_examples_release(int dtype, const void* w, const void* bias, const void* factor, int64_t B, int64_t Nw,
                          int64_t Nb, uint64_t seed, uint64_t offset, double stdv, double scale, void* out_w,
                          void* out_b) {
  return dispatch(dtype, [&]<typename T, typename acc_t>() {
    examples_release_device<T, acc_t>(static_cast<const T*>(w), static_cast<const T*>(bias),
                                      static_cast<const acc_t*>(factor), B, Nw, Nb, seed, offset, stdv,
                                      static_cast<acc_t>(scale), static_cast<T*>(out_w), static_cast<T*>(out_b));
  });
}

// exact_bound_ over contiguous-or-strided fp32/fp64 buffers (dtype kF32 or kF64); geometry as
// bpclip_fast/bound.h's BoundGeometry, given as 16 int64 (examples, per, T, dx, dg, p, L, 9 strides)
// and flags; consts: kBoundConsts doubles.
// bound.h's position_split, for the rule's own test.
int simt_position_split(int64_t n) { return position_split(n); }

int simt_exact_bound(int dtype, const void* x, const void* g, const void* gb, const void* wa, const void* wb,
                     const int64_t* geo, int flags, const double* consts, double* sq, double* bound,
                     int64_t* nonfinite) {
  const BoundGeometry s{geo[0], geo[1], geo[2], geo[3], geo[4], geo[5], geo[6], geo[7],
                        geo[8], geo[9], geo[10], geo[11], geo[12], geo[13], geo[14], geo[15], flags};
  std::vector<double> scratch(static_cast<size_t>(bound_scratch(s)));
  auto run = [&]<typename T>() {
    exact_bound_device<T>(static_cast<const T*>(x), static_cast<const T*>(g), static_cast<const T*>(gb),
                          static_cast<const T*>(wa), static_cast<const T*>(wb), s, consts, sq, bound,
                          reinterpret_cast<unsigned long long*>(nonfinite), scratch.data());
  };
  if (dtype == kF32) run.template operator()<float>();
  else if (dtype == kF64) run.template operator()<double>();
  else return 2;
  return simt::has_error() ? 1 : 0;
}

// conv_patches of x (any strides, given in geo) into out [n, c kh kw, ho wo] of the accumulation
// dtype; geo: bpclip_fast/patches.h's PatchGeometry as 18 int64 in its order.
int simt_conv_patches(int dtype, const void* x, const int64_t* geo, void* out) {
  const PatchGeometry g{geo[0], geo[1], geo[2],  geo[3],  geo[4],  geo[5],  geo[6],  geo[7],  geo[8],
                        geo[9], geo[10], geo[11], geo[12], geo[13], geo[14], geo[15], geo[16], geo[17]};
  return dispatch(dtype, [&]<typename T, typename acc_t>() {
    conv_patches_device<T, acc_t>(static_cast<const T*>(x), g, static_cast<acc_t*>(out));
  });
}

// exact_factors over bounds [L, B] (float64); factor fp32 (fp64 when fp64).
int simt_exact_factors(const double* bounds, int64_t L, int64_t B, double inflate, double bound_eff, int fn,
                       double gamma, int fp64, void* factor, double* total, int64_t* nonfinite) {
  auto* counter = reinterpret_cast<unsigned long long*>(nonfinite);
  if (fp64) {
    exact_factors_device<double>(bounds, L, B, inflate, bound_eff, fn, gamma, static_cast<double*>(factor), total,
                                 counter);
  } else {
    exact_factors_device<float>(bounds, L, B, inflate, bound_eff, fn, gamma, static_cast<float*>(factor), total,
                                counter);
  }
  return simt::has_error() ? 1 : 0;
}

// word_checksum of n int64 words into *out (zeroed by the caller, as the launcher does); blocks <= 0:
// the launcher's grid for a device of sm_count multiprocessors, otherwise this grid (the grid-stride
// loop on small inputs).
int simt_word_checksum(const int64_t* words, int64_t n, uint64_t* out, int64_t blocks, int sm_count) {
  const auto* w = reinterpret_cast<const long long*>(words);
  auto* o = reinterpret_cast<unsigned long long*>(out);
  if (blocks <= 0) {
    word_checksum_device(w, n, o, sm_count);
  } else {
    launch(word_checksum_kernel, blocks, kChecksumThreads, w, n, o);
  }
  return simt::has_error() ? 1 : 0;
}

// discrete_gaussian_ of n elements into out; blocks <= 0: the launcher's grid for a device of
// sm_count multiprocessors, otherwise this grid (the grid-stride loop).
int simt_discrete_gaussian(int64_t* out, int64_t n, uint64_t seed, uint64_t offset, uint64_t sigma, int64_t blocks,
                           int sm_count) {
  auto* o = reinterpret_cast<long long*>(out);
  if (blocks <= 0) {
    discrete_gaussian_device(o, n, seed, offset, sigma, sm_count);
  } else {
    launch(discrete_gaussian_kernel, blocks, kDgThreads, o, n, seed, offset, sigma);
  }
  return simt::has_error() ? 1 : 0;
}

// integer_release_ of n elements of buf in place (dtype kF32 or kF64); blocks as for
// simt_discrete_gaussian.
int simt_integer_release(int dtype, void* buf, int64_t n, uint64_t seed, uint64_t offset, uint64_t first,
                         double multiplier, int grid_exp, uint64_t sigma, double scale, int64_t blocks, int sm_count) {
  auto run = [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    if (blocks <= 0) {
      integer_release_device<T>(p, n, seed, offset, first, multiplier, grid_exp, sigma, scale, sm_count);
    } else {
      launch(integer_release_kernel<T>, blocks, kDgThreads, p, n, seed, offset, first, multiplier, grid_exp, sigma,
             scale);
    }
  };
  if (dtype == kF64) {
    run(static_cast<double*>(buf));
  } else {
    run(static_cast<float*>(buf));
  }
  return simt::has_error() ? 1 : 0;
}

// The conversions of the half/bfloat16 stand-ins, for comparison with torch's.
void simt_f32_to_f16(const float* in, uint16_t* out, int64_t n, int rz) {
  for (int64_t i = 0; i < n; ++i) out[i] = (rz ? __float2half_rz(in[i]) : __float2half_rn(in[i])).__x;
}
void simt_f16_to_f32(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __half2float(__half{in[i]});
}
void simt_f32_to_bf16(const float* in, uint16_t* out, int64_t n, int rz) {
  for (int64_t i = 0; i < n; ++i) out[i] = (rz ? __float2bfloat16_rz(in[i]) : __float2bfloat16_rn(in[i])).__x;
}
void simt_bf16_to_f32(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __bfloat162float(__nv_bfloat16{in[i]});
}

}  // extern "C"
