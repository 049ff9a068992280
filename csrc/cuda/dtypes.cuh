// Conversions between storage types and the fp32 (fp64) accumulation type, by intrinsics only:
// torch builds with __CUDA_NO_HALF_CONVERSIONS__, and the test emulator supplies the same names.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

__device__ inline float acc_sqrt(float v) { return sqrtf(v); }
__device__ inline double acc_sqrt(double v) { return sqrt(v); }

}  // namespace cuda
}  // namespace bpclip
