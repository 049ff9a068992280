// How a row reduction is split up and what it sums, shared by the CPU and CUDA backends and the
// test emulator.
// A row (one example) of N elements is reduced as G groups of S elements, each split into K chunks
// of at most `chunk` elements: partial[(b*G + g)*K + k]. For l2 the groups are one row (q(a) = a);
// for l15 the groups are channels (q(a) = a^2) and the per-group sums are L1 norms.
#pragma once

#include <stdint.h>

namespace bpclip {

struct RowGeometry {
  int64_t B, N, G, S, K, chunk;
};

inline RowGeometry make_row_geometry(int64_t B, int64_t N, int64_t G, int64_t S, int64_t chunk) {
  RowGeometry r{};
  r.B = B;
  r.N = N;
  r.G = G;
  r.S = S;
  r.chunk = chunk;
  r.K = S == 0 ? 0 : (S + chunk - 1) / chunk;
  return r;
}

// What one pass sums over each chunk: kSumSquares for the l2 norm, kSumAbs for the l15 channel
// sums, kDot for the clipping VJP (x . y, and x . x alongside in a second accumulator, so that the
// backward reads its inputs once). One definition, because the CPU and CUDA reductions and the
// emulator must agree on which mode is which.
enum ReduceMode : int { kSumSquares = 0, kSumAbs = 1, kDot = 2 };

}  // namespace bpclip
