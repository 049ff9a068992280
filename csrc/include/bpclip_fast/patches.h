// The zero-padded patches of a 2-D convolution's input, as im2col lays them out: out[i, row, t] with
// row = (ch kh + ki) kw + kj (channel-major, so a channel group's rows are one block) and t = oy wo +
// ox, the input pixel x[i, ch, oy sh - ph + ki dh, ox sw - pw + kj dw] upcast exactly to the
// accumulation dtype, or +0 where that pixel lies in the padding. Shared by the CPU loop
// (csrc/cpu/patches_cpu.cpp), the CUDA kernel (csrc/cuda/patches_kernels.cuh) and the test
// emulator. The input is read through its own strides (in elements), so channels_last, permuted,
// sliced (storage offset in the pointer) or expanded (stride 0) inputs give the pixels the
// convolution, and so the release, reads.
#pragma once

#include <stdint.h>

#include "macros.h"

namespace bpclip {

struct PatchGeometry {
  int64_t n, c, h, w;       // input sizes
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
  int64_t ho, wo;           // output positions, T = ho wo
  int64_t s0, s1, s2, s3;   // input strides
};

// The input's element offset for out[i, row, t] at flat index e of [n, c kh kw, ho wo], or -1
// where the tap reads the zero padding.
BPCLIP_HD inline int64_t patch_source(const PatchGeometry& g, int64_t e) {
  const int64_t T = g.ho * g.wo;
  const int64_t t = e % T, rest = e / T;
  const int64_t rows = g.c * g.kh * g.kw;
  const int64_t row = rest % rows, i = rest / rows;
  const int64_t kj = row % g.kw, ki = (row / g.kw) % g.kh, ch = row / (g.kh * g.kw);
  const int64_t iy = (t / g.wo) * g.sh - g.ph + ki * g.dh;
  const int64_t ix = (t % g.wo) * g.sw - g.pw + kj * g.dw;
  if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) return -1;
  return i * g.s0 + ch * g.s1 + iy * g.s2 + ix * g.s3;
}

}  // namespace bpclip
