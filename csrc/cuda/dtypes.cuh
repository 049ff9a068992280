// Conversions between storage types and fp32 (fp64), by intrinsics only: torch builds with
// __CUDA_NO_HALF_CONVERSIONS__, and the test emulator supplies the same names.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bpclip_fast/clip.h"

namespace bpclip {
namespace cuda {

__device__ inline float to_acc(float v) { return v; }
__device__ inline double to_acc(double v) { return v; }
__device__ inline float to_acc(__half v) { return __half2float(v); }
__device__ inline float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
struct FromAcc;
template <>
struct FromAcc<float> {
  __device__ static float cvt(float v) { return v; }
};
template <>
struct FromAcc<double> {
  __device__ static double cvt(double v) { return v; }
};
template <>
struct FromAcc<__half> {
  __device__ static __half cvt(float v) { return __float2half_rn(v); }
};
template <>
struct FromAcc<__nv_bfloat16> {
  __device__ static __nv_bfloat16 cvt(float v) { return __float2bfloat16_rn(v); }
};

template <typename T, typename A>
__device__ inline T from_acc(A v) {
  return FromAcc<T>::cvt(v);
}

// Storage -> double, exactly (the reductions accumulate in double: bpclip_fast/clip.h).
template <typename T>
__device__ inline double to_f64(T v) {
  return static_cast<double>(to_acc(v));
}

// The stored clipped element RZ(f * x) and the stored factor, by the shared functions of
// bpclip_fast/clip.h (the same code as the CPU kernels; bits -> half/bf16 by intrinsics).
__device__ inline float scale_store(float f, float x) { return scale_rz_f32(f, x); }
__device__ inline double scale_store(double f, double x) { return scale_rz_f64(f, x); }
__device__ inline __half scale_store(float f, __half x) {
  return __ushort_as_half(scale_rz_f16_bits(f, __half2float(x)));
}
__device__ inline __nv_bfloat16 scale_store(float f, __nv_bfloat16 x) {
  return __ushort_as_bfloat16(scale_rz_bf16_bits(f, __bfloat162float(x)));
}
__device__ inline float store_factor(double s, float*) { return f64_to_f32_rz(s); }
__device__ inline double store_factor(double s, double*) { return s; }

}  // namespace cuda
}  // namespace bpclip
