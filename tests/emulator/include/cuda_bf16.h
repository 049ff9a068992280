// Emulator stand-in for CUDA's cuda_bf16.h; the same rules as cuda_fp16.h here (intrinsics only).
#pragma once

#include "../simt.h"
#include "simt_halfbits.h"

struct __nv_bfloat16 {
  unsigned short __x;
};

inline float __bfloat162float(__nv_bfloat16 h) { return simt::bf16_bits_to_f32(h.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{simt::f32_to_bf16_bits(f, false)}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) { return __nv_bfloat16{simt::f32_to_bf16_bits(f, true)}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }

inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
}
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) - __bfloat162float(b));
}
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) * __bfloat162float(b));
}
inline __nv_bfloat16 __hdiv(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) / __bfloat162float(b));
}
// The product of two bf16 values is exact in double, so this rounds once, as the GPU does.
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __float2bfloat16_rn(static_cast<float>(static_cast<double>(__bfloat162float(a)) * __bfloat162float(b) +
                                                __bfloat162float(c)));
}
inline __nv_bfloat16 __hneg(__nv_bfloat16 a) { return __nv_bfloat16{static_cast<unsigned short>(a.__x ^ 0x8000u)}; }
inline __nv_bfloat16 __habs(__nv_bfloat16 a) { return __nv_bfloat16{static_cast<unsigned short>(a.__x & 0x7fffu)}; }
inline bool __heq(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) == __bfloat162float(b); }
inline bool __hlt(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) < __bfloat162float(b); }
inline bool __hgt(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) > __bfloat162float(b); }
inline bool __hisnan(__nv_bfloat16 a) { return (a.__x & 0x7fffu) > 0x7f80u; }
