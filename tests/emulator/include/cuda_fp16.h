// Emulator stand-in for CUDA's cuda_fp16.h. Like torch's CUDA build (__CUDA_NO_HALF_OPERATORS__,
// __CUDA_NO_HALF_CONVERSIONS__), __half has no implicit conversions and no operators: device code
// converts with the intrinsics and computes with __hadd & co.
#pragma once

#include "../simt.h"
#include "simt_halfbits.h"

struct __half {
  unsigned short __x;
};

inline float __half2float(__half h) { return simt::f16_bits_to_f32(h.__x); }
inline __half __float2half_rn(float f) { return __half{simt::f32_to_f16_bits(f, false)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __float2half_rz(float f) { return __half{simt::f32_to_f16_bits(f, true)}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }

inline __half __hadd(__half a, __half b) { return __float2half_rn(__half2float(a) + __half2float(b)); }
inline __half __hsub(__half a, __half b) { return __float2half_rn(__half2float(a) - __half2float(b)); }
inline __half __hmul(__half a, __half b) { return __float2half_rn(__half2float(a) * __half2float(b)); }
inline __half __hdiv(__half a, __half b) { return __float2half_rn(__half2float(a) / __half2float(b)); }
// fma in double is exact for half operands (11-bit mantissas), so one rounding as on the GPU.
inline __half __hfma(__half a, __half b, __half c) {
  return __float2half_rn(static_cast<float>(static_cast<double>(__half2float(a)) * __half2float(b) +
                                            __half2float(c)));
}
inline __half __hneg(__half a) { return __half{static_cast<unsigned short>(a.__x ^ 0x8000u)}; }
inline __half __habs(__half a) { return __half{static_cast<unsigned short>(a.__x & 0x7fffu)}; }
inline bool __heq(__half a, __half b) { return __half2float(a) == __half2float(b); }
inline bool __hne(__half a, __half b) { return __half2float(a) != __half2float(b); }
inline bool __hlt(__half a, __half b) { return __half2float(a) < __half2float(b); }
inline bool __hle(__half a, __half b) { return __half2float(a) <= __half2float(b); }
inline bool __hgt(__half a, __half b) { return __half2float(a) > __half2float(b); }
inline bool __hge(__half a, __half b) { return __half2float(a) >= __half2float(b); }
inline bool __hisnan(__half a) { return (a.__x & 0x7fffu) > 0x7c00u; }
inline int __hisinf(__half a) { return (a.__x & 0x7fffu) == 0x7c00u ? ((a.__x & 0x8000u) ? -1 : 1) : 0; }
