// out[i] = RZ_f32(f * x[i]) = scale_rz_f32(f, x[i]) (bpclip_fast/clip.h), bit for bit, vectorised
// (csrc/cpu/clip_cpu.cpp: scale_rows' loop; examples_cpu.cpp: examples_release's fp32 rows).
#pragma once

#include <stdint.h>

namespace bpclip {

void scale_f32(const float* x, float f, float* out, int64_t n);

}  // namespace bpclip
